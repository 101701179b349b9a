"""Per-episode metrics of one actor process, aggregated for logs and the final report.

Every trajectory carries its own numbers in ``metadata`` (turns, tool calls and errors,
latencies, finish reason, aborts survived); :class:`ActorStats` sums them so that the actor can
print a one-line summary every few seconds and a report when it stops. Counters only grow;
``window()`` gives the rates since the previous call.

Episodes are counted as episodes, not trajectories: an agent episode may be several sequences
(:mod:`agentrl.agents.episodes`), each a trajectory with the episode's ``episode_id``. Rewards
and success are per episode; tokens and the summed per-trajectory numbers (turns, latencies,
finish reasons) are over trajectories. ``by_env`` holds groups, episodes, reward and success
per env name.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from agentrl.protocol import TrajectoryGroup

_SUMMED = ("num_turns", "num_tool_calls", "num_tool_errors", "num_aborts", "num_generate_calls",
           "tool_latency_s", "tool_wall_s", "generation_latency_s", "episode_wall_s", "num_model_tokens")


@dataclass
class EnvStats:
    """One env's share of an actor's work."""

    groups_started: int = 0
    groups_completed: int = 0
    groups_lost: int = 0
    episodes: int = 0
    reward_sum: float = 0.0
    successes: int = 0

    def summary(self) -> dict[str, Any]:
        n = max(1, self.episodes)
        return {"groups_started": self.groups_started, "groups_completed": self.groups_completed,
                "groups_lost": self.groups_lost, "episodes": self.episodes, "reward_mean": self.reward_sum / n,
                "success_rate": self.successes / n}


@dataclass
class ActorStats:
    started_at: float = field(default_factory=time.monotonic)
    groups_started: int = 0
    groups_completed: int = 0
    groups_delivered: int = 0  # sent to the learner and/or written to the dump
    groups_lost: int = 0
    groups_abandoned: int = 0
    episodes: int = 0
    episodes_abandoned: int = 0
    tokens: int = 0
    reward_sum: float = 0.0
    reward_errors: int = 0
    sums: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    lost_reasons: Counter = field(default_factory=Counter)
    by_env: dict[str, EnvStats] = field(default_factory=dict)
    _window_at: float = field(default_factory=time.monotonic)
    _window_turns: float = 0.0
    _window_groups: int = 0

    def env(self, name: str) -> EnvStats:
        return self.by_env.setdefault(name, EnvStats())

    def add_group(self, group: TrajectoryGroup) -> None:
        self.groups_completed += 1
        per_env = self.env(group.env)
        per_env.groups_completed += 1
        seen: set[Any] = set()
        for k, t in enumerate(group.trajectories):
            self.tokens += t.num_tokens
            md = t.metadata
            episode = md.get("episode_id", ("trajectory", k))
            if episode not in seen:  # the first sequence of an episode stands for it
                seen.add(episode)
                self.episodes += 1
                self.reward_sum += t.reward
                self.reward_errors += int("reward_error" in md)
                per_env.episodes += 1
                per_env.reward_sum += t.reward
                per_env.successes += int(md.get("success") is True)
            self.finish_reasons[md.get("finish_reason", "?")] += 1
            for key in _SUMMED:
                self.sums[key] += md.get(key, 0)

    def add_lost(self, reason: str, env: str = "") -> None:
        self.groups_lost += 1
        self.lost_reasons[reason[:120]] += 1
        if env:
            self.env(env).groups_lost += 1

    def summary(self) -> dict[str, Any]:
        n = max(1, self.episodes)
        elapsed = max(1e-9, time.monotonic() - self.started_at)
        turns = self.sums["num_turns"]
        calls = max(1, self.sums["num_tool_calls"])
        gens = max(1, self.sums["num_generate_calls"])
        return {
            "elapsed_s": round(elapsed, 3),
            "groups_started": self.groups_started, "groups_completed": self.groups_completed,
            "groups_delivered": self.groups_delivered, "groups_lost": self.groups_lost,
            "groups_abandoned": self.groups_abandoned,
            "episodes": self.episodes, "episodes_abandoned": self.episodes_abandoned,
            "turns_per_s": turns / elapsed, "episodes_per_s": self.episodes / elapsed,
            "reward_mean": self.reward_sum / n, "reward_errors": self.reward_errors,
            "turns_mean": turns / n,
            "tool_calls_mean": self.sums["num_tool_calls"] / n,
            "tool_errors_mean": self.sums["num_tool_errors"] / n,
            "tool_error_rate": self.sums["num_tool_errors"] / calls,
            "tool_latency_mean_s": self.sums["tool_latency_s"] / calls,
            "generation_latency_mean_s": self.sums["generation_latency_s"] / gens,
            "episode_wall_mean_s": self.sums["episode_wall_s"] / n,
            "aborts_survived": self.sums["num_aborts"],
            "tokens_mean": self.tokens / n, "model_tokens_mean": self.sums["num_model_tokens"] / n,
            "finish_reasons": dict(self.finish_reasons),
            "lost_reasons": dict(self.lost_reasons),
            "by_env": {name: stats.summary() for name, stats in sorted(self.by_env.items())},
        }

    def window(self) -> dict[str, float]:
        """Turns/s and groups/s since the previous call."""
        now = time.monotonic()
        dt = max(1e-9, now - self._window_at)
        turns, groups = self.sums["num_turns"], self.groups_completed
        out = {"turns_per_s": (turns - self._window_turns) / dt, "groups_per_s": (groups - self._window_groups) / dt}
        self._window_at, self._window_turns, self._window_groups = now, turns, groups
        return out
