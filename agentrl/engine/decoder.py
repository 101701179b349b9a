"""The embedded engine's own forward for Llama-family decoders (Llama, Qwen2, Qwen3).

The same computation as transformers' modules, as plain functions over the model's own parameter
tensors (no copies: a weight update is seen at the next step) with fewer, larger tensor
operations: RoPE from a precomputed table (made by the model's own rotary module), K/V written by
flat index, prefill tokens packed without padding, grouped-query decode attention packed per K/V
head, in-place ops on the forward's own tensors. Why and how much: docs/performance.md.

Numerics follow transformers op for op, so logprobs match a transformers teacher-forced forward to
float rounding (the engine tests check 1e-4). Other architectures, rotary variants that change
with the sequence length, other activations and sliding-window layers take the runner's generic
path. See docs/engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def unsupported_reason(model) -> str | None:
    """Why ``model`` must use the generic path, or None when this module can run it."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (fast path: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    rope_type = model.get_decoder().rotary_emb.rope_type
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rotary type {rope_type!r}"
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or []
    ):
        return "sliding-window attention"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, then ``weight * x`` in the input's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@dataclass
class _Layer:
    """One decoder layer's parameters (the model's own tensors)."""

    ln1: torch.Tensor
    wq: torch.Tensor
    bq: torch.Tensor | None
    wk: torch.Tensor
    bk: torch.Tensor | None
    wv: torch.Tensor
    bv: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3's per-head RMSNorm of q and k
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ln2: torch.Tensor
    wg: torch.Tensor
    bg: torch.Tensor | None
    wu: torch.Tensor
    bu: torch.Tensor | None
    wd: torch.Tensor
    bd: torch.Tensor | None


def _layer(module) -> _Layer:
    a, m = module.self_attn, module.mlp
    q_norm = getattr(a, "q_norm", None)  # Qwen3 has them, Llama and Qwen2 do not
    k_norm = getattr(a, "k_norm", None)
    return _Layer(
        ln1=module.input_layernorm.weight,
        wq=a.q_proj.weight,
        bq=a.q_proj.bias,
        wk=a.k_proj.weight,
        bk=a.k_proj.bias,
        wv=a.v_proj.weight,
        bv=a.v_proj.bias,
        q_norm=None if q_norm is None else q_norm.weight,
        k_norm=None if k_norm is None else k_norm.weight,
        wo=a.o_proj.weight,
        bo=a.o_proj.bias,
        ln2=module.post_attention_layernorm.weight,
        wg=m.gate_proj.weight,
        bg=m.gate_proj.bias,
        wu=m.up_proj.weight,
        bu=m.up_proj.bias,
        wd=m.down_proj.weight,
        bd=m.down_proj.bias,
    )


