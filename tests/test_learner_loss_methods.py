"""GSPO, CISPO, IcePop, sequence masking, constant normalisation, k2 and REINFORCE++ (agentrl/learner/loss.py)
against float64 references written from the formulas with plain loops: values, metrics, and gradients w.r.t.
the logprobs (autograd vs central finite differences of the reference)."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from agentrl.config import LearnerSection
from agentrl.learner.loss import (
    PolicyLossConfig,
    kl_penalty,
    masked_reduce,
    policy_loss,
    reinforce_pp_advantages,
    whiten,
)

F64 = torch.float64


@dataclass
class Batch:
    logp: list[float]
    prox: list[float]
    behav: list[float]
    ref: list[float]
    adv: list[float]
    mask: list[int]
    seq: list[int]
    num_seqs: int

    def tensors(self) -> dict:
        return dict(
            logprobs=torch.tensor(self.logp, dtype=F64, requires_grad=True),
            proximal_logprobs=torch.tensor(self.prox, dtype=F64),
            behavior_logprobs=torch.tensor(self.behav, dtype=F64),
            advantages=torch.tensor(self.adv, dtype=F64),
            mask=torch.tensor(self.mask),
        )


def make_batch(seed: int, lens=(3, 1, 4, 2, 5, 3, 2), noise=0.3, drift=0.5) -> Batch:
    """Per sequence: one advantage, a logp spread and a pi_prox/mu drift of its own, so clipping, the IcePop
    band and the sequence mask each catch some sequences/tokens and not others. Sequence 0 is on-policy to 1e-5
    (never clipped, k ~ 1), sequence 5 has no loss tokens."""
    rng = random.Random(seed)
    b = Batch([], [], [], [], [], [], [], len(lens))
    for s, n in enumerate(lens):
        adv, spread, shift = rng.gauss(0, 1), noise * rng.random() * 2, drift * rng.gauss(0, 1)
        jitter = 1e-5 if s == 0 else 0.3
        spread, shift = (1e-5, 0.0) if s == 0 else (spread, shift)
        for _ in range(n):
            behav = -3 * rng.random()
            prox = behav + shift + jitter * rng.gauss(0, 1)
            b.behav.append(behav)
            b.prox.append(prox)
            b.logp.append(prox + spread * rng.gauss(0, 1))
            b.ref.append(prox + 0.2 * rng.gauss(0, 1))
            b.adv.append(adv)
            b.mask.append(0 if s == 5 or (s and rng.random() < 0.15) else 1)
            b.seq.append(s)
    return b


def reference(lp: list[float], sg: list[float], b: Batch, o: dict) -> tuple[float, dict]:
    """The loss from the formulas, token by token; ``sg`` is the stop-gradient copy of ``lp`` (CISPO's weight)."""
    decoupled = o.get("decoupled", True)
    old = b.prox if decoupled else b.behav
    lo, hi = 1 - o.get("clip_eps_low", 0.2), 1 + o.get("clip_eps_high", 0.2)
    cap, floor = o.get("behavior_weight_cap", 2.0), o.get("behavior_weight_floor", 0.0)
    mode = o.get("behavior_weight_mode", "clamp")
    low, high = o.get("sequence_mask_low", 0.0), o.get("sequence_mask_high", 0.0)
    norm, dual = o.get("normalization", "token"), o.get("dual_clip", 0.0)
    clip = lambda r: min(max(r, lo), hi)  # noqa: E731
    sums, counts, dropped, seq_dropped, clipped = [], 0, 0, 0, 0
    for s in range(b.num_seqs):
        toks = [t for t in range(len(lp)) if b.seq[t] == s and b.mask[t]]
        if not toks:
            continue
        counts += len(toks)
        g = math.exp(sum(b.prox[t] - b.behav[t] for t in toks) / len(toks))
        drop_seq = (low > 0 and g < low) or (high > 0 and g > high)
        seq_dropped += len(toks) if drop_seq else 0
        s_ratio = math.exp(sum(lp[t] - old[t] for t in toks) / len(toks))
        total = 0.0
        for t in toks:
            k, a = math.exp(b.prox[t] - b.behav[t]), b.adv[t]
            w = 1.0
            if decoupled:  # mask mode keeps k inside [floor, cap], bounds included
                w = min(k, cap) if mode == "clamp" else k if floor <= k <= cap else 0.0
            if drop_seq or w == 0.0:
                dropped += 1
                w = 0.0
            if o.get("objective", "ppo") == "cispo":
                r = math.exp(sg[t] - old[t])
                term, is_clipped = -clip(r) * a * lp[t], not lo <= r <= hi
            else:
                r = s_ratio if o.get("ratio_level", "token") == "sequence" else math.exp(lp[t] - old[t])
                term = -min(r * a, clip(r) * a)
                is_clipped = term != -r * a
                if dual and a < 0:
                    term = min(term, -dual * a)
            clipped += is_clipped
            total += w * term
            if o.get("kl_coef", 0.0):
                total += o["kl_coef"] * 0.5 * (lp[t] - b.ref[t]) ** 2  # k2
        sums.append((total, len(toks)))
    if norm == "token":
        loss = sum(x for x, _ in sums) / max(counts, 1)
    elif norm == "sequence":
        loss = sum(x / n for x, n in sums) / max(len(sums), 1)
    else:
        loss = sum(x for x, _ in sums) / (len(sums) * o["normalization_tokens"])
    n = max(counts, 1)
    return loss, {"masked_frac": dropped / n, "seq_masked_frac": seq_dropped / n, "clip_frac": clipped / n}


def fd_grad(b: Batch, o: dict, h: float = 1e-6, side: list[int] | None = None) -> list[float]:
    """Finite differences of the reference: central, or one-sided (+1 forward, -1 backward) per token."""
    out = []
    for i in range(len(b.logp)):
        up, down = list(b.logp), list(b.logp)
        direction = 0 if side is None else side[i]
        up[i] += h if direction >= 0 else 0.0
        down[i] -= h if direction <= 0 else 0.0
        width = (up[i] - down[i]) or 1.0
        out.append((reference(up, b.logp, b, o)[0] - reference(down, b.logp, b, o)[0]) / width)
    return out


def run(b: Batch, o: dict, **kw):
    x = b.tensors()
    cfg = PolicyLossConfig(**o)
    ref = torch.tensor(b.ref, dtype=F64) if o.get("kl_coef") else None
    seqs = dict(seq_ids=torch.tensor(b.seq), num_seqs=b.num_seqs)
    loss, metrics = policy_loss(**x, cfg=cfg, ref_logprobs=ref, **seqs, **kw)
    (grad,) = torch.autograd.grad(loss, x["logprobs"])
    return loss, grad, metrics


GSPO = dict(decoupled=False, ratio_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4)
CASES = {
    "gspo": ({**GSPO, "normalization": "sequence"}, ("clip_frac",)),
    "gspo_token_mean": (GSPO, ("clip_frac",)),
    "gspo_decoupled": ({**GSPO, "decoupled": True, "clip_eps_low": 0.05, "clip_eps_high": 0.05}, ("clip_frac",)),
    "cispo": (dict(decoupled=True, objective="cispo", clip_eps_low=0.2, clip_eps_high=0.28), ("clip_frac",)),
    "cispo_behaviour": (dict(decoupled=False, objective="cispo", clip_eps_low=1.0, clip_eps_high=0.1), ("clip_frac",)),
    "icepop": (
        dict(decoupled=True, behavior_weight_mode="mask", behavior_weight_floor=0.5, behavior_weight_cap=2.0),
        ("masked_frac",),
    ),
    "seq_mask_low": (dict(decoupled=False, sequence_mask_low=0.8), ("seq_masked_frac",)),
    "seq_mask_high": (dict(decoupled=True, sequence_mask_high=1.3), ("seq_masked_frac",)),
    "seq_mask_band_sequence_norm": (
        dict(decoupled=True, sequence_mask_low=0.7, sequence_mask_high=1.4, normalization="sequence"),
        ("seq_masked_frac",),
    ),
    "constant": (dict(decoupled=True, normalization="constant", normalization_tokens=8), ("clip_frac",)),
    "k2": (dict(decoupled=False, kl_coef=0.3, kl_estimator="k2"), ("clip_frac",)),
    "gspo_decoupled_seq_mask_dual": (
        {**GSPO, "decoupled": True, "sequence_mask_low": 0.6, "sequence_mask_high": 1.5, "dual_clip": 1.0005},
        ("clip_frac", "seq_masked_frac", "dual_clip_frac"),
    ),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_reference(name, seed):
    o, active = CASES[name]
    b = make_batch(seed)
    loss, grad, m = run(b, o)
    want, stats = reference(b.logp, b.logp, b, o)
    assert loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    assert torch.allclose(grad, torch.tensor(fd_grad(b, o), dtype=F64), rtol=1e-6, atol=1e-8)
    for key, value in stats.items():
        assert m[key].item() == pytest.approx(value, abs=1e-6), key  # fractions are float32
    for key in active:  # the case exercises what it names, on some tokens but not all
        assert 0 < m[key].item() < 1, (key, m[key].item())
    assert ("seq_ratio_mean" in m) == (o.get("ratio_level") == "sequence")


def test_cispo_weight_carries_no_gradient():
    b = make_batch(3)
    o = CASES["cispo_behaviour"][0]
    _, grad, _ = run(b, o)
    for i, g in enumerate(grad.tolist()):  # d/dlogp of -sg(clip(r)) A logp / N
        r = math.exp(b.logp[i] - b.behav[i])
        want = -min(r, 1.1) * b.adv[i] / sum(b.mask) if b.mask[i] else 0.0
        assert g == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("name", list(CASES))
def test_all_tokens_masked_gives_zero(name):
    b = make_batch(0)
    b.mask = [0] * len(b.mask)
    loss, grad, _ = run(b, CASES[name][0])
    assert torch.isfinite(loss) and loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))


