"""Group filtering, staleness, dynamic sampling and sequence packing (agentrl/learner/batching.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentrl.learner.batching import (
    AdvantageSpec,
    GroupBuffer,
    Sample,
    collate,
    episode_index,
    loss_normalizer,
    overlong_shaping,
    plan_microbatches,
    samples_from_group,
    samples_from_groups,
    validate_group,
)
from agentrl.protocol import TrajectoryGroup
from tests._learner_helpers import make_agent_group, make_group, tiny_model  # noqa: F401


def _buffer(**kw) -> GroupBuffer:
    base = dict(max_staleness=1, dynamic_sampling=True, vocab_size=512, max_sequence_tokens=64)
    base.update(kw)
    return GroupBuffer(**base)


def test_validation_names_what_is_wrong():
    rng = np.random.default_rng(0)
    assert validate_group(make_group(rng), vocab_size=512, max_sequence_tokens=64) is None
    g = make_group(rng)
    g.trajectories[1].tokens[3] = 600
    assert validate_group(g, vocab_size=512, max_sequence_tokens=64) == "malformed_token_id"
    g = make_group(rng)
    g.trajectories[0].behavior_logprobs[g.trajectories[0].loss_mask.astype(bool)] = np.nan
    assert validate_group(g, vocab_size=512, max_sequence_tokens=64) == "malformed_logprob"
    g = make_group(rng)
    g.trajectories[0].loss_mask[:] = 0
    assert validate_group(g, vocab_size=512, max_sequence_tokens=64) == "malformed_no_model_tokens"
    assert validate_group(make_group(rng, min_len=70, max_len=70), vocab_size=512, max_sequence_tokens=64) == "too_long"
    g = make_group(rng)
    g.trajectories = []
    assert validate_group(g, vocab_size=512, max_sequence_tokens=64) == "malformed_empty"


def test_rewards_are_checked_at_the_border():
    rng = np.random.default_rng(3)
    limits = dict(vocab_size=512, max_sequence_tokens=64, max_abs_reward=100.0)
    for bad in (float("nan"), float("inf"), -float("inf"), 1e300, -100.5):
        g = make_group(rng)
        g.trajectories[2].reward = bad
        assert validate_group(g, **limits) == "malformed_reward", bad
    g = make_group(rng)
    g.trajectories[0].reward_components = {"format": float("nan")}
    assert validate_group(g, **limits) == "malformed_reward"
    g = make_group(rng, rewards=[-100, 100, 0, 3])
    assert validate_group(g, **limits) is None  # the bound itself is fine
    buf = _buffer(max_abs_reward=100.0)
    big = make_group(rng, rewards=[1e300, 0, 0, 1])
    assert buf.add(big, policy_version=0) == "malformed_reward" and len(buf) == 0
    assert buf.counters["dropped_malformed_reward"] == 1 and buf.counters["received"] == 1


def test_buffer_counts_drops_and_never_raises():
    rng = np.random.default_rng(1)
    buf = _buffer(max_staleness=1)
    assert buf.add(make_group(rng, version=5), policy_version=5) is None
    assert buf.add(make_group(rng, version=4), policy_version=5) is None  # staleness 1: fine
    assert buf.add(make_group(rng, version=3), policy_version=5) == "stale"  # staleness 2
    assert buf.add(make_group(rng, rewards=[1, 1, 1, 1]), policy_version=0) == "zero_variance"
    bad = make_group(rng)
    bad.trajectories[0].tokens[0] = -3
    assert buf.add(bad, policy_version=0) == "malformed_token_id"
    assert buf.add(make_group(rng, version=9), policy_version=5) is None  # newer than the learner: kept
    c = buf.counters
    assert (c["received"], c["accepted"], c["dropped_stale"], c["dropped_zero_variance"]) == (6, 3, 1, 1)
    assert c["dropped_malformed_token_id"] == 1 and c["future_version"] == 1
    # groups can go stale while they wait: at version 6 the version-4 group is too old
    taken = buf.take(2, policy_version=6)
    assert taken is not None and [g.oldest_version() for g in taken] == [5, 9]
    assert buf.counters["dropped_stale"] == 2 and len(buf) == 0 and buf.counters["consumed"] == 2
    assert buf.take(1, policy_version=6) is None


def test_take_reads_each_groups_oldest_version_once_however_often_it_polls(monkeypatch):
    """``take`` runs at every poll: it reads the oldest version stored at ``add`` (and ``restore``),
    not the group's tokens again (docs/scaling.md, limit 3)."""
    rng = np.random.default_rng(4)
    buf = _buffer(max_staleness=1)
    groups = [make_group(rng, version=5), make_group(rng, version=4)]
    for g in groups:
        assert buf.add(g, policy_version=5) is None
    restored = make_group(rng, version=5)
    buf.restore(restored)
    reads = []
    real = TrajectoryGroup.oldest_version
    monkeypatch.setattr(TrajectoryGroup, "oldest_version", lambda self: reads.append(self) or real(self))
    for _ in range(50):
        assert buf.take(4, policy_version=5) is None  # three buffered: not enough
    taken = buf.take(1, policy_version=6)  # the version-4 group is now stale: dropped, then one taken
    assert reads == [] and taken == [groups[0]] and list(buf.groups) == [restored]
    assert buf.counters["dropped_stale"] == 1 and buf._oldest == {id(restored): 5}


