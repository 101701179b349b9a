"""Models as the learner sees them: loading, the FSDP2 layout, and the packed forward.

Packed attention: the learner registers its own attention function, ``agentrl_varlen``, with
transformers' ``AttentionInterface``; it runs causal attention on each sequence slice given by
``cu_seq_lens_q``, so attention never crosses sequences and costs per sequence, not per
micro-batch. It works for any Hugging Face decoder that dispatches through
``ALL_ATTENTION_FUNCTIONS``. A module whose attention is bidirectional (``is_causal`` False: a
vision tower's blocks, which transformers calls once per image or window) gets plain full attention.

Vision-language models (a config with ``vision_config``, e.g. Qwen2.5-VL) load as
``AutoModelForImageTextToText``; a micro-batch's ``pixel_values`` / ``image_grid_thw`` and mRoPE
``position_ids`` go into the forward. Every forward of such a model runs its vision tower once: a
micro-batch without images runs it on a blank image whose output is added times 0, so that FSDP's
collectives of the vision blocks line up on every rank.

FSDP2 (:func:`shard_model`, the only place parallelism is applied): one ``fully_shard`` unit per
decoder layer and per vision block (``_no_split_modules``) and one for the root; bf16 compute with
fp32 reduction and master weights on GPU, fp32 on CPU. Parameter names stay Hugging Face's whatever
the options, so checkpoints and weight pushes use them. See docs/learner.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from agentrl.learner.batching import MicroBatch

VARLEN_ATTENTION = "agentrl_varlen"


def varlen_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal attention within each packed sequence. ``query``: [1, H, N, D]; key/value:
    [1, H_kv, N, D]; returns [1, N, H, D] like transformers' attention functions.

    A bidirectional module (``is_causal`` False, from the call or the module) gets full attention
    over what it passed: transformers' vision towers split images and windows themselves outside
    flash attention, and the ``cu_seq_lens_*`` they pass along are the text's."""
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    if kwargs.get("sliding_window"):
        raise ValueError("agentrl_varlen attention does not implement sliding windows")
    gqa = query.shape[1] != key.shape[1]  # grouped-query attention: sdpa maps query head h to KV head h // groups
    if not causal:
        mask = attention_mask if isinstance(attention_mask, Tensor) else None
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    bounds = cu.tolist() if isinstance(cu, Tensor) else list(cu)
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling, enable_gqa=gqa
        )
        for s, e in zip(bounds[:-1], bounds[1:])
        if e > s
    ]
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


def register_varlen_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)


def has_vision(config: Any) -> bool:
    """Whether a Hugging Face config is a vision-language model's (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config: Any) -> Any:
    """``AutoModelForImageTextToText`` for a vision-language config, else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if has_vision(config) else AutoModelForCausalLM


def load_causal_lm(path: str, *, device: torch.device | str = "cpu") -> nn.Module:
    """The policy (a Hugging Face causal LM, or a vision-language model when the config has a
    ``vision_config``) in fp32 with the varlen attention, ready for packed batches. The trainer,
    SFT and the KL reference all load through here."""
    from transformers import AutoConfig

    register_varlen_attention()
    cls = auto_model_class(AutoConfig.from_pretrained(path))
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation=VARLEN_ATTENTION)
    model.config.use_cache = False
    return model.to(device)  # pyright: ignore[reportArgumentType]  # transformers' wrapped .to reads as unbound


