"""Greedy evaluation: one episode per task, rates over the episodes that completed (docs/episode.md).

:func:`evaluate` plays one episode per task (:func:`agentrl.episode.rollout.run_episode`, or an
:class:`agentrl.envs.agent.AgentEnv` through an agent runner) and reports ``success_rate`` and
``reward_mean`` over the episodes that completed. :func:`combine_evaluations` merges several envs'
results; :func:`describe_problems` says in words what went wrong without failing an episode.

Invariants: a failed episode (no trajectory) is counted in ``n_failed`` and left out of the rates, so
an outage does not read as a bad policy; what silently lowers the rates (aborted episodes, rewards
that raised, tool faults) is counted under ``problems`` with each kind's first three messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from agentrl.envs.base import Env, Task
from agentrl.episode.rollout import run_episode, toolbox_for
from agentrl.episode.turn import EngineClientLike, EpisodeFailed, EpisodeLimits
from agentrl.tools.base import ToolBox


async def evaluate(
    client: EngineClientLike,
    tokenizer: Any,
    env: Env,
    tasks: list[Task],
    greedy: bool = True,
    concurrency: int = 64,
    *,
    toolbox: ToolBox | None = None,
    limits: EpisodeLimits | None = None,
    sampling: dict[str, Any] | None = None,
    agents: Any = None,
) -> dict[str, Any]:
    """Play one episode per task and report ``success_rate`` and ``reward_mean`` over the episodes
    that completed (``n``); episodes that failed (engine unreachable...) are counted in ``n_failed``
    and left out of the rates, so an outage does not read as a bad policy. An
    :class:`agentrl.agents.AgentEnv` is played by its agent through ``agents`` (an entered
    :class:`agentrl.agents.agent_runner.AgentRunner` that samples as the evaluation asks); its finish
    reason is the limit it reached, else its last call's.

    What went wrong without failing an episode is counted too, because it silently lowers the
    rates: episodes the engine ``aborted`` (they score like a wrong answer), episodes whose
    reward raised (scored 0) and tool calls that crashed or timed out. ``problems`` holds each
    kind's count and first messages; :func:`describe_problems` says it in words.
    """
    from agentrl.envs.agent import AgentEnv

    if isinstance(env, AgentEnv) and agents is None:
        raise ValueError(f"{type(env).__name__} is an AgentEnv: evaluating it needs an AgentRunner (agents=...)")
    toolbox = toolbox or toolbox_for(env)
    limits = limits or EpisodeLimits()
    sampling = dict(sampling or {})
    if greedy:
        sampling["temperature"] = 0.0
    limiter = trio.CapacityLimiter(max(1, concurrency))
    rewards: list[float] = []
    successes: list[bool] = []
    finish: dict[str, int] = {}
    problems = {kind: _Problem() for kind in PROBLEM_KINDS}
    by_group: dict[str, list[bool]] = {}

    async def play(task: Task) -> tuple[float, dict[str, Any]]:
        if isinstance(env, AgentEnv):
            sequences = await agents.play(env, task, limits=limits)
            meta = dict(sequences[-1].metadata)
            meta["finish_reason"] = meta.get("episode_limit") or meta.get("finish_reason", "?")
            return sequences[0].reward, meta
        traj = await run_episode(client, tokenizer, env, toolbox, task, sampling, limits, versioned=False)
        return traj.reward, traj.metadata

    async def one(task: Task) -> None:
        async with limiter:
            try:
                reward, meta = await play(task)
            except EpisodeFailed as e:
                problems["failed"].add(str(e))
                return
        rewards.append(reward)
        successes.append(bool(env.is_success(task, reward)))
        group = env.eval_group(task)
        if group is not None:
            by_group.setdefault(group, []).append(successes[-1])
        finish[meta["finish_reason"]] = finish.get(meta["finish_reason"], 0) + 1
        if meta["finish_reason"] == "aborted":
            problems["aborted"].add(meta.get("abort_message") or "aborted by the engine")
        if meta.get("reward_error"):
            problems["reward_errors"].add(meta["reward_error"])
        for message in meta.get("tool_fault_messages", []):
            problems["tool_faults"].add(message)
        problems["tool_faults"].count += max(
            0, meta.get("num_tool_faults", 0) - len(meta.get("tool_fault_messages", []))
        )

    async with trio.open_nursery() as nursery:
        for task in tasks:
            nursery.start_soon(one, task)
    n = len(rewards)
    return {
        "n": n,
        "n_failed": problems["failed"].count,
        "n_aborted": problems["aborted"].count,
        "n_reward_errors": problems["reward_errors"].count,
        "n_tool_faults": problems["tool_faults"].count,
        "success_rate": sum(successes) / n if n else 0.0,
        "reward_mean": sum(rewards) / n if n else 0.0,
        "success_by_group": {g: sum(v) / len(v) for g, v in sorted(by_group.items())},
        "finish_reasons": finish,
        "errors": problems["failed"].first,
        "problems": {kind: p.as_dict() for kind, p in problems.items() if p.count},
    }


def combine_evaluations(by_env: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One evaluation of several envs: counts summed, rates over all their episodes (each env's
    result under ``by_env``). ``success_by_group`` keeps one env's labels as they are and prefixes
    them with the env's name when there are several."""
    n = sum(r["n"] for r in by_env.values())
    out: dict[str, Any] = {
        key: sum(r[key] for r in by_env.values())
        for key in ("n", "n_failed", "n_aborted", "n_reward_errors", "n_tool_faults")
    }
    out["success_rate"] = sum(r["success_rate"] * r["n"] for r in by_env.values()) / n if n else 0.0
    out["reward_mean"] = sum(r["reward_mean"] * r["n"] for r in by_env.values()) / n if n else 0.0
    several = len(by_env) > 1
    out["success_by_group"] = {
        (f"{env}/{g}" if several else g): rate for env, r in by_env.items() for g, rate in r["success_by_group"].items()
    }
    finish: dict[str, int] = {}
    problems: dict[str, _Problem] = {}
    for r in by_env.values():
        for reason, count in r["finish_reasons"].items():
            finish[reason] = finish.get(reason, 0) + count
        for kind, p in r["problems"].items():
            merged = problems.setdefault(kind, _Problem())
            merged.count += p["count"]
            merged.first += [m for m in p["first"] if m not in merged.first][: 3 - len(merged.first)]
    out["finish_reasons"] = finish
    out["errors"] = problems["failed"].first if "failed" in problems else []
    out["problems"] = {kind: p.as_dict() for kind, p in problems.items()}
    out["by_env"] = by_env
    return out


# what an evaluation counts besides success, and how it is said in words
PROBLEM_KINDS = {
    "failed": "episodes failed (no trajectory; left out of the rates)",
    "aborted": "episodes were aborted by the engine (scored as played)",
    "reward_errors": "episodes' rewards raised (scored 0)",
    "tool_faults": "tool calls crashed or timed out (to answer with an error on purpose, a tool raises ToolError)",
}


@dataclass
class _Problem:
    count: int = 0
    first: list[str] = field(default_factory=list)

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.first) < 3 and message not in self.first:
            self.first.append(message)

    def as_dict(self) -> dict[str, Any]:
        return {"count": self.count, "first": self.first}


def describe_problems(result: dict[str, Any]) -> list[str]:
    """One plain line per kind of problem an evaluation met (none when it met none)."""
    total = result.get("n", 0) + result.get("n_failed", 0)
    lines = []
    for kind, words in PROBLEM_KINDS.items():
        problem = (result.get("problems") or {}).get(kind)
        if problem:
            of = f" of {total}" if kind != "tool_faults" else ""
            lines.append(f"{problem['count']}{of} {words}; first: {' | '.join(problem['first'])}")
    return lines