def test_synchronous_staleness_zero_and_no_dynamic_sampling():
    rng = np.random.default_rng(2)
    buf = _buffer(max_staleness=0, dynamic_sampling=False)
    assert buf.add(make_group(rng, version=2), policy_version=3) == "stale"
    assert buf.add(make_group(rng, version=3, rewards=[0, 0, 0, 0]), policy_version=3) is None


def test_samples_carry_group_advantages():
    rng = np.random.default_rng(3)
    g = make_group(rng, rewards=[1, 0, 0, 1], version=2)
    samples = samples_from_group(g, 3, AdvantageSpec("grpo"))
    assert [s.advantage for s in samples] == [0.5, -0.5, -0.5, 0.5]
    assert all(s.staleness == 1 for s in samples)
    rloo = samples_from_group(g, 3, AdvantageSpec("rloo"))
    assert rloo[0].advantage == pytest.approx(1 - 1 / 3)


def test_overlong_shaping_is_dapos_ramp_before_the_limit():
    """0 up to limit - cache, linear to -penalty at the limit, -penalty for a truncated episode."""
    shape = lambda n, truncated=False: overlong_shaping(n, 256, 64, 0.5, truncated)  # noqa: E731
    assert [shape(100), shape(192), shape(224), shape(256)] == pytest.approx([0.0, 0.0, -0.25, -0.5])
    assert shape(10, truncated=True) == -0.5


def test_overlong_shaping_enters_the_rewards_before_the_baseline():
    rng = np.random.default_rng(11)
    g = make_group(rng, rewards=[1, 1, 0, 0], min_len=30, max_len=30)
    finishes = ["answer", "context_full", "answer", "answer"]
    for t, finish in zip(g.trajectories, finishes):
        t.metadata = {"finish_reason": finish, "max_total_tokens": 36}  # 30 tokens: 2 into a ramp of 8
    spec = AdvantageSpec("grpo", overlong_penalty_tokens=8, overlong_penalty=1.0)
    samples = samples_from_group(g, 0, spec)
    shaped = [1 - 0.25, 1 - 1.0, -0.25, -0.25]
    assert [s.reward_shaping for s in samples] == pytest.approx([-0.25, -1.0, -0.25, -0.25])
    assert [s.reward for s in samples] == pytest.approx(shaped)
    assert [s.advantage for s in samples] == pytest.approx([r - np.mean(shaped) for r in shaped])
    del g.trajectories[0].metadata["max_total_tokens"]  # an episode without a recorded limit is not shaped
    assert samples_from_group(g, 0, spec)[0].reward_shaping == 0.0
    assert [s.reward_shaping for s in samples_from_group(g, 0, AdvantageSpec("grpo"))] == [0.0] * 4  # off