class FunctionalDecoder:
    """Runs a supported model's decoder over the runner's slot K/V cache; returns final-normed hidden states."""

    def __init__(self, model, max_positions: int):
        inner = model.get_decoder()
        config = model.config
        self.embed = inner.embed_tokens.weight
        self.layers = [_layer(layer) for layer in inner.layers]
        self.norm = inner.norm.weight
        self.eps = float(inner.norm.variance_epsilon)
        self.qk_eps = (
            float(inner.layers[0].self_attn.q_norm.variance_epsilon) if self.layers[0].q_norm is not None else self.eps
        )
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.group = self.heads // self.kv_heads
        self.scale = float(inner.layers[0].self_attn.scaling)
        device, dtype = self.embed.device, self.embed.dtype
        positions = torch.arange(max_positions, device=device)[None]
        cos, sin = inner.rotary_emb(torch.empty(0, device=device, dtype=dtype), positions)
        half = self.head_dim // 2
        sign = torch.ones(self.head_dim, device=device, dtype=dtype)
        sign[:half] = -1
        self.cos = cos[0]  # [positions, head_dim]
        self.sin = sin[0] * sign  # rotate_half(x) * sin == cat(x2, x1) * (sign * sin)

    def forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        cache,
        row0: int,
        kv_len: int,
        mask: torch.Tensor,
        grid: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Packed tokens ``ids`` [M] at positions ``pos`` [M] of cache rows ``row0..``; returns their
        final-normed hidden states [M, hidden].

        Their K/V are written at those positions; attention reads positions ``0..kv_len`` of the
        rows under the additive ``mask``. A decode step (``grid`` None) has one token per row, rows
        in order, and ``mask`` [rows, 1, 1, kv_len]. A prefill gives ``grid`` = (row, column) of
        each token in its [rows, width] attention grid, and ``mask`` [rows, 1, width, kv_len]. Only
        attention sees that padded grid: every other operation runs on the M real tokens."""
        m = ids.shape[0]
        heads, kv_heads, d, group = self.heads, self.kv_heads, self.head_dim, self.group
        rows, width = mask.shape[0], mask.shape[2]
        slots = row0 + (torch.arange(rows, device=ids.device) if grid is None else grid[0])
        # Flat index of (slot, kv head, position) in a [slots * kv_heads * capacity, head_dim] view.
        write = (
            (slots[:, None] * kv_heads + torch.arange(kv_heads, device=ids.device)) * cache.capacity + pos[:, None]
        ).view(-1)  # [M * kv_heads]
        cos = self.cos[pos][:, None]  # [M, 1, D]
        sin = self.sin[pos][:, None]
        bmm_decode = grid is None and ids.device.type == "cpu"
        if bmm_decode:  # the mask once in the layout of the decode attention's batched matmuls
            mask = mask.view(rows, 1, 1, kv_len).expand(rows, kv_heads, group, kv_len).reshape(-1, group, kv_len)
        h = F.embedding(ids, self.embed)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.ln1, self.eps)
            q = F.linear(x, layer.wq, layer.bq).view(m, heads, d)
            k = F.linear(x, layer.wk, layer.bk).view(m, kv_heads, d)
            v = F.linear(x, layer.wv, layer.bv)
            if layer.q_norm is not None:
                assert layer.k_norm is not None, "q_norm and k_norm come together (Qwen3)"
                q = rms_norm(q, layer.q_norm, self.qk_eps)
                k = rms_norm(k, layer.k_norm, self.qk_eps)
            qk = torch.cat((q, k), dim=1)  # rotate q and k in one go: [M, heads + kv_heads, D]
            qk = torch.cat((qk[..., d // 2 :], qk[..., : d // 2]), dim=-1).mul_(sin).add_(qk.mul_(cos))
            q, k = qk[:, :heads], qk[:, heads:]
            k_buf, v_buf = cache.k[i], cache.v[i]
            k_buf.view(-1, d).index_copy_(0, write, k.reshape(-1, d))
            v_buf.view(-1, d).index_copy_(0, write, v.view(-1, d))
            keys, values = k_buf[row0 : row0 + rows, :, :kv_len], v_buf[row0 : row0 + rows, :, :kv_len]
            if bmm_decode:  # one query per row: its heads as [kv_heads, group], each K/V head read once
                scores = torch.baddbmm(
                    mask,
                    q.reshape(rows * kv_heads, group, d),
                    keys.reshape(rows * kv_heads, kv_len, d).transpose(1, 2),
                    alpha=self.scale,
                )
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)  # as transformers' eager
                o = torch.bmm(probs, values.reshape(rows * kv_heads, kv_len, d))
            elif grid is None:  # on accelerators, the fused kernel, the heads packed the same way
                o = F.scaled_dot_product_attention(
                    q.view(rows, kv_heads, group, d), keys, values, attn_mask=mask, scale=self.scale
                )
            else:  # queries placed in the padded grid for one attention call, then taken back out
                qg = q.new_zeros(rows, width, heads, d)
                qg[grid] = q
                o = F.scaled_dot_product_attention(
                    qg.transpose(1, 2), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=group > 1
                )
                o = o.transpose(1, 2)[grid]
            h.add_(F.linear(o.reshape(m, heads * d), layer.wo, layer.bo))  # h is this forward's own tensor
            x = rms_norm(h, layer.ln2, self.eps)
            gate = F.silu(F.linear(x, layer.wg, layer.bg), inplace=True)
            h.add_(F.linear(gate.mul_(F.linear(x, layer.wu, layer.bu)), layer.wd, layer.bd))
        return rms_norm(h, self.norm, self.eps)
