"""What the actors did, in the learner's MLflow run: ``rollout/*`` per step and sample episodes.

The learner is the real one (tiny model, CPU) with a real MLflow SQLite store; groups carry the
metadata the actors write, so the expected values are computed here by hand.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from agentrl.learner.rollout_stats import RolloutStats, sample_episodes
from tests._learner_helpers import ListSource, Recorder, make_agent_group, make_group, tiny_model  # noqa: F401

TURNS, CALLS, ERRORS = [2, 3, 4, 3], [1, 2, 3, 2], [0, 1, 2, 0]
FINISH, WALL = ["answer", "max_turns", "context_full", "answer"], [1.0, 2.0, 3.0, 2.0]


def calc_group(rng, rewards: list[float], group_id: str, version: int = 0):
    """A group of agentrl's own loop: one trajectory per episode, metadata as run_episode writes it."""
    group = make_group(rng, rewards=rewards, group_id=group_id, version=version)
    group.env = "calc"
    for i, t in enumerate(group.trajectories):
        t.metadata = {
            "env": "calc",
            "episode_id": f"{group_id}-{i}",
            "num_turns": TURNS[i],
            "num_tool_calls": CALLS[i],
            "num_tool_errors": ERRORS[i],
            "num_generate_calls": TURNS[i],
            "generation_latency_s": 0.5 * TURNS[i],
            "tool_latency_s": 0.25 * CALLS[i],
            "finish_reason": FINISH[i],
            "episode_wall_s": WALL[i],
            "success": rewards[i] > 0,
            "messages": [
                {"role": "user", "content": f"{group_id}: what is 2+3?"},
                {"role": "assistant", "content": '<tool_call>{"name": "calc", "arguments": "2+3"}</tool_call>'},
                {"role": "tool", "content": "5"},
                {"role": "assistant", "content": f"The answer is {5 if rewards[i] else 6}."},
            ],
        }
    return group


def agent_group(rng, version: int = 0):
    """Two agent episodes, of two sequences and one; episode-level numbers on every sequence."""
    group = make_agent_group(rng, [2, 1], [1.0, 0.0], env="agent", group_id="ag", success=True, version=version)
    for t in group.trajectories:
        t.metadata.update({"num_turns": 1, "episode_wall_s": 5.0, "finish_reason": "stop"})
    group.trajectories[-1].metadata["episode_limit"] = "max_turns"
    return group


def test_rollout_metrics_from_known_metadata():
    rng = np.random.default_rng(0)
    a, b = calc_group(rng, [1, 0, 0, 1], "a"), calc_group(rng, [0, 1, 0, 0], "b", version=1)
    stats = RolloutStats()
    stats.add(a, policy_version=2)
    stats.add(b, policy_version=2)
    m = stats.metrics()
    assert m["rollout/groups"] == 2 and m["rollout/episodes"] == 8
    assert m["rollout/turns_mean"] == 3.0 and m["rollout/tool_calls_mean"] == 2.0
    assert m["rollout/tool_errors_per_episode"] == 0.75 and m["rollout/tool_error_rate"] == 6 / 16
    assert m["rollout/tool_latency_s_mean"] == 0.25 and m["rollout/generation_latency_s_mean"] == 0.5
    assert m["rollout/finish_reason/answer"] == 0.5 and m["rollout/finish_reason/max_turns"] == 0.25
    assert m["rollout/finish_reason/context_full"] == 0.25 and m["rollout/truncated_frac"] == 0.5
    assert m["rollout/episode_wall_s_mean"] == 2.0 and m["rollout/success_frac"] == 3 / 8
    assert m["rollout/reward_mean"] == 3 / 8
    model_tokens = [int(t.loss_mask.sum()) for g in (a, b) for t in g.trajectories]
    assert m["rollout/response_tokens_mean"] == pytest.approx(np.mean(model_tokens))
    assert m["rollout/response_tokens_max"] == max(model_tokens)
    assert m["rollout/policy_lag_mean"] == 1.5 and m["rollout/policy_lag_max"] == 2  # versions 0 and 1, learner at 2
    assert m["rollout/env/calc/episodes"] == 8 and m["rollout/env/calc/turns_mean"] == 3.0
    assert stats.metrics() == {"rollout/groups": 0.0, "rollout/episodes": 0.0}  # a new window

    # agent episodes: per-sequence numbers summed, per-episode ones read once, the limit is the finish reason
    stats.add(agent_group(rng), policy_version=0)
    m = stats.metrics()
    assert m["rollout/episodes"] == 2 and m["rollout/sequences_per_episode"] == 1.5
    assert m["rollout/turns_mean"] == 1.5 and m["rollout/episode_wall_s_mean"] == 5.0
    assert m["rollout/finish_reason/stop"] == 0.5 and m["rollout/finish_reason/max_turns"] == 0.5
    assert m["rollout/truncated_frac"] == 0.5 and m["rollout/env/agent/success_frac"] == 0.5


def test_names_are_bounded():
    """A sender cannot grow the metrics without bound: 16 finish reasons and env names per step."""
    rng = np.random.default_rng(3)
    stats = RolloutStats()
    for i in range(20):
        group = make_group(rng, group_size=2, rewards=[0, 1])
        group.env = f"env{i}"
        for t in group.trajectories:
            t.metadata = {"finish_reason": f"reason{i}"}
        stats.add(group, policy_version=0)
    m = stats.metrics()
    assert m["rollout/finish_reason/other"] == 8 / 40 and m["rollout/finish_reason/reason15"] == 2 / 40
    assert "rollout/finish_reason/reason16" not in m
    assert m["rollout/env/other/episodes"] == 8 and "rollout/env/env16/episodes" not in m