def test_reinforce_pp_whitens_the_group_centred_advantages_over_the_batch():
    """Two groups: centred per group, then mean 0 and std 1 over the step's episodes, each episode
    counted once however many sequences it has."""
    rng = np.random.default_rng(12)
    groups = [make_group(rng, rewards=[1, 0, 0, 0], group_id="a"), make_agent_group(rng, [2, 1], [3.0, 1.0])]
    samples = samples_from_groups(groups, 0, AdvantageSpec("reinforce_pp"))
    centred = np.array([0.75, -0.25, -0.25, -0.25, 1.0, -1.0])  # per episode
    expected = (centred - centred.mean()) / (centred.std() + 1e-6)
    by_sequence = [*expected[:4], expected[4], expected[4], expected[5]]
    assert [s.advantage for s in samples] == pytest.approx(by_sequence, abs=1e-6)
    grpo = samples_from_groups(groups, 0, AdvantageSpec("grpo"))
    assert [s.advantage for s in grpo] == pytest.approx([*centred[:4], 1.0, 1.0, -1.0])


def test_constant_normalisation_divides_by_episodes_times_a_fixed_length():
    rng = np.random.default_rng(13)
    samples = samples_from_group(make_agent_group(rng, [2, 1, 1], [1.0, 0.0, 0.5]), 0)
    assert loss_normalizer(samples, "constant", 100) == pytest.approx(300.0)
    with pytest.raises(ValueError, match="normalization_tokens"):
        loss_normalizer(samples, "constant", 0)


def test_episode_index_gives_each_sequence_its_episode():
    rng = np.random.default_rng(7)
    g = make_agent_group(rng, [2, 1, 3], [1.0, 0.0, 0.5])
    g.trajectories[3].metadata = {}  # no episode id: an episode of its own
    rewards, index = episode_index(g.trajectories)
    assert rewards == [1.0, 0.0, 0.5, 0.5] and index == [0, 0, 1, 2, 3, 3]


def test_advantages_are_normalised_over_episodes_and_shared_by_their_sequences():
    """Episode 0 branched into three sequences, episode 3 into two: per episode, the baseline is the
    mean of four episode rewards (0.5); per sequence it would be 5/7 and episode 0 would count thrice."""
    rng = np.random.default_rng(8)
    g = make_agent_group(rng, [3, 1, 1, 2], [1.0, 0.0, 0.0, 1.0])
    grpo = samples_from_group(g, 0, AdvantageSpec("grpo"))
    assert [s.advantage for s in grpo] == [0.5, 0.5, 0.5, -0.5, -0.5, 0.5, 0.5]
    assert [s.episode_weight for s in grpo] == pytest.approx([1 / 3] * 3 + [1.0, 1.0, 0.5, 0.5])
    whitened = samples_from_group(g, 0, AdvantageSpec("grpo", normalize_std=True))
    assert [s.advantage for s in whitened] == pytest.approx([1.0] * 3 + [-1.0, -1.0, 1.0, 1.0], abs=1e-5)
    rloo = samples_from_group(g, 0, AdvantageSpec("rloo"))  # 4 episodes: r_i - mean of the 3 others
    assert [s.advantage for s in rloo] == pytest.approx([1 - 1 / 3] * 3 + [-2 / 3, -2 / 3, 2 / 3, 2 / 3])
    # an episode counts once in a sequence-mean loss: the normaliser is the number of episodes
    assert loss_normalizer(grpo, "sequence") == pytest.approx(4.0)
    assert loss_normalizer(grpo, "token") == sum(int(s.loss_mask[1:].sum()) for s in grpo)
    # one-sequence episodes (agentrl's own loop) are unchanged: one trajectory, one episode
    plain = make_group(rng, rewards=[1, 0, 0, 1])
    assert [s.advantage for s in samples_from_group(plain, 0)] == [0.5, -0.5, -0.5, 0.5]