class ValueModel(nn.Module):
    """PPO's critic: the policy's architecture without the LM head, plus a scalar head
    (initialised to 0, so the first value estimates are 0 and the first advantages are
    plain returns)."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, **kwargs: Any) -> Tensor:
        """Values ``[B, N]``."""
        hidden = self.backbone(input_ids=input_ids, use_cache=False, **kwargs)
        # clone: a linear layer on 3-D input returns a view, which FSDP2 warns about as a root output
        return self.value_head(hidden.last_hidden_state).squeeze(-1).clone()


def load_value_model(path: str, *, device: torch.device | str = "cpu") -> ValueModel:
    from transformers import AutoConfig, AutoModel

    register_varlen_attention()
    backbone = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation=VARLEN_ATTENTION)
    backbone.config.use_cache = False
    config = AutoConfig.from_pretrained(path)
    return ValueModel(backbone, config.get_text_config().hidden_size).to(device)


class _BlankImage:
    """Makes every forward of a vision-language model run its vision tower: when a forward reaches
    the language model without the tower having run (a micro-batch without images), the tower runs
    on one blank image of the smallest grid and its output joins ``inputs_embeds`` times 0. The
    values do not change; every rank's FSDP collectives for the vision blocks (all-gathers in the
    forward, reduce-scatters in the backward) happen at the same place whatever its images."""

    def __init__(self, visual: nn.Module) -> None:
        self.visual = visual
        self.ran = False

    def reset(self, *_: Any) -> None:
        self.ran = False

    def mark(self, *_: Any) -> None:
        self.ran = True

    def blank(self, device: torch.device) -> tuple[Tensor, Tensor]:
        cfg: Any = self.visual.config
        m = int(cfg.spatial_merge_size)
        width = int(cfg.in_channels) * int(cfg.temporal_patch_size) * int(cfg.patch_size) ** 2
        return torch.zeros(m * m, width, device=device), torch.tensor([[1, m, m]], device=device)

    def before_language_model(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        embeds = kwargs.get("inputs_embeds")
        if self.ran or not isinstance(embeds, Tensor):
            return None
        pixels, grid = self.blank(embeds.device)
        out = self.visual(pixels, grid_thw=grid)
        features = getattr(out, "pooler_output", None)
        features = out[0] if features is None else features
        kwargs["inputs_embeds"] = embeds + features.sum().to(embeds.dtype) * 0
        return args, kwargs


def vision_owner(model: nn.Module) -> nn.Module | None:
    """The module holding a vision-language model's ``visual`` tower and ``language_model`` (None:
    a text model)."""
    for module in model.modules():
        if isinstance(getattr(module, "visual", None), nn.Module) and isinstance(
            getattr(module, "language_model", None), nn.Module
        ):
            return module
    return None


def _install_blank_image(model: nn.Module) -> None:
    owner = vision_owner(model)
    if owner is None:
        return
    visual, language_model = owner.get_submodule("visual"), owner.get_submodule("language_model")
    hook = _BlankImage(visual)
    owner.register_forward_pre_hook(hook.reset)
    visual.register_forward_hook(hook.mark)
    language_model.register_forward_pre_hook(hook.before_language_model, with_kwargs=True)


def _layer_classes(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(f"{type(model).__name__} lists no _no_split_modules: cannot find its decoder layers")
    return names


def shard_model(
    model: nn.Module,
    *,
    device: torch.device,
    activation_checkpointing: bool = False,
    trainable: bool = True,
) -> nn.Module:
    """Apply the FSDP2 layout (module docstring) in place and return the model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if activation_checkpointing and trainable:
        for module in model.modules():
            enable = getattr(module, "activation_checkpointing_enable", None)
            if getattr(module, "supports_gradient_checkpointing", False) and enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
                break
    _install_blank_image(model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layer_classes = _layer_classes(model)
    for module in list(model.modules()):
        if type(module).__name__ in layer_classes:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    # from_pretrained returns eval mode; transformers only checkpoints activations in train mode
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return model


def _forward_kwargs(mb: MicroBatch) -> dict[str, Any]:
    """Everything of ``mb`` a forward takes besides the ids: the packed boundaries, the positions
    ([1, N], or mRoPE's [3, 1, N]) and the images' pixels and grids when it has images."""
    kwargs: dict[str, Any] = {
        "position_ids": mb.position_ids,
        "cu_seq_lens_q": mb.cu_seqlens,
        "cu_seq_lens_k": mb.cu_seqlens,
    }
    if mb.pixel_values is not None:
        kwargs.update(pixel_values=mb.pixel_values, image_grid_thw=mb.image_grid_thw)
    return kwargs


def token_logprobs(
    model: nn.Module,
    mb: MicroBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    all_positions: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logprob of each target token under ``log_softmax(logits / temperature)`` (the
    distribution the engines sample from and report), and optionally the entropy.

    By default only the loss positions are scored: transformers' ``logits_to_keep`` applies
    the LM head to those rows only, so prompt and tool-result tokens cost no vocabulary
    projection or softmax (for a 150k vocabulary that is a large part of the step). Other
    positions read 0. ``all_positions`` scores every position.

    Returns ``(logprobs [N], entropy [N] or None)`` in fp32.
    """
    keep = None
    if not all_positions:
        keep = mb.loss_mask.nonzero().squeeze(-1)
        if keep.numel() == 0:  # still run the head (FSDP expects every rank to use every weight)
            keep = torch.zeros(1, dtype=torch.long, device=mb.loss_mask.device)
    out = model(
        input_ids=mb.input_ids, use_cache=False, logits_to_keep=0 if keep is None else keep, **_forward_kwargs(mb)
    )
    logits = out.logits.reshape(-1, out.logits.shape[-1]).float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = mb.targets if keep is None else mb.targets[keep]
    log_z = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - log_z
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = torch.softmax(logits, dim=-1)
            entropy = log_z - (probs * logits).sum(-1)
    if keep is not None:
        n = mb.targets.shape[0]
        logprobs = logprobs.new_zeros(n).index_put((keep,), logprobs)
        if entropy is not None:
            entropy = entropy.new_zeros(n).index_put((keep,), entropy)
    return logprobs, entropy


def token_values(model: nn.Module, mb: MicroBatch) -> Tensor:
    """The critic's value at each position, [N] fp32."""
    return model(input_ids=mb.input_ids, **_forward_kwargs(mb))[0].float()
