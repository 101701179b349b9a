"""Advantages and losses: pure functions over tensors, no model, no distributed state.

Token tensors are flat ``[N]`` (one packed micro-batch): element ``i`` scores the token the model
predicts at position ``i``; ``mask`` is 1 on the tokens the loss sees; ``seq_ids`` maps tokens to
sequences. ``logprobs`` is the policy being trained, ``proximal_logprobs`` the same weights at the
start of the step, ``behavior_logprobs`` what the engine sampled with.

The policy loss is the clipped PPO objective times a no-gradient correction weight, per recipe:
``decoupled`` (AReaL), ``tis = "token"`` / ``"sequence"`` (truncated importance sampling), or plain
PPO against the behaviour policy. When behaviour and proximal policy agree every recipe is plain
PPO (a unit test checks it). Regularisers: KL to the reference (``k1``/``k3``) and entropy.

Normalisation divides by ``normalizer``, which the trainer computes over the whole optimiser batch
on every rank, so accumulation and data parallelism give the gradient of one big batch. Metrics are
0-d detached tensors: ``_min``/``_max`` keys are extrema, the rest means over loss tokens.

See docs/learner.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

Metrics = dict[str, Tensor]


@dataclass(frozen=True)
class PolicyLossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float = 0.0  # 0: off; else c > 1
    decoupled: bool = True
    behavior_weight_cap: float = 2.0  # cap on pi_prox/mu (decoupled and TIS)
    behavior_weight_mode: str = "clamp"  # clamp | mask (decoupled only)
    tis: str = "none"  # none | token | sequence
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # k1 | k3
    entropy_coef: float = 0.0
    normalization: str = "token"  # token | sequence

    def __post_init__(self) -> None:
        if self.decoupled and self.tis != "none":
            raise ValueError(
                "decoupled and tis both correct pi_prox/mu: choose one (set learner.decoupled = false to use TIS)"
            )
        if self.tis not in ("none", "token", "sequence"):
            raise ValueError(f"tis must be none|token|sequence, got {self.tis!r}")
        if self.behavior_weight_mode not in ("clamp", "mask"):
            raise ValueError(f"behavior_weight_mode must be clamp|mask, got {self.behavior_weight_mode!r}")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator must be k1|k3, got {self.kl_estimator!r}")
        if self.normalization not in ("token", "sequence"):
            raise ValueError(f"normalization must be token|sequence, got {self.normalization!r}")
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be 0 (off) or > 1, got {self.dual_clip}")

    @property
    def uses_proximal(self) -> bool:
        """Whether the ratio is taken to pi_prox (else to the behaviour policy)."""
        return self.decoupled or self.tis != "none"

    @classmethod
    def from_learner(cls, learner: Any) -> PolicyLossConfig:
        """Build from a ``LearnerSection``."""
        return cls(
            clip_eps_low=learner.clip_eps_low,
            clip_eps_high=learner.clip_eps_high,
            dual_clip=learner.dual_clip,
            decoupled=learner.decoupled,
            behavior_weight_cap=learner.behavior_weight_cap,
            behavior_weight_mode=learner.behavior_weight_mode,
            tis=learner.tis,
            kl_coef=learner.kl_coef,
            kl_estimator=learner.kl_estimator,
            entropy_coef=learner.entropy_coef,
            normalization=learner.loss_normalization,
        )


# ------------------------------------------------------------------------------ advantages


def grpo_advantages(rewards: Tensor, normalize_std: bool = False, eps: float = 1e-6) -> Tensor:
    """GRPO: ``A_i = r_i - mean(r)`` over one group, divided by ``std(r) + eps`` when asked.

    The std is the population std (``unbiased=False``), as in DeepSeekMath; Dr. GRPO argues
    for leaving it out (the default here), because it up-weights near-uniform groups.
    """
    rewards = rewards.to(torch.float32)
    adv = rewards - rewards.mean()
    if normalize_std:
        adv = adv / (rewards.std(unbiased=False) + eps)
    return adv


def rloo_advantages(rewards: Tensor) -> Tensor:
    """REINFORCE leave-one-out: ``A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean(r))``."""
    rewards = rewards.to(torch.float32)
    g = rewards.numel()
    if g < 2:
        raise ValueError("RLOO needs at least 2 samples per group")
    return (rewards - rewards.mean()) * (g / (g - 1))


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over ``[B, T]``, stepping only over masked tokens.

    Only the tokens with ``mask = 1`` are actions: a tool result between two model turns is
    not a step of the MDP, so the recursion skips it (the next action's value is carried
    across). ``rewards`` holds the per-token reward (the trajectory's reward on its last
    action, 0 elsewhere). After the last action the value is 0 (episode end).

    Returns ``(advantages, returns)``, both 0 where ``mask = 0``; ``returns = A + V``.
    """
    mask_b = mask.bool()
    values = values.detach().to(torch.float32)
    rewards = rewards.to(torch.float32)
    batch, length = values.shape
    adv = torch.zeros_like(values)
    next_value = values.new_zeros(batch)
    gae = values.new_zeros(batch)
    for t in range(length - 1, -1, -1):
        m = mask_b[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * gae
        adv[:, t] = torch.where(m, step, torch.zeros_like(step))
        gae = torch.where(m, step, gae)
        next_value = torch.where(m, values[:, t], next_value)
    returns = (adv + values) * mask_b
    return adv, returns


# ------------------------------------------------------------------------------ reductions


def _seq_sum(x: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq_ids, x)


def masked_reduce(
    per_token: Tensor,
    mask: Tensor,
    *,
    normalization: str = "token",
    seq_ids: Tensor | None = None,
    num_seqs: int | None = None,
    count_mask: Tensor | None = None,
    normalizer: float | None = None,
    seq_weights: Tensor | None = None,
) -> Tensor:
    """Sum ``per_token * mask`` and normalise (see the module docstring).

    ``count_mask`` (default ``mask``) is what counts a token in the normaliser and in the
    per-sequence lengths: importance masking removes tokens from the sum, not the count.
    """
    count_mask = mask if count_mask is None else count_mask
    mask = mask.to(per_token.dtype)
    count_mask = count_mask.to(per_token.dtype)
    if normalization == "token":
        denom = count_mask.sum().clamp(min=1.0) if normalizer is None else normalizer
        return (per_token * mask).sum() / denom
    if seq_ids is None or num_seqs is None:
        raise ValueError("sequence normalisation needs seq_ids and num_seqs")
    seq_sum = _seq_sum(per_token * mask, seq_ids, num_seqs)
    seq_len = _seq_sum(count_mask, seq_ids, num_seqs)
    per_seq = seq_sum / seq_len.clamp(min=1.0)
    weights = torch.ones_like(per_seq) if seq_weights is None else seq_weights.to(per_seq.dtype)
    if normalizer is None:
        denom = (weights * (seq_len > 0).to(per_seq.dtype)).sum().clamp(min=1e-12)
    else:
        denom = normalizer
    return (per_seq * weights).sum() / denom


def _mean(x: Tensor, mask: Tensor) -> Tensor:
    mask = mask.to(x.dtype)
    return ((x * mask).sum() / mask.sum().clamp(min=1.0)).detach()


def _extreme(x: Tensor, mask: Tensor, largest: bool) -> Tensor:
    if not bool(mask.any()):
        return x.new_tensor(float("-inf") if largest else float("inf"))
    sel = x[mask.bool()]
    return (sel.max() if largest else sel.min()).detach()


# ------------------------------------------------------------------------------ losses


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

    ``k1 = logp - ref``; ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's estimator:
    unbiased, always >= 0, lower variance).
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