def test_one_token_sequences_gspo_is_token_ppo():
    b = make_batch(4, lens=(1,) * 12)
    eps = dict(clip_eps_low=0.1, clip_eps_high=0.1)
    loss_s, grad_s, m = run(b, {**GSPO, **eps})
    loss_t, grad_t, _ = run(b, dict(decoupled=False, **eps))
    assert loss_s.item() == pytest.approx(loss_t.item(), rel=1e-14)
    assert torch.allclose(grad_s, grad_t, rtol=1e-14, atol=0)
    assert m["seq_ratio_mean"].item() == pytest.approx(m["ratio_mean"].item(), rel=1e-14)
    assert 0 < m["clip_frac"].item() < 1


def test_sequence_ratio_on_the_clip_boundary():
    """torch.clamp passes the gradient at its (inclusive) bounds and torch.maximum splits it between equal
    arguments, both of which carry the unclipped gradient there: at a bound the gradient is the one from inside
    the clip band. With eps = 0 and logp = old, s = exp(0) = 1 exactly sits on both bounds: for A > 0 the band is
    below (backward difference), for A < 0 above (forward difference); the other side's gradient is 0."""
    b = make_batch(5, lens=(3, 2, 4))
    b.mask = [1] * len(b.mask)
    b.logp = list(b.behav)
    b.adv = [1.5 if s == 0 else -0.7 if s == 1 else 0.0 for s in b.seq]
    o = {**GSPO, "clip_eps_low": 0.0, "clip_eps_high": 0.0, "normalization": "sequence"}
    loss, grad, m = run(b, o)
    assert loss.item() == pytest.approx(reference(b.logp, b.logp, b, o)[0], abs=1e-15)
    inside = [-1 if a > 0 else 1 for a in b.adv]
    want = fd_grad(b, o, side=inside)  # one-sided: O(h) error
    assert torch.allclose(grad, torch.tensor(want, dtype=F64), atol=1e-6)
    assert all(abs(g) > 0.05 for g, a in zip(want, b.adv) if a)  # the inside side moves
    outside = fd_grad(b, o, side=[-s for s in inside])
    assert max(abs(g) for g in outside) < 1e-8  # the clipped side does not
    assert m["clip_frac"].item() == 0.0  # on the bound is not clipped


