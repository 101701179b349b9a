"""The judge interface: what an env's reward awaits to have a model judge an episode.

Declared here, in the core, so that both sides import it and neither imports the other: an env
(:mod:`agentrl.envs`) declares ``judge: Judge | None = None`` and awaits
``await self.judge.judge(prompt, parse=...)`` in its ``reward``; the implementation,
:class:`agentrl.engine.judge.EngineJudge`, sends the prompt to the judge engines of ``[judge]``. The
actor process and the evaluation build one judge per process and give it to every env that declares
the attribute (:func:`give_judge`).

A judgment that cannot be had -- the time limit passed, the engines failed, the reply is no verdict
-- raises :class:`JudgeError`. Inside ``Env.reward`` that is a reward error (the episode scores 0,
is kept, and is counted in the actor's metrics, the live table and the evaluation), never a crash.
:class:`JudgeStats` counts calls, verdicts, failures by kind, batches and latency.
See docs/run.md, "Rewards judged by a model".
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

Prompt = str | list[dict[str, Any]]  # text, tokenised as it is, or chat messages (the judge's chat template)
Parse = Callable[[str], float]  # the judge's reply -> the score; raising means "no verdict"

FAILURE_KINDS = ("timeout", "engine", "malformed", "prompt")


class JudgeError(RuntimeError):
    """No judgment: ``kind`` is ``timeout`` (the call's time limit passed), ``engine`` (the judge
    engines failed or refused), ``malformed`` (the reply is no verdict) or ``prompt`` (too long)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Verdict:
    """One judgment: the parsed ``score``, the judge's reply ``text``, the ``weight_version`` of
    the judge engine that answered and the call's latency (queueing included)."""

    score: float
    text: str
    weight_version: str
    latency_s: float


@dataclass
class JudgeStats:
    """What one process's judge did (counters only grow)."""

    calls: int = 0
    verdicts: int = 0
    failures: Counter = field(default_factory=Counter)  # by JudgeError kind
    unfinished: int = 0  # calls cancelled with their episode (calls = verdicts + failures + unfinished)
    batches: int = 0  # /generate requests sent
    batched_calls: int = 0  # calls in them
    batch_max: int = 0
    in_flight: int = 0
    in_flight_max: int = 0
    latency_sum_s: float = 0.0  # of verdicts
    latency_max_s: float = 0.0
    weight_versions: Counter = field(default_factory=Counter)  # of the engines that answered

    def verdict(self, latency_s: float, weight_version: str) -> None:
        self.verdicts += 1
        self.latency_sum_s += latency_s
        self.latency_max_s = max(self.latency_max_s, latency_s)
        self.weight_versions[weight_version] += 1

    def batch(self, size: int) -> None:
        self.batches += 1
        self.batched_calls += size
        self.batch_max = max(self.batch_max, size)

    def summary(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "verdicts": self.verdicts,
            "failures": sum(self.failures.values()),
            "failures_by_kind": dict(self.failures),
            "unfinished": self.unfinished,
            "batches": self.batches,
            "batch_mean": self.batched_calls / self.batches if self.batches else 0.0,
            "batch_max": self.batch_max,
            "in_flight_max": self.in_flight_max,
            "latency_mean_s": self.latency_sum_s / self.verdicts if self.verdicts else 0.0,
            "latency_max_s": self.latency_max_s,
            "weight_versions": dict(self.weight_versions),
        }


class Judge(Protocol):
    """A judge model, as an env's reward sees it."""

    stats: JudgeStats

    async def judge(
        self,
        prompt: Prompt,
        *,
        parse: Parse | None = None,
        max_new_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> Verdict:
        """The judge's verdict on ``prompt``: its reply parsed by ``parse`` (default :func:`first_number`).
        ``max_new_tokens`` and ``timeout_s`` may only tighten the ``[judge]`` settings. Raises
        :class:`JudgeError`."""
        ...

    async def score(
        self,
        prompt: Prompt,
        *,
        parse: Parse | None = None,
        max_new_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> float:
        """``(await judge(...)).score``."""
        ...


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def first_number(text: str) -> float:
    """The first number in ``text`` (the default verdict: "Score: 7" is 7.0); ValueError when there is none."""
    match = _NUMBER.search(text)
    if match is None:
        raise ValueError("no number in the reply")
    return float(match.group())


def wants_judge(env: object) -> bool:
    """Whether an env declares a ``judge`` attribute (and so is given the process's judge)."""
    return hasattr(env, "judge")


def give_judge(envs: Iterable[object], judge: Judge | None) -> list[str]:
    """Set ``judge`` on every env that declares the attribute; return their names. Without a judge,
    an env that declares one is a ValueError naming it (it could only score reward errors)."""
    wanting = [env for env in envs if wants_judge(env)]
    names = [str(getattr(env, "name", type(env).__name__)) for env in wanting]
    if wanting and judge is None:
        raise ValueError(
            f"env(s) {', '.join(names)} score with a judge model, but the config has none: set "
            "judge.model_path (docs/run.md, 'Rewards judged by a model')"
        )
    for env in wanting:
        setattr(env, "judge", judge)  # noqa: B010 -- an attribute the env class declares, Env does not
    return names