def test_sequence_mean_loss_weighs_each_episode_once():
    """Two sequences of one episode (weight 1/2 each) and a one-sequence episode: the loss is the mean
    of the two episodes' token means, not of three sequences."""
    from agentrl.learner.loss import masked_reduce

    def sample(n: int, weight: float) -> Sample:
        return Sample(
            tokens=np.arange(n, dtype=np.int32),
            loss_mask=np.ones(n, np.uint8),
            behavior_logprobs=np.zeros(n, np.float32),
            episode_weight=weight,
        )

    samples = [sample(3, 0.5), sample(5, 0.5), sample(4, 1.0)]
    mb = collate(samples)
    assert mb.seq_weights.tolist() == [0.5, 0.5, 1.0]
    per_token = torch.where(mb.seq_ids == 2, 3.0, 1.0)  # episode 0's tokens cost 1, episode 1's cost 3
    loss = masked_reduce(
        per_token,
        mb.loss_mask,
        normalization="sequence",
        seq_ids=mb.seq_ids,
        num_seqs=3,
        seq_weights=mb.seq_weights,
        normalizer=loss_normalizer(samples, "sequence"),
    )
    assert loss.item() == pytest.approx((1 + 3) / 2)
    unweighted = masked_reduce(per_token, mb.loss_mask, normalization="sequence", seq_ids=mb.seq_ids, num_seqs=3)
    assert unweighted.item() == pytest.approx((1 + 1 + 3) / 3)  # what an episode of many sequences would tilt


def test_dynamic_sampling_and_env_metrics_work_on_episodes():
    rng = np.random.default_rng(9)
    buf = _buffer(max_sequence_tokens=64)
    same = make_agent_group(rng, [3, 1, 2, 1], [1.0, 1.0, 1.0, 1.0], env="agent", success=True)
    assert buf.add(same, policy_version=0) == "zero_variance"
    varied = make_agent_group(rng, [3, 1, 1, 1], [1.0, 0.0, 0.0, 0.0], env="agent", success=True)
    assert buf.add(varied, policy_version=0) is None
    assert buf.add(make_group(rng, rewards=[1, 0, 0, 0]), policy_version=0) is None  # env "test"
    stale = make_agent_group(rng, [1, 1], [0.0, 1.0], env="agent", version=0)
    assert buf.add(stale, policy_version=5) == "stale"
    m = buf.env_metrics()
    assert (m["env/agent/received"], m["env/agent/accepted"]) == (3, 1)
    assert (m["env/agent/dropped_zero_variance"], m["env/agent/dropped_stale"]) == (1, 1)
    assert m["env/test/received"] == m["env/test/accepted"] == 1
    # recent rewards count episodes (not sequences) of every valid group, dropped ones included
    assert m["env/agent/reward_recent"] == pytest.approx((4 + 1 + 1) / 10)
    assert m["env/agent/success_recent"] == pytest.approx(5 / 8)  # the stale group says nothing of success
    assert "env/test/success_recent" not in m and m["env/test/reward_recent"] == 0.25
    # a sender cannot grow the metrics without bound
    for i in range(GroupBuffer.MAX_ENVS + 5):
        g = make_group(rng, rewards=[1, 0, 0, 0], group_id=f"n{i}")
        g.env = f"env{i}"
        buf.add(g, policy_version=0)
    assert len(buf.env_counters) == GroupBuffer.MAX_ENVS + 1 and buf.env_counters["other"]["received"] > 0