@pytest.mark.parametrize("floor, cap", [(1.0, 2.0), (0.5, 1.0)])
def test_behaviour_weight_on_the_floor_or_cap_is_kept(floor, cap):
    """Tokens 1 and 5 have pi_prox = mu, so k = exp(0) = 1 exactly, on the floor (first case) or the cap."""
    b = make_batch(6, lens=(4, 4), drift=0.0)
    b.mask = [1] * 8
    for i in (1, 5):
        b.prox[i] = b.behav[i]
    b.logp = [p + 0.05 for p in b.prox]  # inside the clip band: every kept token has a gradient
    o = dict(decoupled=True, behavior_weight_mode="mask", behavior_weight_floor=floor, behavior_weight_cap=cap)
    loss, grad, m = run(b, o)
    k = [math.exp(p - q) for p, q in zip(b.prox, b.behav)]
    out = [i for i in range(8) if not floor <= k[i] <= cap]
    assert 0 < len(out) < 6 and 1 not in out and 5 not in out
    assert m["masked_frac"].item() == pytest.approx(len(out) / 8)
    assert loss.item() == pytest.approx(reference(b.logp, b.logp, b, o)[0], rel=1e-12)
    assert all((grad[i].item() == 0.0) == (i in out) for i in range(8))


def test_k2_estimator_and_constant_reduce():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    per_token, mask = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1, 1, 0, 1])
    seq = dict(seq_ids=torch.tensor([0, 0, 1, 2]), num_seqs=3)
    # sequence 1 has no loss token: 2 sequences x 10 tokens; with weights 0.5, 0.25 (and 9 on the empty one)
    got = masked_reduce(per_token, mask, normalization="constant", normalization_tokens=10, **seq)
    assert got.item() == pytest.approx(7 / 20)
    w = torch.tensor([0.5, 9.0, 0.25])
    got = masked_reduce(per_token, mask, normalization="constant", normalization_tokens=10, seq_weights=w, **seq)
    assert got.item() == pytest.approx(7 / 7.5)
    assert masked_reduce(per_token, mask, normalization="constant", normalizer=70.0).item() == pytest.approx(0.1)
    with pytest.raises(ValueError, match="learner.normalization_tokens"):
        masked_reduce(per_token, mask, normalization="constant", **seq)


