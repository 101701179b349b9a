"""Shared pieces of the learner's tests: the tiny model, synthetic groups, a config.

Fixtures are imported into each test module (``from tests._learner_helpers import tiny_model``);
the model is built once per session under pytest's base temp folder and reused.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from agentrl.protocol import Trajectory, TrajectoryGroup
from agentrl.transport.base import GroupSource, ProgressSink

REPO = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict[str, str]:
    """Environment for subprocesses: this branch first on PYTHONPATH, few threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_VERBOSITY"] = "error"
    env["TQDM_DISABLE"] = "1"
    return env


PYTHON = sys.executable
_SEQ = itertools.count()  # make_group's sequence numbers: unique within a test session


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 (0.86M parameters) shared by every learner test module."""
    from agentrl.models.builder import init_model

    path = tmp_path_factory.getbasetemp() / "learner-tiny-model"
    if not (path / "config.json").exists():
        init_model(path, "tiny", seed=0)
    return path


def make_group(
    rng: np.random.Generator,
    *,
    group_size: int = 4,
    version: int = 0,
    min_len: int = 12,
    max_len: int = 40,
    vocab: int = 400,
    rewards: list[float] | None = None,
    group_id: str = "g",
    actor_id: str = "test-actor",
    session: str = "test-session",
    seq: int | None = None,
) -> TrajectoryGroup:
    """A group of multi-turn-shaped trajectories: prompt, model turn, tool result, model turn."""
    trajs = []
    for i in range(group_size):
        n = int(rng.integers(min_len, max_len + 1))
        tokens = rng.integers(1, vocab, n).astype(np.int32)
        mask = np.zeros(n, np.uint8)
        a = n // 4
        b = a + max(2, n // 4)
        c = b + max(1, n // 8)
        mask[a:b] = 1
        mask[c:] = 1
        behavior = np.where(mask, -rng.uniform(0.5, 6.0, n), 0.0).astype(np.float32)
        versions = np.where(mask, version, -1).astype(np.int32)
        reward = float(rewards[i]) if rewards is not None else float(rng.integers(0, 2))
        trajs.append(
            Trajectory(
                tokens=tokens, loss_mask=mask, behavior_logprobs=behavior, weight_versions=versions, reward=reward
            )
        )
    if rewards is None and len({t.reward for t in trajs}) == 1:
        trajs[0].reward = 1.0 - trajs[0].reward  # keep the group's rewards varied
    seq = next(_SEQ) if seq is None else seq
    return TrajectoryGroup(
        group_id=group_id, task_id=group_id, env="test", trajectories=trajs, actor_id=actor_id, session=session, seq=seq
    )


def make_agent_group(
    rng: np.random.Generator,
    sequences: list[int],
    rewards: list[float],
    *,
    env: str = "agent",
    group_id: str = "ag",
    success: bool = False,
    **kw,
) -> TrajectoryGroup:
    """A group of agent episodes: episode ``i`` is ``sequences[i]`` trajectories, each with the
    episode's reward and ``metadata`` as :mod:`agentrl.agents.recording` writes it."""
    per_trajectory = [r for n, r in zip(sequences, rewards) for _ in range(n)]
    group = make_group(rng, group_size=len(per_trajectory), rewards=per_trajectory, group_id=group_id, **kw)
    group.env = env
    k = 0
    for i, n in enumerate(sequences):
        for j in range(n):
            meta = {"episode_id": f"{group_id}-{i}", "sequence_index": j, "num_sequences": n, "env": env}
            if success:
                meta["success"] = rewards[i] >= 1.0
            group.trajectories[k].metadata = meta
            k += 1
    return group


def fixed_samples(seed: int, groups: int = 4, policy_version: int = 0, advantage: str = "grpo") -> list:
    """A deterministic batch of samples (the same on every rank and in every process)."""
    from agentrl.learner.batching import AdvantageSpec, samples_from_group

    rng = np.random.default_rng(seed)
    out = []
    for i in range(groups):
        g = make_group(rng, version=policy_version, group_id=f"g{i}")
        out += samples_from_group(g, policy_version, AdvantageSpec(advantage))
    return out