def test_plan_is_even_and_within_budget():
    rng = np.random.default_rng(4)
    lengths = [int(x) for x in rng.integers(5, 60, 37)]
    for world in (1, 2, 3):
        plan = plan_microbatches(lengths, max_tokens=100, world_size=world)
        assert len({len(r) for r in plan}) == 1  # same number of micro-batches on every rank
        seen = sorted(i for r in plan for mb in r for i in mb)
        assert seen == list(range(len(lengths)))
        loads = [sum(lengths[i] for mb in r for i in mb) for r in plan]
        for r in plan:
            assert all(sum(lengths[i] for i in mb) <= 100 for mb in r)
        assert max(loads) - min(loads) <= max(lengths)
    # fewer sequences than ranks: the other rank gets an empty micro-batch
    assert plan_microbatches([10], max_tokens=100, world_size=2) == [[[0]], [[]]]
    with pytest.raises(ValueError, match="exceeds"):
        plan_microbatches([101], max_tokens=100)


def test_collate_restarts_positions_and_shifts_targets():
    a = Sample(
        tokens=np.array([5, 6, 7], np.int32),
        loss_mask=np.array([0, 1, 1], np.uint8),
        behavior_logprobs=np.array([0, -0.5, -0.25], np.float32),
        advantage=2.0,
    )
    b = Sample(
        tokens=np.array([8, 9], np.int32),
        loss_mask=np.array([0, 1], np.uint8),
        behavior_logprobs=np.array([0, -1.0], np.float32),
        advantage=-1.0,
    )
    mb = collate([a, b])
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert mb.cu_seqlens.tolist() == [0, 3, 5]
    assert mb.targets.tolist() == [6, 7, 0, 9, 0]
    assert mb.loss_mask.tolist() == [True, True, False, True, False]
    assert mb.behavior_logprobs.tolist() == [-0.5, -0.25, 0.0, -1.0, 0.0]
    assert mb.advantages.tolist() == [2.0, 2.0, 0.0, -1.0, 0.0]
    assert mb.seq_ids.tolist() == [0, 0, 0, 1, 1]
    assert mb.num_loss_tokens == 3
    assert loss_normalizer([a, b], "token") == 3.0 and loss_normalizer([a, b], "sequence") == 2.0
    empty = collate([])
    assert empty.num_tokens == 1 and empty.num_loss_tokens == 0


def test_packed_logprobs_equal_unpacked(tiny_model):
    """Attention never crosses sequences: logprobs packed with others == logprobs alone."""
    from agentrl.learner.model import load_causal_lm, token_logprobs

    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_model)).eval()
    rng = np.random.default_rng(5)
    samples = []
    for n in (7, 1 + 1, 33, 18):
        samples.append(
            Sample(
                tokens=rng.integers(0, 500, n).astype(np.int32),
                loss_mask=np.ones(n, np.uint8),
                behavior_logprobs=np.zeros(n, np.float32),
            )
        )
    with torch.no_grad():
        packed, _ = token_logprobs(model, collate(samples), temperature=0.7, all_positions=True)
        starts = np.cumsum([0] + [s.num_tokens for s in samples])
        for s, start in zip(samples, starts):
            alone, _ = token_logprobs(model, collate([s]), temperature=0.7, all_positions=True)
            assert torch.allclose(packed[start : start + s.num_tokens - 1], alone[:-1], atol=1e-5)
        # and transformers' own sdpa forward of one sequence agrees with the varlen path
        from transformers import AutoModelForCausalLM

        sdpa = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa").eval()
        s = samples[2]
        ids = torch.from_numpy(s.tokens.astype(np.int64))[None]
        ref = torch.log_softmax(sdpa(input_ids=ids).logits[0].float() / 0.7, -1)
        ref = ref[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
        alone, _ = token_logprobs(model, collate([s]), temperature=0.7, all_positions=True)
        assert torch.allclose(alone[:-1], ref, atol=1e-5)
        # scoring only the loss positions gives the same values there and 0 elsewhere
        s.loss_mask[: s.num_tokens // 2] = 0
        mb = collate([s])
        only, _ = token_logprobs(model, mb, temperature=0.7)
        assert torch.allclose(only[mb.loss_mask], alone[mb.loss_mask], atol=1e-6)
        assert (only[~mb.loss_mask] == 0).all()
