"""A benchmark env with a heavy-tailed number of turns and heavy-tailed latency per turn.

Each task fixes how many user turns its episode has (1 + a capped Pareto draw) and each simulated
reply waits a log-normal time. The model's words do not change an episode's length, so sync and
async runs face the same latency. The reward is smooth and learnable: shorter answers score higher.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import trio

from agentrl.envs.base import Env, Message, Task


class LatencyEnv(Env):
    name = "latency"

    def __init__(
        self,
        pareto_alpha: float = 1.1,
        max_turns: int = 12,
        latency_median_s: float = 0.5,
        latency_sigma: float = 1.2,
        max_latency_s: float = 6.0,
        max_chars: int = 120,
    ):
        self.alpha, self.turn_cap = pareto_alpha, max_turns
        self.median, self.sigma, self.max_latency = latency_median_s, latency_sigma, max_latency_s
        self.max_chars = max_chars
        self.max_turns = max_turns + 1  # the episode limit the actor loop enforces

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        rng = random.Random(f"latency-{split}-{seed}")
        i = 0
        while True:
            turns = min(self.turn_cap, int(rng.paretovariate(self.alpha)))
            yield Task(id=f"{split}-{i}", data={"turns": turns, "seed": rng.random()})
            i += 1
            if split != "train" and i >= 64:
                return

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": "Say something short."}]

    async def on_text_turn(self, task: Task, state: dict[str, Any], messages: list[Message]) -> str | None:
        done = sum(1 for m in messages if m["role"] == "assistant")
        if done >= task.data["turns"]:
            return None
        rng = random.Random(f"{task.data['seed']}-{done}")
        await trio.sleep(min(self.max_latency, rng.lognormvariate(0.0, self.sigma) * self.median))
        return "Again, shorter."

    async def reward(self, task: Task, state: dict[str, Any], messages: list[Message]) -> float:
        answers = [m.get("content") or "" for m in messages if m["role"] == "assistant"]
        mean_len = sum(len(a) for a in answers) / max(1, len(answers))
        return max(0.0, 1.0 - mean_len / self.max_chars)

    def is_success(self, task: Task, reward: float) -> bool:
        return reward >= 0.5
