"""verifiers environments written with verifiers' own classes, for tests/test_env_verifiers.py and its
``agentrl run``: a single-turn math env with a weighted rubric and an XML parser, a multi-turn guessing game
(``env_response``, a stop condition, ``final_env_response``), a ``ToolEnv`` with Python functions, and envs
the adapter refuses. ``ScriptedClient`` plays scripted model turns inside verifiers' own rollout loop, so
that a test can compare agentrl's episode with what verifiers itself computes for the same turns."""

from __future__ import annotations

import json
import random
import re
import time
from typing import Any

import verifiers as vf
from datasets import Dataset
from verifiers.legacy.clients import Client
from verifiers.legacy.types import Response, ResponseMessage, ToolCall

MATH_SYSTEM = "Answer with the number in <answer></answer> tags."


def _sums(n: int, seed: int, max_operand: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b), "info": {"a": a, "b": b}})
    return rows


def math_env(num_train: int = 40, num_eval: int = 8, max_operand: int = 20, raising: bool = False) -> vf.Environment:
    """Single turn: "What is a + b?", answered as ``<answer>n</answer>``; reward ``correct`` (weight 1) plus
    the parser's format reward (weight 0.25). ``raising`` adds a reward function that raises on odd sums."""
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct(completion, answer, parser) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    funcs: list[Any] = [correct, parser.get_format_reward_func()]
    weights = [1.0, 0.25]
    if raising:

        def even_only(answer) -> float:
            if int(answer) % 2:
                raise ZeroDivisionError("odd sums are not scored")
            return 0.0

        funcs.append(even_only)
        weights.append(1.0)
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(_sums(num_train, 0, max_operand)),
        eval_dataset=Dataset.from_list(_sums(num_eval, 1, max_operand)),
        system_prompt=MATH_SYSTEM,
        parser=parser,
        rubric=vf.Rubric(funcs=funcs, weights=weights, parser=parser),
    )