def importance_weights(
    proximal_logprobs: Tensor,
    behavior_logprobs: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    *,
    seq_ids: Tensor | None = None,
    num_seqs: int | None = None,
) -> tuple[Tensor, Tensor, Metrics]:
    """The no-gradient weight w correcting pi_prox vs mu, and the keep-mask.

    Returns ``(w, keep, metrics)``: ``w`` per token (1 when no correction applies),
    ``keep`` a bool mask of tokens that stay in the sum (``mask`` mode drops w > cap).
    Metrics describe the raw weight before truncation: ``iw_mean``, ``iw_min``, ``iw_max``
    and ``iw_truncated_frac`` (tokens clamped or masked).
    """
    mask_b = mask.bool()
    cap = cfg.behavior_weight_cap
    log_w = (proximal_logprobs - behavior_logprobs).detach().to(torch.float32)
    keep = mask_b.clone()
    if cfg.decoupled or cfg.tis == "token":
        raw = torch.exp(log_w.clamp(max=20.0))
        if cfg.decoupled and cfg.behavior_weight_mode == "mask":
            truncated = mask_b & (raw > cap)
            keep = mask_b & ~truncated
            w = torch.where(keep, raw, torch.zeros_like(raw))
        else:
            truncated = mask_b & (raw > cap)
            w = raw.clamp(max=cap)
    elif cfg.tis == "sequence":
        if seq_ids is None or num_seqs is None:
            raise ValueError("sequence-level TIS needs seq_ids and num_seqs")
        seq_log_w = _seq_sum(log_w * mask_b, seq_ids, num_seqs)
        raw = torch.exp(seq_log_w.clamp(max=20.0))[seq_ids]
        truncated = mask_b & (raw > cap)
        w = raw.clamp(max=cap)
    else:
        raw = torch.ones_like(log_w)
        truncated = torch.zeros_like(mask_b)
        w = raw
    metrics = {
        "iw_mean": _mean(raw, mask_b),
        "iw_min": _extreme(raw, mask_b, largest=False),
        "iw_max": _extreme(raw, mask_b, largest=True),
        "iw_truncated_frac": _mean(truncated.float(), mask_b),
    }
    return w.detach(), keep, metrics