def test_reinforce_pp_advantages():
    rng = np.random.default_rng(0)
    rewards = rng.random((5, 4))
    rewards[2] = 0.7  # one group all equal
    got = reinforce_pp_advantages(torch.tensor(rewards)).numpy()
    x = rewards - rewards.mean(axis=1, keepdims=True)
    want = (x - x.mean()) / (x.std() + 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert abs(got.mean()) < 1e-12 and got.std() == pytest.approx(1.0, abs=1e-5)
    # the equal group only sees the batch shift, which is 0 since every group is centred
    np.testing.assert_allclose(got[2], -x.mean() / (x.std() + 1e-6), atol=1e-14)
    assert np.abs(got[2]).max() < 1e-12


def test_whiten_with_weights_is_repetition():
    v, w = torch.tensor([1.0, 4.0, -2.0], dtype=F64), torch.tensor([2.0, 1.0, 3.0], dtype=F64)
    repeated = torch.tensor([1.0, 1.0, 4.0, -2.0, -2.0, -2.0], dtype=F64)
    assert torch.allclose(whiten(v, w), whiten(repeated)[[0, 2, 3]], rtol=1e-12)
    mean = np.average(v.numpy(), weights=w.numpy())
    std = math.sqrt(np.average((v.numpy() - mean) ** 2, weights=w.numpy()))
    np.testing.assert_allclose(whiten(v, w).numpy(), (v.numpy() - mean) / (std + 1e-6), rtol=1e-12)


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(ratio_level="group"), ["ratio_level"]),
        (dict(objective="grpo"), ["objective"]),
        (dict(decoupled=False, objective="cispo", ratio_level="sequence"), ["learner.ratio_level", "REINFORCE"]),
        (dict(decoupled=False, objective="cispo", dual_clip=3.0), ["learner.dual_clip", "PPO's clipped"]),
        (dict(behavior_weight_floor=0.5), ["learner.behavior_weight_mode = 'mask'"]),
        (dict(decoupled=False, behavior_weight_floor=0.5), ["learner.behavior_weight_floor", "learner.decoupled"]),
        (
            dict(behavior_weight_mode="mask", behavior_weight_floor=2.0, behavior_weight_cap=2.0),
            ["learner.behavior_weight_floor", "learner.behavior_weight_cap"],
        ),
        (dict(behavior_weight_mode="mask", behavior_weight_floor=-0.1), ["learner.behavior_weight_floor"]),
        (dict(sequence_mask_low=0.9, sequence_mask_high=0.5), ["learner.sequence_mask_low", "sequence_mask_high"]),
        (dict(sequence_mask_high=1.0), ["learner.sequence_mask_high"]),
        (dict(sequence_mask_low=1.0), ["learner.sequence_mask_low"]),
        (dict(sequence_mask_low=-0.5), ["learner.sequence_mask_low"]),
        (dict(normalization="constant"), ["learner.normalization_tokens"]),
        (dict(normalization="median"), ["normalization"]),
        (dict(kl_estimator="k4"), ["kl_estimator"]),
    ],
)
def test_config_errors_name_the_key(kw, says):
    with pytest.raises(ValueError) as err:
        PolicyLossConfig(**kw)
    for text in says:
        assert text in str(err.value)