class GuessEnv(vf.MultiTurnEnv):
    """Guess the number: the user says "higher" or "lower"; after ``max_guesses`` wrong guesses the env
    ends the game with a ``final_env_response``. ``chatty``: the user answers with two messages (which
    agentrl cannot take). Its cleanup handler records each episode it cleans up; its teardown, that it ran."""

    def __init__(self, max_guesses: int = 3, chatty: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.max_guesses = max_guesses
        self.chatty = chatty
        self.cleaned: list[str] = []
        self.torn_down = False

    @vf.cleanup
    async def record_cleanup(self, state: vf.State) -> None:
        self.cleaned.append(state["trajectory_id"])

    @vf.teardown
    async def record_teardown(self) -> None:
        self.torn_down = True

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        numbers = re.findall(r"-?\d+", messages[-1].content or "")
        state["guesses"] = state.get("guesses", 0) + 1
        target = int(state["answer"])
        if state["guesses"] >= self.max_guesses:
            reply = [{"role": "user", "content": f"Out of guesses: it was {target}."}]
            state["final_env_response"] = reply
            return reply
        if not numbers or self.chatty:
            return [{"role": "user", "content": "Say a number."}, {"role": "user", "content": "Just one."}]
        return [{"role": "user", "content": "Higher." if int(numbers[-1]) < target else "Lower."}]

    @vf.stop
    async def guessed(self, state: vf.State) -> bool:
        trajectory = state["trajectory"]
        return bool(trajectory) and state["answer"] in re.findall(
            r"-?\d+", trajectory[-1]["completion"][-1].content or ""
        )


def guess_env(num_rows: int = 30, max_turns: int = 5, max_guesses: int = 3, chatty: bool = False) -> vf.Environment:
    """Rows "I think of a number from 1 to 9." (one dataset: the adapter holds out a test split); reward
    ``solved`` (1) and ``speed`` (0.5 / turns), and a metric ``turns`` (weight 0)."""
    rng = random.Random(3)
    rows = [
        {"question": f"I think of a number from 1 to 9 (game {i}).", "answer": str(rng.randint(1, 9))}
        for i in range(num_rows)
    ]

    def solved(state, answer) -> float:
        last = state["trajectory"][-1]["completion"][-1].content or ""
        return 1.0 if answer in re.findall(r"-?\d+", last) else 0.0

    def speed(state) -> float:
        return 1.0 / len(state["trajectory"])

    def turns(state) -> float:
        return float(len(state["trajectory"]))

    rubric = vf.Rubric(funcs=[solved, speed, turns], weights=[1.0, 0.5, 0.0])
    return GuessEnv(
        dataset=Dataset.from_list(rows),
        system_prompt="Guess my number; say one number per turn.",
        rubric=rubric,
        max_turns=max_turns,
        max_guesses=max_guesses,
        chatty=chatty,
    )


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def constant(name: str) -> str:
    """The value of a named constant.

    Args:
        name: "answer" or "dozen".
    """
    return {"answer": "42", "dozen": "12"}[name]


def tool_env(num_rows: int = 24, max_turns: int = 4) -> vf.Environment:
    """ "What is a + b?" with the tools ``add`` and ``constant`` (which raises KeyError on an unknown name)."""
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct(completion, answer, parser) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    return vf.ToolEnv(
        tools=[add, constant],
        dataset=Dataset.from_list(_sums(num_rows, 5, 50)),
        eval_dataset=Dataset.from_list(_sums(6, 6, 50)),
        system_prompt="Use the tools, then answer in <answer></answer> tags.",
        parser=parser,
        rubric=vf.Rubric(funcs=[correct], parser=parser),
        max_turns=max_turns,
        error_formatter=lambda e: f"tool failed: {type(e).__name__}: {e}",
    )


class _Stateful(vf.StatefulToolEnv):
    def update_tool_args(self, tool_name: str, tool_args: dict, messages: Any, state: Any, **kwargs: Any) -> dict:
        return tool_args


def stateful_tool_env() -> vf.Environment:
    return _Stateful(tools=[add], dataset=Dataset.from_list(_sums(4, 0, 9)))


def group_reward_env() -> vf.Environment:
    def best_of_group(completions, answers) -> list[float]:
        return [0.0 for _ in completions]

    return vf.SingleTurnEnv(dataset=Dataset.from_list(_sums(4, 0, 9)), rubric=vf.Rubric(funcs=[best_of_group]))


def env_group() -> vf.Environment:
    return vf.EnvGroup(envs=[math_env(num_train=4), math_env(num_train=4)], env_names=["a", "b"])


def call(tool: str, **arguments: Any) -> str:
    """A Hermes tool call, as the tiny model's template and agentrl's default parser write it."""
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}) + "\n</tool_call>"


class ScriptedClient(Client):
    """verifiers' model client, answering each turn with the next scripted text; tool calls are read
    from the text as an OpenAI-compatible server's Hermes parser does (content: the text before them)."""

    def __init__(self, turns: list[str]):
        super().__init__(None)
        self.turns = list(turns)
        self.prompts: list[Any] = []

    def setup_client(self, config: Any) -> Any:
        return None

    async def to_native_tool(self, tool: Any) -> Any:
        return tool

    async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
        return messages, {}

    async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kw: Any):
        self.prompts.append(prompt)
        return self.turns.pop(0)

    async def raise_from_native_response(self, response: Any) -> None:
        return None

    async def from_native_response(self, response: Any) -> Response:
        bodies = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", response, flags=re.S)
        calls = [json.loads(b) for b in bodies]
        content = response.split("<tool_call>")[0].strip() if calls else response
        tool_calls = [
            ToolCall(id=f"c{i}", name=c["name"], arguments=json.dumps(c["arguments"])) for i, c in enumerate(calls)
        ]
        message = ResponseMessage(
            content=content,
            tool_calls=tool_calls or None,
            finish_reason="tool_calls" if calls else "stop",
            is_truncated=False,
        )
        return Response(id="scripted", created=int(time.time()), model="scripted", message=message)

    async def close(self) -> None:
        return None


def load_environment(**kwargs: Any) -> vf.Environment:
    """What ``verifiers.load_environment("tests._verifiers_envs", ...)`` calls, as an environment package's."""
    return math_env(**kwargs)