class ListSource(GroupSource):
    """An in-memory group source with GroupReceiver's methods (for loop tests on rank 0)."""

    def __init__(self, groups: list[TrajectoryGroup], *, empty_polls: int = 0) -> None:
        self.items = deque(groups)
        self.empty_polls = empty_polls  # answer "nothing yet" this many times first
        self._stats = {"received": 0, "malformed": 0}

    @property
    def stats(self) -> dict[str, int]:
        return self._stats

    def get(self, timeout_s: float | None = None) -> TrajectoryGroup | None:
        if self.empty_polls > 0 or not self.items:
            self.empty_polls -= 1
            time.sleep(min(timeout_s or 0.0, 0.05))
            return None
        self._stats["received"] += 1
        return self.items.popleft()

    def close(self) -> None:
        pass


class Recorder(ProgressSink):
    """Records published progress and weight pushes."""

    def publish(self, progress) -> None:
        self.progress.append(progress)

    device = "cpu"  # WeightUpdater's interface, as push_weights and the loop use it
    members = ["recorded"]  # one engine, always there, starting at version 0

    def __init__(self) -> None:
        self.progress: list = []
        self.pushes: list[tuple[int, list[str]]] = []
        self.labels = {"recorded": "0"}

    def membership_change(self, version: int) -> str:
        return ""

    def connect(self) -> None:
        pass

    def lagging(self, version: int) -> list[str]:
        return [u for u in self.members if self.labels[u] != str(version)]

    def push_plan(self, plan, version: int, materialize) -> dict:
        self.pushes.append((version, [name for bucket in plan for name, _ in materialize(bucket)]))
        self.labels = {u: str(version) for u in self.members}
        return {}

    def close(self) -> None:
        pass


def iter_full_tensors(model, *, bucket_bytes: int = 64 << 20, dtype=None):
    """``(name, full tensor)`` of everything ``push_weights`` sends, yielded on rank 0 (other ranks
    yield nothing), gathered one bucket at a time. Must be iterated to the end on every rank."""
    import torch.distributed as dist

    from agentrl.learner.weight_push import full_tensors, plan_buckets, tensors_to_push

    is_main = not dist.is_initialized() or dist.get_rank() == 0
    for bucket in plan_buckets(tensors_to_push(model), bucket_bytes, dtype):
        gathered = full_tensors(bucket, dtype)
        while gathered:
            item = gathered.pop(0)
            if is_main:
                yield item
            del item


def sample_logprobs(trainer, samples: list) -> list:
    """Per-sample logprobs of tokens 1..T-1 under the trainer's current policy (all ranks must call;
    every rank gets every sample's values)."""
    import torch

    from agentrl.learner.batching import collate, plan_microbatches
    from agentrl.learner.model import token_logprobs

    plan = plan_microbatches([s.num_tokens for s in samples], trainer.spec.max_tokens_per_microbatch, 1)[0]
    out: list = [None] * len(samples)
    with torch.no_grad():
        for indices in plan:
            mb = collate([samples[i] for i in indices], pad_token_id=trainer.pad_token_id).to(trainer.device)
            logprobs, _ = token_logprobs(trainer.policy, mb, temperature=trainer.spec.temperature, all_positions=True)
            starts = mb.cu_seqlens.tolist()
            for j, i in enumerate(indices):
                out[i] = logprobs[starts[j] : starts[j + 1] - 1].cpu()
    return out


def learner_overrides(tiny_model, run_dir, **extra) -> list[str]:
    """Config overrides for a small CPU learner on ``tiny_model`` in ``run_dir``; ``extra`` adds or replaces keys."""
    items = {
        "model.path": f'"{tiny_model}"',
        "run.run_dir": f'"{run_dir}"',
        "learner.groups_per_step": "2",
        "learner.max_tokens_per_microbatch": "128",
        "learner.checkpoint_every_steps": "0",
        "learner.device": '"cpu"',
        "tracking.enabled": "false",
        "actors.group_size": "4",
    }
    items.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in items.items()]