@pytest.mark.parametrize(
    "o, kw, missing",
    [
        (GSPO, dict(num_seqs=3), "seq_ids"),
        (GSPO, dict(seq_ids=torch.tensor([0, 0, 1])), "num_seqs"),
        (dict(decoupled=False, sequence_mask_low=0.5), dict(), "seq_ids, num_seqs"),
        (dict(normalization="constant", normalization_tokens=4), dict(), "seq_ids, num_seqs"),
    ],
)
def test_missing_sequences_are_named(o, kw, missing):
    x = make_batch(0, lens=(2, 1)).tensors()
    with pytest.raises(ValueError, match=re.escape(f"missing: {missing})")):
        policy_loss(**x, cfg=PolicyLossConfig(**o), **kw)


def test_from_learner_reads_every_new_key():
    lc = LearnerSection(
        objective="ppo",
        ratio_level="sequence",
        decoupled=True,
        behavior_weight_mode="mask",
        behavior_weight_floor=0.4,
        sequence_mask_low=0.5,
        sequence_mask_high=2.5,
        loss_normalization="constant",
        normalization_tokens=512,
        kl_estimator="k2",
    )
    cfg = PolicyLossConfig.from_learner(lc)
    assert (cfg.ratio_level, cfg.objective, cfg.behavior_weight_floor) == ("sequence", "ppo", 0.4)
    assert (cfg.sequence_mask_low, cfg.sequence_mask_high) == (0.5, 2.5)
    assert (cfg.normalization, cfg.normalization_tokens, cfg.kl_estimator) == ("constant", 512, "k2")
    cispo = PolicyLossConfig.from_learner(LearnerSection(objective="cispo", decoupled=False))
    assert cispo.objective == "cispo" and not cispo.uses_proximal
