"""Losses and advantages on small cases computed by hand (agentrl/learner/loss.py)."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.learner.loss import (
    PolicyLossConfig,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    masked_reduce,
    policy_loss,
    rloo_advantages,
    sft_loss,
    value_loss,
)

t = torch.tensor
L = math.log


def test_grpo_advantages_mean_and_std():
    r = t([1.0, 0.0, 0.0, 1.0])
    assert torch.allclose(grpo_advantages(r), t([0.5, -0.5, -0.5, 0.5]))
    # population std = 0.5
    assert torch.allclose(grpo_advantages(r, normalize_std=True), t([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.allclose(grpo_advantages(t([2.0, 2.0])), t([0.0, 0.0]))


def test_rloo_leaves_one_out():
    assert torch.allclose(rloo_advantages(t([1.0, 0.0, 0.0])), t([1.0, -0.5, -0.5]))
    with pytest.raises(ValueError):
        rloo_advantages(t([1.0]))


def test_gae_skips_non_action_tokens():
    # actions at t = 0, 1, 3; t = 2 is a tool result (not a step); reward 1 on the last action
    values = t([[0.5, 0.2, 9.0, 0.4]])
    mask = t([[1, 1, 0, 1]])
    rewards = t([[0.0, 0.0, 0.0, 1.0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, t([[0.5, 0.8, 0.0, 0.6]]))  # 1 - V on actions
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    # t3: delta 0.6 -> 0.6; t1: delta 0.4 - 0.2 = 0.2 -> 0.2 + 0.5 * 0.6 = 0.5; t0: 0.2 - 0.5 + 0.25 = -0.05
    assert torch.allclose(adv, t([[-0.05, 0.5, 0.0, 0.6]]), atol=1e-6)
    assert torch.allclose(ret, t([[0.45, 0.7, 0.0, 1.0]]), atol=1e-6)


def test_gae_discount():
    adv, _ = gae_advantages(t([[0.0, 1.0]]), t([[0.0, 0.0]]), t([[1, 1]]), gamma=0.5, lam=1.0)
    assert torch.allclose(adv, t([[0.5, 1.0]]))


def _ppo(**kw):
    base = dict(decoupled=False, tis="none", clip_eps_low=0.2, clip_eps_high=0.2)
    base.update(kw)
    return PolicyLossConfig(**base)


def test_ppo_clip_low_high_and_token_mean():
    # ratios to the behaviour policy: 1.5 with A = +1 (clipped high), 0.5 with A = -1 (clipped low),
    # 1.5 with A = -1 (not clipped: pessimistic branch is the unclipped one)
    behav = t([0.0, 0.0, 0.0])
    logp = t([L(1.5), L(0.5), L(1.5)])
    adv = t([1.0, -1.0, -1.0])
    mask = t([1, 1, 1])
    loss, m = policy_loss(logp, behav, behav, adv, mask, _ppo())
    # per token: max(-1.5, -1.2) = -1.2; max(0.5, 0.8) = 0.8; max(1.5, 1.2) = 1.5
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.5) / 3, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(2 / 3)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 3)
    assert m["ratio_max"].item() == pytest.approx(1.5)
    assert m["ratio_min"].item() == pytest.approx(0.5)


def test_asymmetric_clip_and_dual_clip():
    behav = t([0.0, 0.0])
    logp = t([L(1.5), L(4.0)])
    adv = t([1.0, -1.0])
    mask = t([1, 1])
    # eps_high = 0.28: token 0 clipped at 1.28; token 1 unclipped loss 4.0, dual clip at 3 bounds it to 3.0
    loss, m = policy_loss(logp, behav, behav, adv, mask, _ppo(clip_eps_high=0.28, dual_clip=3.0))
    assert loss.item() == pytest.approx((-1.28 + 3.0) / 2, abs=1e-6)
    assert m["dual_clip_frac"].item() == pytest.approx(0.5)


def test_masked_tokens_do_not_count():
    behav = t([0.0, 0.0])
    logp = t([L(1.5), L(100.0)])
    loss, _ = policy_loss(logp, behav, behav, t([1.0, 1.0]), t([1, 0]), _ppo())
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)


def test_decoupled_weights_clamp_and_mask():
    # pi_prox / mu = 2 (token 0) and 3 (token 1); theta = prox (ratio 1); A = 1; cap 2
    behav = t([L(0.1), L(0.1)])
    prox = t([L(0.2), L(0.3)])
    adv = t([1.0, 1.0])
    mask = t([1, 1])
    loss, m = policy_loss(prox, prox, behav, adv, mask, PolicyLossConfig(decoupled=True, behavior_weight_cap=2.0))
    assert loss.item() == pytest.approx(-(2.0 + 2.0) / 2, abs=1e-5)  # w clamped to 2
    assert m["iw_max"].item() == pytest.approx(3.0, rel=1e-5)
    assert m["iw_min"].item() == pytest.approx(2.0, rel=1e-5)
    assert m["iw_truncated_frac"].item() == pytest.approx(0.5)
    cfg = PolicyLossConfig(decoupled=True, behavior_weight_cap=2.0, behavior_weight_mode="mask")
    loss, m = policy_loss(prox, prox, behav, adv, mask, cfg)
    assert loss.item() == pytest.approx(-2.0 / 2, abs=1e-5)  # token 1 masked, still counted in N
    # the ratio is to the proximal policy: moving theta away from prox is clipped around prox
    loss, m = policy_loss(
        prox + L(1.5), prox, behav, adv, mask, PolicyLossConfig(decoupled=True, behavior_weight_cap=5.0)
    )
    assert loss.item() == pytest.approx(-(2.0 * 1.2 + 3.0 * 1.2) / 2, abs=1e-5)
    assert m["clip_frac_high"].item() == pytest.approx(1.0)


def test_sequence_tis_uses_the_product_over_the_sequence():
    behav = t([L(0.1), L(0.1), L(0.1)])
    prox = t([L(0.2), L(0.2), L(0.1)])  # sequence 0: 2 * 2 = 4 -> capped at 3; sequence 1: 1
    seq_ids = t([0, 0, 1])
    cfg = PolicyLossConfig(decoupled=False, tis="sequence", behavior_weight_cap=3.0)
    loss, m = policy_loss(prox, prox, behav, t([1.0, 1.0, 1.0]), t([1, 1, 1]), cfg, seq_ids=seq_ids, num_seqs=2)
    assert loss.item() == pytest.approx(-(3 + 3 + 1) / 3, abs=1e-5)
    assert m["iw_max"].item() == pytest.approx(4.0, rel=1e-5)
    token = PolicyLossConfig(decoupled=False, tis="token", behavior_weight_cap=3.0)
    loss, _ = policy_loss(prox, prox, behav, t([1.0, 1.0, 1.0]), t([1, 1, 1]), token)
    assert loss.item() == pytest.approx(-(2 + 2 + 1) / 3, abs=1e-5)


@pytest.mark.parametrize(
    "cfg",
    [
        PolicyLossConfig(decoupled=True, behavior_weight_mode="clamp"),
        PolicyLossConfig(decoupled=True, behavior_weight_mode="mask"),
        PolicyLossConfig(decoupled=False, tis="token"),
        PolicyLossConfig(decoupled=False, tis="sequence"),
    ],
)
def test_corrections_reduce_to_ppo_when_behaviour_is_proximal(cfg):
    g = torch.Generator().manual_seed(0)
    n = 50
    behav = -torch.rand(n, generator=g) * 3
    logp = (behav + 0.3 * torch.randn(n, generator=g)).requires_grad_(True)
    adv = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    seq_ids = torch.arange(n) // 10
    kw = dict(seq_ids=seq_ids, num_seqs=5)
    plain = _ppo()
    loss_a, _ = policy_loss(logp, behav, behav, adv, mask, plain, **kw)
    (grad_a,) = torch.autograd.grad(loss_a, logp)
    loss_b, m = policy_loss(logp, behav.clone(), behav, adv, mask, cfg, **kw)
    (grad_b,) = torch.autograd.grad(loss_b, logp)
    assert loss_b.item() == pytest.approx(loss_a.item(), abs=1e-6)
    assert torch.allclose(grad_a, grad_b, atol=1e-7)
    assert m["iw_mean"].item() == pytest.approx(1.0) and m["iw_truncated_frac"].item() == 0.0


def test_kl_estimators_and_entropy_bonus():
    logp, ref = t([L(0.5)]), t([L(0.25)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)
    cfg = PolicyLossConfig(decoupled=False, kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, m = policy_loss(logp, logp, logp, t([0.0]), t([1]), cfg, ref_logprobs=ref, entropy=t([2.0]))
    assert loss.item() == pytest.approx(0.1 * math.log(2) - 0.01 * 2.0, abs=1e-6)
    assert m["kl"].item() == pytest.approx(math.log(2)) and m["entropy"].item() == pytest.approx(2.0)


def test_sequence_normalisation_and_global_normaliser():
    per_token = t([1.0, 2.0, 2.0, 2.0])
    mask = t([1, 1, 1, 1])
    seq_ids = t([0, 1, 1, 1])
    assert masked_reduce(per_token, mask).item() == pytest.approx(7 / 4)
    seq = masked_reduce(per_token, mask, normalization="sequence", seq_ids=seq_ids, num_seqs=2)
    assert seq.item() == pytest.approx((1 + 2) / 2)
    # a micro-batch of a larger batch divides by the batch's count, not its own
    assert masked_reduce(per_token, mask, normalizer=8.0).item() == pytest.approx(7 / 8)


def test_behaviour_logprob_mismatch_metric():
    behav = t([-1.0, -2.0])
    logp = t([-1.5, -1.0])
    _, m = policy_loss(logp, logp, behav, t([1.0, 1.0]), t([1, 1]), _ppo())
    assert m["behavior_logprob_diff"].item() == pytest.approx((0.5 + 1.0) / 2)


def test_value_and_sft_losses():
    values, old, ret = t([1.0, 0.0]), t([0.0, 0.0]), t([0.0, 1.0])
    # token 0: err 1, clipped V = 0.2 -> err 0.04 -> max 1; token 1: err 1, clipped same -> 1
    loss, m = value_loss(values, old, ret, t([1, 1]), clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (1 + 1) / 2)
    values = t([0.5])
    loss, m = value_loss(values, t([0.0]), t([0.5]), t([1]), clip=0.2)  # unclipped err 0, clipped (0.2-0.5)^2
    assert loss.item() == pytest.approx(0.5 * 0.09) and m["value_clip_frac"].item() == 1.0
    loss, m = sft_loss(t([L(0.5), L(0.25), -9.0]), t([1, 1, 0]))
    assert loss.item() == pytest.approx((math.log(2) + math.log(4)) / 2)


def test_config_rejects_double_correction():
    with pytest.raises(ValueError, match="choose one"):
        PolicyLossConfig(decoupled=True, tis="token")
