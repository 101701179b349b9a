"""The quickstart environment: arithmetic questions answered with a ``calculator`` tool.

Made so that a ~1M-parameter model learns it from scratch in minutes on a CPU: short prompts
(about 120 tokens per correct episode) and one obvious policy (copy the expression into the tool,
answer "The answer is N."). Knobs: ``min_ops``/``max_ops``, ``max_operand``, ``ops`` (division off
by default; with ``/`` only whole-number values), ``word_problem_rate``. Demonstrations cover up to
``demo_max_ops`` operators and take a shortcut on a ``demo_shortcut_rate`` fraction, so RL has
something left to learn that imitation cannot give.

Splits: ``train`` is an infinite stream; ``test`` is a fixed set of ``num_test_tasks`` questions
chosen by the SHA-1 of their text, which the train stream skips, so the splits never share a
question. Reward ``{"correct": ...}`` on the last number of the final answer, plus an optional
``format`` component (``format_weight``). See docs/envs.md.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from typing import Any

from agentrl.envs.base import Env, Message, Task, split_bucket
from agentrl.envs.rewards import final_assistant_text, last_number
from agentrl.tools.base import Tool
from agentrl.tools.calculator import CalculatorTool, evaluate, format_number

SYSTEM_PROMPT = "Use the calculator, then answer with the number."

_NAMES = ["Ann", "Ben", "Cal", "Dee", "Eli", "Fay", "Gus", "Ivy", "Jon", "Kim"]
_ITEMS = ["apples", "books", "coins", "cards", "pens", "shells", "stamps", "toys"]


class CalculatorEnv(Env):
    name = "calculator"

    def __init__(
        self,
        min_ops: int = 1,
        max_ops: int = 3,
        max_operand: int = 50,
        demo_max_ops: int = 2,
        ops: str = "+-*",
        demo_shortcut_rate: float = 0.0,
        word_problem_rate: float = 0.0,
        num_test_tasks: int = 200,
        test_fraction: float = 0.1,
        format_weight: float = 0.0,
        system_prompt: str = SYSTEM_PROMPT,
    ):
        if not 1 <= min_ops <= max_ops:
            raise ValueError(f"need 1 <= min_ops <= max_ops, got min_ops={min_ops}, max_ops={max_ops}")
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        bad = set(ops) - set("+-*/")
        if not ops or bad:
            raise ValueError(f"ops must be a non-empty string of + - * /, got {ops!r}")
        if not 0.0 <= word_problem_rate <= 1.0:
            raise ValueError(f"word_problem_rate must be in [0, 1], got {word_problem_rate}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.min_ops, self.max_ops, self.max_operand = min_ops, max_ops, max_operand
        self.demo_max_ops = demo_max_ops
        self.ops = ops
        if not 0.0 <= demo_shortcut_rate <= 1.0:
            raise ValueError(f"demo_shortcut_rate must be in [0, 1], got {demo_shortcut_rate}")
        self.demo_shortcut_rate = demo_shortcut_rate
        self.word_problem_rate = word_problem_rate
        self.num_test_tasks = num_test_tasks
        self.test_fraction = test_fraction
        self.format_weight = format_weight
        self.system_prompt = system_prompt

    # ------------------------------------------------------------------ tasks

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        if split == "train":
            return self._stream(random.Random(f"calculator-train-{seed}"), test=False)
        if split == "test":
            return self._test_set()
        raise ValueError(f"calculator env has splits 'train' and 'test', not {split!r}")

    def _test_set(self) -> Iterator[Task]:
        seen: set[str] = set()
        for task in self._stream(random.Random("calculator-test"), test=True):
            if task.id in seen:
                continue
            seen.add(task.id)
            yield task
            if len(seen) >= self.num_test_tasks:
                return

    def _stream(self, rng: random.Random, test: bool) -> Iterator[Task]:
        misses = 0
        while True:
            task = self.sample_task(rng)
            if (split_bucket(task.data["question"]) < self.test_fraction) == test:
                misses = 0
                yield task
            else:
                misses += 1
                if misses > 100_000:
                    raise ValueError(
                        "the calculator task space is too small for a train/test split; raise max_operand or max_ops"
                    )

    def sample_task(self, rng: random.Random) -> Task:
        """One random question (split membership is decided by the caller)."""
        if self.word_problem_rate and rng.random() < self.word_problem_rate:
            question, expression = self._word_problem(rng)
        else:
            expression = self._expression(rng)
            question = f"What is {expression}?"
        value = evaluate(expression)
        task_id = "calc-" + hashlib.sha1(question.encode()).hexdigest()[:12]
        return Task(
            id=task_id,
            data={
                "question": question,
                "expression": expression,
                "answer": format_number(value),
                "num_ops": sum(expression.count(f" {op} ") for op in "+-*/"),
            },
        )

    def _expression(self, rng: random.Random) -> str:
        for _ in range(1000):
            n = rng.randint(self.min_ops, self.max_ops)
            parts = [str(rng.randint(0, self.max_operand))]
            for _ in range(n):
                parts += [rng.choice(self.ops), str(rng.randint(0, self.max_operand))]
            expression = " ".join(parts)
            try:
                if evaluate(expression).denominator == 1:
                    return expression
            except ValueError:  # division by zero
                continue
        raise ValueError("could not generate a whole-number question; allow more operators than '/'")

    def _word_problem(self, rng: random.Random) -> tuple[str, str]:
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b = rng.randint(1, self.max_operand), rng.randint(1, self.max_operand)
        kind = rng.choice([op for op in self.ops if op != "/"] or ["+"])
        if kind == "+":
            return f"{name} has {a} {item} and gets {b} more. How many {item} now?", f"{a} + {b}"
        if kind == "-":
            a, b = max(a, b), min(a, b)
            return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", f"{a} - {b}"
        return f"{name} buys {a} boxes of {b} {item}. How many {item} in all?", f"{a} * {b}"

    # --------------------------------------------------------------- episode

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": task.data["question"]}]

    def tools(self) -> list[Tool]:
        return [CalculatorTool()]

    async def reward(self, task: Task, state: dict[str, Any], messages: list[Message]) -> dict[str, float]:
        return self.score(task, messages)

    def score(self, task: Task, messages: list[Message]) -> dict[str, float]:
        """The reward components (synchronous, for evaluation scripts)."""
        text = final_assistant_text(messages)
        value = last_number(text) if text is not None else None
        correct = value is not None and format_number(value) == task.data["answer"]
        out = {"correct": 1.0 if correct else 0.0}
        if self.format_weight:
            well_formed = text is not None and text.strip() == f"The answer is {task.data['answer']}."
            out["format"] = self.format_weight if well_formed else 0.0
        return out

    def is_success(self, task: Task, reward: float) -> bool:
        return reward >= 1.0

    def eval_group(self, task: Task) -> str:
        return f"{task.data['num_ops']} ops"

    def demonstration(self, task: Task) -> list[Message] | None:
        """The demonstrator's episode; None for questions with more than ``demo_max_ops`` operators.

        The demonstrator is sloppy on a fixed ``demo_shortcut_rate`` fraction of multi-operator
        questions: it sends only the first operation ("37 + 48" of "37 + 48 * 2") to the
        calculator and answers with that result, which is wrong. Imitation learns the sloppiness
        as it is; only the reward tells the policy that the whole expression is needed.
        """
        if task.data["num_ops"] > self.demo_max_ops:
            return None
        expression = task.data["expression"]
        if task.data["num_ops"] > 1 and split_bucket("shortcut " + task.id) < self.demo_shortcut_rate:
            expression = " ".join(expression.split()[:3])
        result = format_number(evaluate(expression))
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        return [
            *self.initial_messages(task),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": result},
            {"role": "assistant", "content": f"The answer is {result}."},
        ]