def policy_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    *,
    seq_ids: Tensor | None = None,
    num_seqs: int | None = None,
    normalizer: float | None = None,
    seq_weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """The clipped policy-gradient loss with its correction and regularisers (module docstring).

    ``entropy`` (per token, with gradient when ``entropy_coef > 0``) and ``ref_logprobs``
    (when ``kl_coef > 0``) are optional; the entropy and KL metrics are reported whenever
    they are given. Returns ``(loss, metrics)``.
    """
    mask_b = mask.bool()
    old = proximal_logprobs if cfg.uses_proximal else behavior_logprobs
    old = old.detach()
    weights, keep, metrics = importance_weights(
        proximal_logprobs, behavior_logprobs, mask_b, cfg, seq_ids=seq_ids, num_seqs=num_seqs
    )
    log_ratio = (logprobs - old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(ratio.dtype)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if cfg.dual_clip:
        bound = -adv * cfg.dual_clip
        dual = (adv < 0) & (bound < pg)
        pg = torch.where(dual, bound, pg)
        metrics["dual_clip_frac"] = _mean(dual.float(), mask_b)
    per_token = weights * pg
    reduce = partial(
        masked_reduce,
        normalization=cfg.normalization,
        seq_ids=seq_ids,
        num_seqs=num_seqs,
        normalizer=normalizer,
        seq_weights=seq_weights,
    )
    pg_loss = reduce(per_token, keep, count_mask=mask_b)
    loss = pg_loss
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs.detach(), cfg.kl_estimator)
        if cfg.kl_coef:
            loss = loss + cfg.kl_coef * reduce(kl, mask_b)
        metrics["kl"] = _mean(kl, mask_b)
    if entropy is not None:
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * reduce(entropy, mask_b)
        metrics["entropy"] = _mean(entropy, mask_b)
    metrics.update(
        pg_loss=_mean(per_token, keep),
        ratio_mean=_mean(ratio, mask_b),
        ratio_max=_extreme(ratio, mask_b, largest=True),
        ratio_min=_extreme(ratio, mask_b, largest=False),
        clip_frac=_mean(is_clipped.float(), mask_b),
        clip_frac_high=_mean((is_clipped & (adv > 0)).float(), mask_b),
        clip_frac_low=_mean((is_clipped & (adv < 0)).float(), mask_b),
        behavior_logprob_diff=_mean((behavior_logprobs - logprobs).abs(), mask_b),
        proximal_logprob_diff=_mean((behavior_logprobs - proximal_logprobs).abs(), mask_b),
        advantage_mean=_mean(adv, mask_b),
    )
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float = 0.2,
    normalizer: float | None = None,
) -> tuple[Tensor, Metrics]:
    """PPO's clipped value loss: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``,
    token-mean over ``mask`` (``clip = 0`` disables the clipped branch)."""
    mask_b = mask.bool()
    returns = returns.detach()
    err = (values - returns) ** 2
    if clip > 0:
        clipped_v = old_values.detach() + (values - old_values.detach()).clamp(-clip, clip)
        err_clipped = (clipped_v - returns) ** 2
        per_token = 0.5 * torch.maximum(err, err_clipped)
        clip_frac = _mean((err_clipped > err).float(), mask_b)
    else:
        per_token = 0.5 * err
        clip_frac = values.new_zeros(())
    loss = masked_reduce(per_token, mask_b, normalizer=normalizer)
    return loss, {
        "value_loss": _mean(per_token, mask_b),
        "value_clip_frac": clip_frac,
        "value_mean": _mean(values, mask_b),
        "return_mean": _mean(returns, mask_b),
    }


def sft_loss(logprobs: Tensor, mask: Tensor, *, normalizer: float | None = None) -> tuple[Tensor, Metrics]:
    """Negative log-likelihood of the masked (assistant) tokens, token-mean."""
    mask_b = mask.bool()
    loss = masked_reduce(-logprobs, mask_b, normalizer=normalizer)
    return loss, {"nll": _mean(-logprobs, mask_b)}
