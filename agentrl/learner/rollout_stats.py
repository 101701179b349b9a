"""What the actors did, as the learner sees it: ``rollout/*`` metrics per step and sample episodes.

:class:`RolloutStats` takes every new group rank 0 receives (duplicates once; groups dropped later
still count) and :meth:`RolloutStats.metrics` aggregates the episodes received since the previous
step, logged with that step's metrics. Per-sequence numbers are summed over an agent episode's
sequences, per-episode ones read once; means are per episode. An episode is *truncated* when a
limit ended it (:data:`TRUNCATIONS`, or any ``episode_limit``).

Invariants: only running sums are kept, so a long wait for a batch does not grow memory; finish
reasons and env names are the first 16 seen in a step, the rest ``other``, so a sender cannot grow
the metrics without bound. :func:`sample_episodes` picks the best and worst episodes of a step's
first groups as one JSON document (``samples/step_<n>.json``). See docs/learner.md.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentrl.learner.batching import episode_index, metric_name
from agentrl.protocol import Trajectory, TrajectoryGroup

TRUNCATIONS = frozenset({"max_turns", "context_full", "truncated_tool_call", "length"})
MAX_NAMES = 16  # distinct finish reasons (and env names) per step; later ones count as "other"
MAX_TEXT_CHARS = 4000  # of one message in a sample; the rest is cut, saying how much

_SUMMED = (
    "num_turns",
    "num_tool_calls",
    "num_tool_errors",
    "num_aborts",
    "num_generate_calls",
    "generation_latency_s",
    "tool_latency_s",
)


def _number(md: dict[str, Any], key: str) -> float:
    """A numeric metadata value, 0 when missing or not a finite number (a sender's mistake)."""
    value = md.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0.0
    return float(value)


@dataclass
class Episode:
    """One episode of a group: its trajectories (sequences) and what they add up to."""

    trajectories: list[Trajectory]
    reward: float
    sums: dict[str, float]
    finish_reason: str
    truncated: bool
    success: bool | None
    wall_s: float
    reward_error: bool
    model_tokens: int
    versions: list[int] = field(default_factory=list)  # policy versions of its model tokens, sorted


def episodes(group: TrajectoryGroup) -> list[Episode]:
    """The episodes of ``group``, in order of first appearance."""
    rewards, index = episode_index(group.trajectories)
    members: list[list[Trajectory]] = [[] for _ in rewards]
    for t, e in zip(group.trajectories, index):
        members[e].append(t)
    out = []
    for reward, trajs in zip(rewards, members):
        first, last = trajs[0].metadata, trajs[-1].metadata
        limit = str(last.get("episode_limit") or "")
        finish = limit or str(last.get("finish_reason") or "unknown")
        success = first.get("success")
        versions = np.unique(np.concatenate([t.weight_versions[t.loss_mask.astype(bool)] for t in trajs]))
        out.append(
            Episode(
                trajectories=trajs,
                reward=reward,
                sums={k: sum(_number(t.metadata, k) for t in trajs) for k in _SUMMED},
                finish_reason=finish,
                truncated=bool(limit) or finish in TRUNCATIONS,
                success=success if isinstance(success, bool) else None,
                wall_s=_number(first, "episode_wall_s"),
                reward_error="reward_error" in first,
                model_tokens=int(sum(int(t.loss_mask.sum()) for t in trajs)),
                versions=[int(v) for v in versions if v >= 0],
            )
        )
    return out


@dataclass
class _Totals:
    """Running sums over episodes (no episode is kept: a long wait cannot grow memory)."""

    episodes: int = 0
    sequences: int = 0
    sums: Counter = field(default_factory=Counter)  # the _SUMMED keys, and the rest below
    model_tokens_max: int = 0
    lag_max: int = 0
    judged: int = 0
    finish: Counter = field(default_factory=Counter)

    def add(self, ep: Episode, lag: int) -> None:
        self.episodes += 1
        self.sequences += len(ep.trajectories)
        self.sums.update(ep.sums)
        self.sums.update(
            {
                "model_tokens": ep.model_tokens,
                "wall_s": ep.wall_s,
                "truncated": ep.truncated,
                "reward_error": ep.reward_error,
                "reward": ep.reward,
                "success": ep.success is True,
                "lag": lag,
                "multi_version": len(ep.versions) > 1,
                "tokens_per_sequence": float(np.mean([t.num_tokens for t in ep.trajectories])),
            }
        )
        self.model_tokens_max = max(self.model_tokens_max, ep.model_tokens)
        self.lag_max = max(self.lag_max, lag)
        self.judged += ep.success is not None
        if ep.finish_reason in self.finish or len(self.finish) < MAX_NAMES:
            self.finish[ep.finish_reason] += 1
        else:
            self.finish["other"] += 1

    def metrics(self) -> dict[str, float]:
        n, s = self.episodes, self.sums
        calls, gens = s["num_tool_calls"], s["num_generate_calls"]
        out = {
            "episodes": n,
            "turns_mean": s["num_turns"] / n,
            "tool_calls_mean": calls / n,
            "tool_errors_per_episode": s["num_tool_errors"] / n,
            "tool_error_rate": s["num_tool_errors"] / calls if calls else 0.0,
            "aborts_per_episode": s["num_aborts"] / n,
            "response_tokens_mean": s["model_tokens"] / n,
            "response_tokens_max": self.model_tokens_max,
            "tokens_mean": s["tokens_per_sequence"] / n,
            "sequences_per_episode": self.sequences / n,
            "episode_wall_s_mean": s["wall_s"] / n,
            "truncated_frac": s["truncated"] / n,
            "reward_error_frac": s["reward_error"] / n,
            "reward_mean": s["reward"] / n,
            "policy_lag_mean": s["lag"] / n,
            "policy_lag_max": self.lag_max,
            "multi_version_frac": s["multi_version"] / n,
        }
        if gens:
            out["generation_latency_s_mean"] = s["generation_latency_s"] / gens
        if calls:
            out["tool_latency_s_mean"] = s["tool_latency_s"] / calls
        if self.judged:
            out["success_frac"] = s["success"] / self.judged
        for reason, count in self.finish.items():
            out[f"finish_reason/{metric_name(reason)}"] = count / n
        return {k: float(v) for k, v in out.items()}


_PER_ENV = ("episodes", "reward_mean", "success_frac", "turns_mean", "truncated_frac")


class RolloutStats:
    """The episodes received since the last :meth:`metrics` call (module docstring)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.groups = 0
        self.total = _Totals()
        self.by_env: dict[str, _Totals] = {}

    def add(self, group: TrajectoryGroup, policy_version: int) -> None:
        """Count a newly received group; ``policy_version`` is the learner's at its arrival."""
        if not group.trajectories:
            return
        self.groups += 1
        env = group.env if group.env in self.by_env or len(self.by_env) < MAX_NAMES else "other"
        for ep in episodes(group):
            lag = max(0, policy_version - ep.versions[0]) if ep.versions else 0
            self.total.add(ep, lag)
            self.by_env.setdefault(env, _Totals()).add(ep, lag)

    def metrics(self) -> dict[str, float]:
        """``rollout/*`` over the episodes added since the previous call; starts a new window."""
        out = {"rollout/groups": float(self.groups), "rollout/episodes": float(self.total.episodes)}
        if self.total.episodes:
            out.update({f"rollout/{k}": v for k, v in self.total.metrics().items()})
            for env, totals in sorted(self.by_env.items()):
                per_env = totals.metrics()
                out.update({f"rollout/env/{metric_name(env)}/{k}": per_env[k] for k in _PER_ENV if k in per_env})
        self._reset()
        return out


# --------------------------------------------------------------------------- sample episodes


def sample_episodes(
    groups: list[TrajectoryGroup],
    *,
    step: int,
    policy_version: int,
    groups_to_show: int,
    decode: Callable[[list[int]], str] | None = None,
) -> dict[str, Any]:
    """The best and the worst episode (by reward; one when they are the same) of the first
    ``groups_to_show`` groups, as a JSON-able document. ``decode`` turns token ids into text for
    trajectories that carry no ``metadata["messages"]``."""
    shown = []
    for group in groups[:groups_to_show]:
        eps = episodes(group)
        if not eps:
            continue
        rewards = [ep.reward for ep in eps]
        best, worst = rewards.index(max(rewards)), rewards.index(min(rewards))
        picks = [("best", best)] + ([("worst", worst)] if worst != best else [])
        for label, i in picks:
            shown.append(_episode_doc(group, eps[i], label, i, decode))
    return {"step": step, "policy_version": policy_version, "episodes": shown}


def _episode_doc(
    group: TrajectoryGroup, ep: Episode, label: str, index: int, decode: Callable[[list[int]], str] | None
) -> dict[str, Any]:
    md = ep.trajectories[0].metadata
    last = ep.trajectories[-1]
    return {
        "pick": label,
        "env": group.env,
        "task_id": group.task_id,
        "group_id": group.group_id,
        "actor_id": group.actor_id,
        "episode": str(md.get("episode_id", index)),
        "reward": ep.reward,
        "reward_components": dict(ep.trajectories[0].reward_components),
        "group_rewards": [float(r) for r in episode_index(group.trajectories)[0]],
        "success": ep.success,
        "finish_reason": ep.finish_reason,
        "truncated": ep.truncated,
        "policy_versions": ep.versions,
        "num_turns": ep.sums["num_turns"],
        "num_tool_calls": ep.sums["num_tool_calls"],
        "num_tool_errors": ep.sums["num_tool_errors"],
        "response_tokens": ep.model_tokens,
        "num_sequences": len(ep.trajectories),
        "reward_error": md.get("reward_error"),
        # the last sequence: for an agent episode, its final conversation
        "messages": _messages(last, decode),
    }


def _cut(text: str) -> str:
    if len(text) <= MAX_TEXT_CHARS:
        return text
    return text[:MAX_TEXT_CHARS] + f" ... [{len(text) - MAX_TEXT_CHARS} more characters]"


def _messages(t: Trajectory, decode: Callable[[list[int]], str] | None) -> list[dict[str, Any]]:
    """The conversation as the actor kept it, or the tokens as alternating ``context`` (prompt,
    tool results: not trained on) and ``model`` (generated) segments."""
    kept = t.metadata.get("messages")
    if isinstance(kept, list) and kept:
        out = []
        for m in kept:
            if isinstance(m, dict):
                m = dict(m)
                if isinstance(m.get("content"), str):
                    m["content"] = _cut(m["content"])
                out.append(m)
        return out
    segments = []
    mask = t.loss_mask.astype(bool)
    bounds = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    for lo, hi in zip([0, *bounds], [*bounds, len(mask)]):
        ids = [int(x) for x in t.tokens[lo:hi]]
        text = decode(ids) if decode is not None else " ".join(map(str, ids))
        segments.append({"role": "model" if mask[lo] else "context", "content": _cut(text)})
    return segments
