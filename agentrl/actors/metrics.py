"""Per-episode metrics of one actor process, aggregated for logs and the final report.

:class:`ActorStats` sums what every trajectory carries in ``metadata`` for a periodic one-line
summary and the final report; counters only grow, ``window()`` gives the rates since the previous
call. Rewards and success count per episode (an agent episode may be several trajectories), the
rest per trajectory; ``by_env`` holds per-env totals.

Reward errors (:class:`RewardErrors`): each distinct (env, message) is logged once and then counted;
the totals go into the actor's log as JSON lines (``REWARD_ERRORS_MARKER``, under an id of this
process) that ``agentrl run`` reads, keeping the last line per id. Messages past
``MAX_REWARD_ERROR_KINDS`` per env count as one kind. See docs/actors.md.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from agentrl.protocol import TrajectoryGroup

log = logging.getLogger("agentrl.actors")

REWARD_ERRORS_MARKER = "reward errors so far: "  # then one JSON object (parse_reward_errors)
REWARD_ERRORS_EVERY_S = 10.0
MAX_REWARD_ERROR_KINDS = 20  # distinct messages per env; later ones count as OTHER_REWARD_ERRORS
MAX_REWARD_ERROR_CHARS = 300
OTHER_REWARD_ERRORS = f"(other messages, past the first {MAX_REWARD_ERROR_KINDS})"


@dataclass
class RewardErrors:
    """Reward errors of one actor process per (env, message), logged once each (module docstring)."""

    counts: Counter = field(default_factory=Counter)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    _written_at: float = 0.0
    _written: int = -1  # the total of the last line written

    def add(self, env: str, error: str) -> None:
        error = error[:MAX_REWARD_ERROR_CHARS]
        if (env, error) not in self.counts:
            if sum(1 for e, _ in self.counts if e == env) >= MAX_REWARD_ERROR_KINDS:
                error = OTHER_REWARD_ERRORS
            else:
                log.warning("reward error in env %s (first of its kind, counted from now on): %s", env, error)
                self._written_at = 0.0  # a new message goes out at once
        self.counts[(env, error)] += 1
        self.write()

    def total(self) -> int:
        return sum(self.counts.values())

    def as_list(self) -> list[dict[str, Any]]:
        """``[{env, error, count}]``, the most frequent first."""
        return [{"env": env, "error": error, "count": n} for (env, error), n in self.counts.most_common()]

    def write(self, force: bool = False) -> None:
        """The totals as one marked log line, when they changed and it is time (or ``force``)."""
        now = time.monotonic()
        if self.total() == self._written or not (force or now - self._written_at >= REWARD_ERRORS_EVERY_S):
            return
        self._written_at, self._written = now, self.total()
        log.info("%s%s", REWARD_ERRORS_MARKER, json.dumps({"id": self.id, "errors": self.as_list()}))


def parse_reward_errors(line: str) -> dict[str, Any] | None:
    """A line written by :meth:`RewardErrors.write` as ``{"id", "errors": [{env, error, count}]}``,
    else None (any other line, or one cut short)."""
    _, marker, rest = line.rpartition(REWARD_ERRORS_MARKER)  # the last: a killed process's line may precede it
    if not marker:
        return None
    try:
        data = json.loads(rest)
        errors = [{"env": str(e["env"]), "error": str(e["error"]), "count": int(e["count"])} for e in data["errors"]]
        return {"id": str(data["id"]), "errors": errors}
    except (ValueError, KeyError, TypeError):
        return None


_SUMMED = (
    "num_turns",
    "num_tool_calls",
    "num_tool_errors",
    "num_aborts",
    "num_generate_calls",
    "tool_latency_s",
    "tool_wall_s",
    "generation_latency_s",
    "episode_wall_s",
    "num_model_tokens",
)


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
        return {
            "groups_started": self.groups_started,
            "groups_completed": self.groups_completed,
            "groups_lost": self.groups_lost,
            "episodes": self.episodes,
            "reward_mean": self.reward_sum / n,
            "success_rate": self.successes / n,
        }


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
    reward_error_kinds: RewardErrors = field(default_factory=RewardErrors)
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
                if "reward_error" in md:
                    self.reward_errors += 1
                    self.reward_error_kinds.add(group.env, str(md["reward_error"]))
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
        """The totals (the actor's periodic log line and its final report); also writes the reward
        errors' line when they changed since the last one."""
        self.reward_error_kinds.write(force=True)
        n = max(1, self.episodes)
        elapsed = max(1e-9, time.monotonic() - self.started_at)
        turns = self.sums["num_turns"]
        calls = max(1, self.sums["num_tool_calls"])
        gens = max(1, self.sums["num_generate_calls"])
        return {
            "elapsed_s": round(elapsed, 3),
            "groups_started": self.groups_started,
            "groups_completed": self.groups_completed,
            "groups_delivered": self.groups_delivered,
            "groups_lost": self.groups_lost,
            "groups_abandoned": self.groups_abandoned,
            "episodes": self.episodes,
            "episodes_abandoned": self.episodes_abandoned,
            "turns_per_s": turns / elapsed,
            "episodes_per_s": self.episodes / elapsed,
            "reward_mean": self.reward_sum / n,
            "reward_errors": self.reward_errors,
            "reward_error_kinds": self.reward_error_kinds.as_list(),
            "turns_mean": turns / n,
            "tool_calls_mean": self.sums["num_tool_calls"] / n,
            "tool_errors_mean": self.sums["num_tool_errors"] / n,
            "tool_error_rate": self.sums["num_tool_errors"] / calls,
            "tool_latency_mean_s": self.sums["tool_latency_s"] / calls,
            "generation_latency_mean_s": self.sums["generation_latency_s"] / gens,
            "episode_wall_mean_s": self.sums["episode_wall_s"] / n,
            "aborts_survived": self.sums["num_aborts"],
            "tokens_mean": self.tokens / n,
            "model_tokens_mean": self.sums["num_model_tokens"] / n,
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
