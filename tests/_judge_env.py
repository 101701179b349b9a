"""A judged calculator env that the tests' tiny judge can answer (tests/test_judge.py).

A ~1M-parameter model cannot grade free text, but the quickstart's warm start finishes a calculator
conversation: shown the correct call and the tool's result, it replies "The answer is N.". So the
judge here is that model, frozen, asked to finish the correct transcript of the task, and the
``judged`` component is whether its number equals the policy's final answer. ``strict`` asks for a
verdict form the judge never writes ("Verdict: yes" or "Verdict: no"): every call is malformed.
"""

from __future__ import annotations

import re
from typing import Any

from agentrl.envs.base import Message, Task
from agentrl.envs.judged import JudgedCalculatorEnv
from agentrl.envs.rewards import final_assistant_text, last_number
from agentrl.judging import Prompt


class ReferenceJudgedEnv(JudgedCalculatorEnv):
    name = "reference-judged"

    def __init__(self, strict: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.strict = strict

    def judge_prompt(self, task: Task, messages: list[Message]) -> Prompt:
        call = {
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": task.data["expression"]}},
        }
        return [
            *self.initial_messages(task),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": task.data["answer"]},
        ]

    def verdict(self, task: Task, messages: list[Message], text: str) -> float:
        if self.strict and not re.fullmatch(r"Verdict: (yes|no)", text.strip()):
            raise ValueError("no 'Verdict: yes|no'")
        judged = last_number(text)
        if judged is None:
            raise ValueError("no number in the judge's reply")
        return 1.0 if judged == last_number(final_assistant_text(messages) or "") else 0.0
