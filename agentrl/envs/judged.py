"""An env whose reward has a component judged by a model: the calculator, plus a judge's grade.

:class:`JudgedCalculatorEnv` is :class:`agentrl.envs.calculator.CalculatorEnv` with one more reward
component, ``judged``: the judge model of ``[judge]`` (given to the env as ``self.judge`` by the actor
and the evaluation) grades the final answer, and its grade, parsed and scaled into [0, 1], is weighted
by ``judge_weight``. ``correct`` stays the calculator's own check, so with ``judge_weight < 1`` an
episode still succeeds exactly when it is right.

The prompt and the parsing are the env's: :meth:`judge_prompt` fills ``judge_template`` (``{question}``
and ``{reply}``) into one user message, and :meth:`verdict` reads the first number of the reply
divided by ``verdict_scale`` (a grade outside [0, 1] is no verdict). Override either for another
judge. A judge that times out, fails or replies with no verdict raises
:class:`agentrl.judging.JudgeError`, which agentrl counts as a reward error (the episode scores 0).
An episode without a final answer scores ``judged`` 0 without asking. See docs/run.md, "Rewards
judged by a model".
"""

from __future__ import annotations

from typing import Any

from agentrl.envs.base import Message, Task
from agentrl.envs.calculator import CalculatorEnv
from agentrl.envs.rewards import final_assistant_text
from agentrl.judging import Judge, Prompt, first_number

JUDGE_TEMPLATE = (
    "Grade the reply to an arithmetic question.\nQuestion: {question}\nReply: {reply}\n"
    "Does the reply end with one clear final number? Answer with a grade from 0 to 10 and nothing else."
)


class JudgedCalculatorEnv(CalculatorEnv):
    name = "calculator-judged"
    judge: Judge | None = None  # set by agentrl before the first episode (agentrl.judging.give_judge)

    def __init__(
        self,
        judge_weight: float = 0.5,
        judge_template: str = JUDGE_TEMPLATE,
        verdict_scale: float = 10.0,
        judge_max_new_tokens: int | None = None,
        judge_timeout_s: float | None = None,
        **calculator: Any,
    ):
        super().__init__(**calculator)
        if not 0.0 <= judge_weight < 1.0:
            raise ValueError(f"judge_weight must be in [0, 1) (success stays 'correct'), got {judge_weight}")
        if verdict_scale <= 0:
            raise ValueError(f"verdict_scale must be > 0, got {verdict_scale}")
        self.judge_weight, self.judge_template, self.verdict_scale = judge_weight, judge_template, verdict_scale
        self.judge_max_new_tokens, self.judge_timeout_s = judge_max_new_tokens, judge_timeout_s

    async def reward(self, task: Task, state: dict[str, Any], messages: list[Message]) -> dict[str, float]:
        out = self.score(task, messages)
        if final_assistant_text(messages) is None:
            out["judged"] = 0.0
            return out
        if self.judge is None:
            raise RuntimeError(f"{type(self).__name__} has no judge: set judge.model_path in the config")
        verdict = await self.judge.judge(
            self.judge_prompt(task, messages),
            parse=lambda text: self.verdict(task, messages, text),
            max_new_tokens=self.judge_max_new_tokens,
            timeout_s=self.judge_timeout_s,
        )
        out["judged"] = self.judge_weight * verdict.score
        return out

    def judge_prompt(self, task: Task, messages: list[Message]) -> Prompt:
        """What the judge is asked: ``judge_template`` with the question and the final answer."""
        reply = final_assistant_text(messages) or ""
        return [{"role": "user", "content": self.judge_template.format(question=task.data["question"], reply=reply)}]

    def verdict(self, task: Task, messages: list[Message], text: str) -> float:
        """The judge's reply as a grade in [0, 1]: its first number over ``verdict_scale``; ValueError otherwise."""
        grade = first_number(text) / self.verdict_scale
        if not 0.0 <= grade <= 1.0:
            raise ValueError(f"grade {grade * self.verdict_scale:g} is outside 0..{self.verdict_scale:g}")
        return grade