def test_samples_are_the_best_and_worst_episodes():
    rng = np.random.default_rng(1)
    groups = [calc_group(rng, [0, 1, 0, 1], "a"), agent_group(rng), calc_group(rng, [1, 0, 0, 0], "c")]
    doc = sample_episodes(groups, step=4, policy_version=3, groups_to_show=2, decode=lambda ids: f"<{len(ids)} ids>")
    assert (doc["step"], doc["policy_version"]) == (4, 3)
    picks = [(e["group_id"], e["pick"], e["episode"], e["reward"]) for e in doc["episodes"]]
    assert picks == [
        ("a", "best", "a-1", 1.0),
        ("a", "worst", "a-0", 0.0),
        ("ag", "best", "ag-0", 1.0),
        ("ag", "worst", "ag-1", 0.0),
    ]
    best = doc["episodes"][0]
    assert best["messages"][-1] == {"role": "assistant", "content": "The answer is 5."}
    assert best["finish_reason"] == "max_turns" and best["num_tool_calls"] == 2 and best["policy_versions"] == [0]
    # no messages kept: the tokens, decoded in context / model segments
    roles = [m["role"] for m in doc["episodes"][2]["messages"]]
    assert roles == ["context", "model", "context", "model"]
    assert doc["episodes"][2]["num_sequences"] == 2 and doc["episodes"][3]["truncated"]


def test_learner_logs_rollout_metrics_and_samples_to_mlflow(tiny_model, tmp_path):
    from mlflow import MlflowClient
    from transformers import AutoTokenizer

    from agentrl.config import load_config
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.loop import Learner, LearnerIO
    from agentrl.tracking import open_tracker

    init_distributed("cpu")
    rng = np.random.default_rng(2)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(
        None,
        [
            f'model.path="{tiny_model}"',
            f'run.run_dir="{tmp_path}"',
            "learner.groups_per_step=2",
            "learner.max_tokens_per_microbatch=128",
            "learner.checkpoint_every_steps=0",
            'learner.device="cpu"',
            "learner.max_steps=3",
            f'tracking.uri="{uri}"',
            "tracking.sample_episodes_every=2",
            "tracking.sample_episodes_groups=2",
        ],
    )
    plain = make_group(rng, rewards=[0, 1, 1, 0], group_id="plain", version=1)  # no metadata at all
    # a None ends a wave: the learner's drain stops there, so each step sees exactly its wave
    waves = [
        calc_group(rng, [1, 0, 0, 1], "a"),
        calc_group(rng, [0, 1, 0, 0], "b"),
        None,
        agent_group(rng, version=1),
        plain,
        None,
        calc_group(rng, [1, 0, 1, 0], "c", version=1),
        calc_group(rng, [0, 0, 1, 0], "d", version=2),
        None,
    ]
    rec = Recorder()
    tracker = open_tracker(cfg.tracking, tmp_path)
    learner = Learner(cfg, io=LearnerIO(source=ListSource(waves), progress=rec, weights=rec, tracker=tracker))
    assert learner.run() == "done" and learner.trainer.step == 3

    client = MlflowClient(uri)

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(tracker.run_id, key)}

    assert history("rollout/episodes") == {1: 8, 2: 6, 3: 8}
    assert history("rollout/turns_mean") == {1: 3.0, 2: 0.5, 3: 3.0}  # step 2: 1.5 per agent episode, 0 for plain
    assert history("rollout/tool_errors_per_episode") == {1: 0.75, 2: 0.0, 3: 0.75}
    assert history("rollout/truncated_frac") == {1: 0.5, 2: 1 / 6, 3: 0.5}
    assert history("rollout/finish_reason/unknown") == {2: 4 / 6}
    assert history("rollout/episode_wall_s_mean")[2] == pytest.approx(10 / 6)  # 5 s per agent episode, not per sequence
    assert history("rollout/policy_lag_mean") == {1: 0.0, 2: 0.0, 3: 0.5}  # "c" was written by version 1, at 2
    assert history("rollout/env/agent/episodes") == {2: 2.0}
    assert history("env/calc/success_recent")[3] == pytest.approx((2 + 1 + 2 + 1) / 16)
    row = json.loads((tmp_path / "learner_metrics.jsonl").read_text().splitlines()[0])
    assert row["rollout/finish_reason/answer"] == 0.5  # the same numbers in the learner's own file

    artifacts = [a.path for a in client.list_artifacts(tracker.run_id, "samples")]
    assert artifacts == ["samples/step_000002.json"]  # every 2 steps, of 3
    local = client.download_artifacts(tracker.run_id, artifacts[0], str(tmp_path / "download"))
    with open(local) as f:
        doc = json.load(f)
    assert doc["step"] == 2
    picks = [(e["group_id"], e["pick"], e["reward"]) for e in doc["episodes"]]
    assert picks == [("ag", "best", 1.0), ("ag", "worst", 0.0), ("plain", "best", 1.0), ("plain", "worst", 0.0)]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    t = plain.trajectories[1]
    first_model = int(np.argmax(t.loss_mask))
    segment = doc["episodes"][2]["messages"][0]
    assert segment == {"role": "context", "content": tokenizer.decode([int(x) for x in t.tokens[:first_model]])}
    assert doc["episodes"][2]["messages"][1]["role"] == "model"
