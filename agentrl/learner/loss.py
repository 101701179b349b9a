"""Advantages and losses: pure functions over tensors, no model, no distributed state.

Token tensors are flat ``[N]`` (one packed micro-batch): element ``i`` scores the token the model
predicts at position ``i``; ``mask`` is 1 on the tokens the loss sees; ``seq_ids`` maps tokens to
sequences. ``logprobs`` is the policy being trained, ``proximal_logprobs`` the same weights at the
start of the step, ``behavior_logprobs`` what the engine sampled with.

The policy loss is an objective (clipped PPO, or CISPO's clipped no-gradient weight on the log-probability)
over a ratio (per token, or GSPO's one length-normalised ratio per sequence), times a no-gradient correction
weight, per recipe: ``decoupled`` (AReaL; in ``mask`` mode with IcePop's floor), ``tis = "token"`` /
``"sequence"`` (truncated importance sampling), or plain PPO against the behaviour policy; a sequence mask
can drop whole sequences whose geometric-mean pi_prox/mu leaves a band. When behaviour and proximal policy
agree every recipe is plain PPO (a unit test checks it). Regularisers: KL to the reference
(``k1``/``k2``/``k3``) and entropy. Advantages: GRPO, RLOO, GAE, REINFORCE++ (group mean, batch whitening).

Normalisation divides by ``normalizer``, which the trainer computes over the whole optimiser batch
on every rank, so accumulation and data parallelism give the gradient of one big batch; ``constant``
(Dr. GRPO) divides by sequences x ``normalization_tokens``. Metrics are 0-d detached tensors:
``_min``/``_max`` keys are extrema, the rest means over loss tokens.

See docs/learner.md and docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from agentrl.config import loss_combination_problems

Metrics = dict[str, Tensor]


@dataclass(frozen=True)
class PolicyLossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float = 0.0  # 0: off; else c > 1
    objective: str = "ppo"  # ppo | cispo
    ratio_level: str = "token"  # token | sequence (GSPO)
    decoupled: bool = True
    behavior_weight_cap: float = 2.0  # cap on pi_prox/mu (decoupled and TIS)
    behavior_weight_mode: str = "clamp"  # clamp | mask (decoupled only)
    behavior_weight_floor: float = 0.0  # IcePop: mask mode also drops pi_prox/mu below it; 0: off
    tis: str = "none"  # none | token | sequence
    sequence_mask_low: float = 0.0  # drop a sequence whose geometric-mean pi_prox/mu is below it; 0: off
    sequence_mask_high: float = 0.0  # ... or above it; 0: off
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # k1 | k2 | k3
    entropy_coef: float = 0.0
    normalization: str = "token"  # token | sequence | constant
    normalization_tokens: int = 0  # the constant of normalization = "constant" (> 0 there)

    def __post_init__(self) -> None:
        _check_choices(self)
        for problem in loss_combination_problems(self):
            raise ValueError(problem)

    @property
    def uses_proximal(self) -> bool:
        """Whether the ratio is taken to pi_prox (else to the behaviour policy)."""
        return self.decoupled or self.tis != "none"

    @property
    def masks_sequences(self) -> bool:
        return bool(self.sequence_mask_low or self.sequence_mask_high)

    @classmethod
    def from_learner(cls, learner: Any, normalization_tokens: int | None = None) -> PolicyLossConfig:
        """Build from a ``LearnerSection``; ``normalization_tokens`` resolves its 0 (the learner
        passes the largest ``env.max_total_tokens``)."""
        return cls(
            clip_eps_low=learner.clip_eps_low,
            clip_eps_high=learner.clip_eps_high,
            dual_clip=learner.dual_clip,
            objective=learner.objective,
            ratio_level=learner.ratio_level,
            decoupled=learner.decoupled,
            behavior_weight_cap=learner.behavior_weight_cap,
            behavior_weight_mode=learner.behavior_weight_mode,
            behavior_weight_floor=learner.behavior_weight_floor,
            tis=learner.tis,
            sequence_mask_low=learner.sequence_mask_low,
            sequence_mask_high=learner.sequence_mask_high,
            kl_coef=learner.kl_coef,
            kl_estimator=learner.kl_estimator,
            entropy_coef=learner.entropy_coef,
            normalization=learner.loss_normalization,
            normalization_tokens=learner.normalization_tokens or normalization_tokens or 0,
        )


_CHOICES = {
    "tis": ("none", "token", "sequence"),
    "behavior_weight_mode": ("clamp", "mask"),
    "kl_estimator": ("k1", "k2", "k3"),
    "normalization": ("token", "sequence", "constant"),
    "objective": ("ppo", "cispo"),
    "ratio_level": ("token", "sequence"),
}


def _check_choices(cfg: PolicyLossConfig) -> None:
    for key, allowed in _CHOICES.items():
        value = getattr(cfg, key)
        if value not in allowed:
            raise ValueError(f"{key} must be {'|'.join(allowed)}, got {value!r}")
    if cfg.dual_clip and cfg.dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be 0 (off) or > 1, got {cfg.dual_clip}")
    if cfg.normalization_tokens < 0 or (cfg.normalization == "constant" and cfg.normalization_tokens <= 0):
        raise ValueError(
            "learner.loss_normalization = 'constant' divides by sequences x learner.normalization_tokens, "
            f"which must be > 0 (got {cfg.normalization_tokens})"
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


def _float(x: Tensor) -> Tensor:
    """``x`` in float32 or wider (float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def whiten(values: Tensor, weights: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """``(x - mean) / (std + eps)`` over all of ``values``, with the ``weights``-weighted mean and
    population std when weights are given (same shape, or broadcastable to it)."""
    values = _float(values)
    w = torch.ones_like(values) if weights is None else torch.broadcast_to(weights.to(values.dtype), values.shape)
    total = w.sum()
    mean = (w * values).sum() / total
    std = ((w * (values - mean) ** 2).sum() / total).sqrt()
    return (values - mean) / (std + eps)


def reinforce_pp_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ with a baseline over ``[groups, group_size]``: subtract each group's mean, then
    whiten over the whole batch (population std), as OpenRLHF and verl do.

    verl whitens over tokens (each sequence weighted by its length); this normalises over episodes
    (the learner calls :func:`whiten` with weights for ragged groups).
    """
    rewards = _float(rewards)
    return whiten(rewards - rewards.mean(dim=-1, keepdim=True), eps=eps)


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


def _need_seqs(what: str, seq_ids: Tensor | None, num_seqs: int | None) -> tuple[Tensor, int]:
    missing = [name for name, v in (("seq_ids", seq_ids), ("num_seqs", num_seqs)) if v is None]
    if seq_ids is None or num_seqs is None:
        raise ValueError(f"{what} needs seq_ids and num_seqs (missing: {', '.join(missing)})")
    return seq_ids, num_seqs


def _seq_weight_total(
    count_mask: Tensor, seq_ids: Tensor, num_seqs: int, seq_weights: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sequence loss-token counts, weights, and the weight total of sequences with loss tokens."""
    seq_len = _seq_sum(count_mask, seq_ids, num_seqs)
    weights = torch.ones_like(seq_len) if seq_weights is None else seq_weights.to(seq_len.dtype)
    return seq_len, weights, (weights * (seq_len > 0).to(seq_len.dtype)).sum()


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
    normalization_tokens: int = 0,
) -> Tensor:
    """Sum ``per_token * mask`` and normalise (see the module docstring).

    ``count_mask`` (default ``mask``) is what counts a token in the normaliser and in the
    per-sequence lengths: importance masking removes tokens from the sum, not the count.
    ``constant`` divides the token sum by ``normalizer`` when given, else by the (``seq_weights``-
    weighted) number of sequences with loss tokens times ``normalization_tokens``.
    """
    count_mask = mask if count_mask is None else count_mask
    mask = mask.to(per_token.dtype)
    count_mask = count_mask.to(per_token.dtype)
    if normalization == "token":
        denom = count_mask.sum().clamp(min=1.0) if normalizer is None else normalizer
        return (per_token * mask).sum() / denom
    if normalization == "constant":
        return (per_token * mask).sum() / _constant_denominator(
            count_mask, seq_ids, num_seqs, normalizer, seq_weights, normalization_tokens
        )
    if normalization != "sequence":
        raise ValueError(f"normalization must be token|sequence|constant, got {normalization!r}")
    seq_ids, num_seqs = _need_seqs("sequence normalisation", seq_ids, num_seqs)
    seq_sum = _seq_sum(per_token * mask, seq_ids, num_seqs)
    seq_len, weights, total = _seq_weight_total(count_mask, seq_ids, num_seqs, seq_weights)
    per_seq = seq_sum / seq_len.clamp(min=1.0)
    denom = total.clamp(min=1e-12) if normalizer is None else normalizer
    return (per_seq * weights).sum() / denom


def _constant_denominator(
    count_mask: Tensor,
    seq_ids: Tensor | None,
    num_seqs: int | None,
    normalizer: float | None,
    seq_weights: Tensor | None,
    normalization_tokens: int,
) -> Tensor | float:
    if normalizer is not None:
        return normalizer
    if normalization_tokens <= 0:
        raise ValueError(f"constant normalisation needs learner.normalization_tokens > 0, got {normalization_tokens}")
    seq_ids, num_seqs = _need_seqs("constant normalisation", seq_ids, num_seqs)
    _, _, total = _seq_weight_total(count_mask, seq_ids, num_seqs, seq_weights)
    return (total * normalization_tokens).clamp(min=1e-12)


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

    ``k1 = logp - ref``; ``k2 = (logp - ref)^2 / 2`` (biased, its gradient is that of the reverse
    KL); ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's estimator: unbiased, always >= 0,
    lower variance).
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


def _seq_mean(x: Tensor, mask_b: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
    """Per-sequence mean of ``x`` over the tokens of ``mask_b`` (0 for a sequence without any)."""
    total = _seq_sum(torch.where(mask_b, x, torch.zeros_like(x)), seq_ids, num_seqs)
    return total / _seq_sum(mask_b.to(x.dtype), seq_ids, num_seqs).clamp(min=1.0)


def _sequence_mask(
    log_w: Tensor, mask_b: Tensor, cfg: PolicyLossConfig, seq_ids: Tensor | None, num_seqs: int | None
) -> Tensor:
    """Loss tokens of the sequences whose ``g = exp(mean log pi_prox/mu)`` leaves [low, high]."""
    dropped = torch.zeros_like(mask_b)
    if not cfg.masks_sequences:
        return dropped
    seq_ids, num_seqs = _need_seqs("sequence masking (learner.sequence_mask_low/high)", seq_ids, num_seqs)
    g = torch.exp(_seq_mean(log_w, mask_b, seq_ids, num_seqs))
    seq_dropped = torch.zeros_like(g, dtype=torch.bool)
    if cfg.sequence_mask_low:
        seq_dropped |= g < cfg.sequence_mask_low
    if cfg.sequence_mask_high:
        seq_dropped |= g > cfg.sequence_mask_high
    return mask_b & seq_dropped[seq_ids]


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
    ``keep`` a bool mask of tokens that stay in the sum (``mask`` mode drops w > cap and
    w < floor, bounds inclusive; the sequence mask drops whole sequences). Metrics describe the
    raw weight before truncation: ``iw_mean``, ``iw_min``, ``iw_max`` and ``iw_truncated_frac``
    (tokens clamped or masked by the weight); ``masked_frac`` (tokens out of the sum) and
    ``seq_masked_frac`` (by the sequence mask).
    """
    mask_b = mask.bool()
    cap = cfg.behavior_weight_cap
    log_w = _float(proximal_logprobs - behavior_logprobs).detach()
    keep = mask_b.clone()
    if cfg.decoupled or cfg.tis == "token":
        raw = torch.exp(log_w.clamp(max=20.0))
        if cfg.decoupled and cfg.behavior_weight_mode == "mask":
            truncated = mask_b & ((raw > cap) | (raw < cfg.behavior_weight_floor))
            keep = mask_b & ~truncated
            w = torch.where(keep, raw, torch.zeros_like(raw))
        else:
            truncated = mask_b & (raw > cap)
            w = raw.clamp(max=cap)
    elif cfg.tis == "sequence":
        seq_ids, num_seqs = _need_seqs("sequence-level TIS", seq_ids, num_seqs)
        seq_log_w = _seq_sum(log_w * mask_b, seq_ids, num_seqs)
        raw = torch.exp(seq_log_w.clamp(max=20.0))[seq_ids]
        truncated = mask_b & (raw > cap)
        w = raw.clamp(max=cap)
    else:
        raw = torch.ones_like(log_w)
        truncated = torch.zeros_like(mask_b)
        w = raw
    seq_dropped = _sequence_mask(log_w, mask_b, cfg, seq_ids, num_seqs)
    keep = keep & ~seq_dropped
    metrics = {
        "iw_mean": _mean(raw, mask_b),
        "iw_min": _extreme(raw, mask_b, largest=False),
        "iw_max": _extreme(raw, mask_b, largest=True),
        "iw_truncated_frac": _mean(truncated.float(), mask_b),
        "masked_frac": _mean((mask_b & ~keep).float(), mask_b),
        "seq_masked_frac": _mean(seq_dropped.float(), mask_b),
    }
    return w.detach(), keep, metrics


def _ratio(
    logprobs: Tensor, old: Tensor, mask_b: Tensor, cfg: PolicyLossConfig, seq_ids: Tensor | None, num_seqs: int | None
) -> tuple[Tensor, Tensor]:
    """``(token ratio, the ratio the objective uses)``: the same tensor, or GSPO's
    ``exp(mean_t log pi/pi_old)`` of each token's sequence (gradient through the mean)."""
    token = torch.exp((logprobs - old).clamp(-20.0, 20.0))
    if cfg.ratio_level == "token":
        return token, token
    seq_ids, num_seqs = _need_seqs("learner.ratio_level = 'sequence'", seq_ids, num_seqs)
    log_s = _seq_mean(logprobs - old, mask_b, seq_ids, num_seqs).clamp(-20.0, 20.0)
    return token, torch.exp(log_s)[seq_ids]


def _objective(
    ratio: Tensor, logprobs: Tensor, adv: Tensor, mask_b: Tensor, cfg: PolicyLossConfig
) -> tuple[Tensor, Tensor, Tensor, Metrics]:
    """Per-token loss before the correction weight, and which tokens were clipped at the high/low bound.

    ``ppo``: ``max(-r A, -clip(r) A)`` (clipped when the clipped branch is the larger), then dual clip.
    ``cispo``: ``-sg(clip(r)) A logp``; a token is clipped when its r is outside the band.
    """
    low, high = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    if cfg.objective == "cispo":
        weight = ratio.clamp(low, high).detach()
        return -weight * adv * logprobs, ratio > high, ratio < low, {}
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(low, high)
    pg = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    metrics: Metrics = {}
    if cfg.dual_clip:
        bound = -adv * cfg.dual_clip
        dual = (adv < 0) & (bound < pg)
        pg = torch.where(dual, bound, pg)
        metrics["dual_clip_frac"] = _mean(dual.float(), mask_b)
    return pg, is_clipped & (adv > 0), is_clipped & (adv < 0), metrics


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
    """The policy-gradient loss with its correction and regularisers (module docstring).

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
    token_ratio, ratio = _ratio(logprobs, old, mask_b, cfg, seq_ids, num_seqs)
    adv = advantages.detach().to(ratio.dtype)
    pg, clipped_high, clipped_low, objective_metrics = _objective(ratio, logprobs, adv, mask_b, cfg)
    metrics.update(objective_metrics)
    per_token = weights * pg
    reduce = partial(
        masked_reduce,
        normalization=cfg.normalization,
        seq_ids=seq_ids,
        num_seqs=num_seqs,
        normalizer=normalizer,
        seq_weights=seq_weights,
        normalization_tokens=cfg.normalization_tokens,
    )
    loss = reduce(per_token, keep, count_mask=mask_b)
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs.detach(), cfg.kl_estimator)
        if cfg.kl_coef:
            loss = loss + cfg.kl_coef * reduce(kl, mask_b)
        metrics["kl"] = _mean(kl, mask_b)
    if entropy is not None:
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * reduce(entropy, mask_b)
        metrics["entropy"] = _mean(entropy, mask_b)
    if cfg.ratio_level == "sequence":
        metrics["seq_ratio_mean"] = _mean(ratio, mask_b)
    metrics.update(
        pg_loss=_mean(per_token, keep),
        ratio_mean=_mean(token_ratio, mask_b),
        ratio_max=_extreme(token_ratio, mask_b, largest=True),
        ratio_min=_extreme(token_ratio, mask_b, largest=False),
        clip_frac=_mean((clipped_high | clipped_low).float(), mask_b),
        clip_frac_high=_mean(clipped_high.float(), mask_b),
        clip_frac_low=_mean(clipped_low.float(), mask_b),
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
