"""Write a small Python function that passes hidden unit tests, run in a sandbox.

Tasks come from ten parametrised families, each with a reference solution; the hidden tests are
``num_tests`` random inputs whose expected outputs come from the reference, run in this process.
The agent tries code with the ``python`` tool and ends with the function in a fenced block.

Invariant: the answer and the judgement never share an interpreter, a file or a channel.
:meth:`Sandbox.call_function` runs the answer once per test in a fresh process that returns JSON
text; the expected values never enter the sandbox, and this process compares as canonical JSON
(:func:`same_value`: ``1`` does not pass for ``True``). Whatever the answer prints, patches or
forges changes only what its own call returns.

Reward ``{"tests_passed": passed / total}``; success means all passed. Splits by the SHA-1 of the
prompt, as in the calculator env. See docs/envs.md.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

from agentrl.envs.base import Message, Task, split_bucket
from agentrl.envs.rewards import final_assistant_text
from agentrl.envs.sandboxed import SandboxedEnv
from agentrl.tools.base import Tool
from agentrl.tools.sandbox.base import ExecResult, SandboxSettings

SYSTEM_PROMPT = (
    "Write the requested Python function. You can test code with the python tool. "
    "Finish with the function in a ```python code block."
)


def _ints(rng: random.Random, n: int = 1) -> list[Any]:
    return [rng.randint(-100, 100) for _ in range(n)]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcde") for _ in range(rng.randint(1, 5)))


def _int_list(rng: random.Random) -> list[Any]:
    return [[rng.randint(-20, 20) for _ in range(rng.randint(1, 6))]]


# family: (params(rng) -> dict, prompt, function name, reference source, args(rng, params) -> list)
FAMILIES: dict[str, tuple[Callable, str, str, str, Callable]] = {
    "add_k": (
        lambda r: {"k": r.randint(1, 99)},
        "Write a function add_k(x) that returns x plus {k}.",
        "add_k",
        "def add_k(x):\n    return x + {k}",
        lambda r, p: _ints(r),
    ),
    "count_char": (
        lambda r: {"c": r.choice("abcde")},
        "Write a function count_char(s) that returns how many times the letter '{c}' occurs in s.",
        "count_char",
        "def count_char(s):\n    return s.count('{c}')",
        lambda r, p: ["".join(r.choice("abcde") for _ in range(r.randint(0, 12)))],
    ),
    "clip": (
        lambda r: (lambda lo: {"lo": lo, "hi": lo + r.randint(1, 40)})(r.randint(-30, 30)),
        "Write a function clip(x) that returns x limited to the range {lo} to {hi}.",
        "clip",
        "def clip(x):\n    return max({lo}, min({hi}, x))",
        lambda r, p: _ints(r),
    ),
    "sum_above": (
        lambda r: {"k": r.randint(-10, 10)},
        "Write a function sum_above(xs) that returns the sum of the numbers in the list xs that are greater than {k}.",
        "sum_above",
        "def sum_above(xs):\n    return sum(x for x in xs if x > {k})",
        lambda r, p: _int_list(r),
    ),
    "is_multiple": (
        lambda r: {"k": r.randint(2, 12)},
        "Write a function is_multiple(x) that returns True if x is divisible by {k}, else False.",
        "is_multiple",
        "def is_multiple(x):\n    return x % {k} == 0",
        lambda r, p: _ints(r),
    ),
    "repeat_word": (
        lambda r: {"n": r.randint(2, 5)},
        "Write a function repeat_word(w) that returns w repeated {n} times, separated by single spaces.",
        "repeat_word",
        "def repeat_word(w):\n    return ' '.join([w] * {n})",
        lambda r, p: [_word(r)],
    ),
    "reverse_words": (
        lambda r: {"sep": r.choice(["-", ",", "+", "_", "/", ":", ";", "|"])},
        "Write a function reverse_words(s) that returns the words of s in reverse order, joined by '{sep}'.",
        "reverse_words",
        "def reverse_words(s):\n    return '{sep}'.join(s.split()[::-1])",
        lambda r, p: [" ".join(_word(r) for _ in range(r.randint(1, 4)))],
    ),
    "label": (
        lambda r: {"k": r.randint(-50, 50)},
        "Write a function label(x) that returns 'big' if x is greater than {k} and 'small' otherwise.",
        "label",
        "def label(x):\n    return 'big' if x > {k} else 'small'",
        lambda r, p: _ints(r),
    ),
    "first_n": (
        lambda r: {"n": r.randint(1, 4)},
        "Write a function first_n(xs) that returns a list of the first {n} items of the list xs.",
        "first_n",
        "def first_n(xs):\n    return list(xs[:{n}])",
        lambda r, p: _int_list(r),
    ),
    "scale": (
        lambda r: {"k": r.randint(2, 9)},
        "Write a function scale(xs) that returns a new list with every number of xs multiplied by {k}.",
        "scale",
        "def scale(xs):\n    return [x * {k} for x in xs]",
        lambda r, p: _int_list(r),
    ),
}

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


def extract_code(text: str) -> str | None:
    """The last fenced code block of an answer, or the answer itself if it defines a function."""
    blocks = _FENCE.findall(text)
    if blocks:
        return blocks[-1]
    return text if "def " in text else None


def canonical_json(value: Any) -> str:
    """The one JSON text of ``value``: sorted keys, no NaN or infinity (ValueError)."""
    return json.dumps(value, sort_keys=True, allow_nan=False, separators=(",", ":"))


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def same_value(returned: str | None, expected: Any) -> bool:
    """Whether the JSON text a call returned is the expected value, type for type."""
    if returned is None:
        return False
    try:
        value = json.loads(returned, parse_constant=_no_constants)
        return canonical_json(value) == canonical_json(expected)
    except (ValueError, RecursionError):
        return False


class CodeEnv(SandboxedEnv):
    name = "code"

    def __init__(
        self,
        sandbox: dict[str, Any] | SandboxSettings | None = None,
        families: list[str] | None = None,
        num_tests: int = 6,
        num_test_tasks: int = 100,
        test_fraction: float = 0.1,
        system_prompt: str = SYSTEM_PROMPT,
    ):
        super().__init__(sandbox)
        self.families = list(families or FAMILIES)
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown:
            raise ValueError(f"unknown code task families {unknown}; choose from {', '.join(FAMILIES)}")
        if num_tests < 1:
            raise ValueError("num_tests must be >= 1")
        self.num_tests = num_tests
        self.num_test_tasks = num_test_tasks
        self.test_fraction = test_fraction
        self.system_prompt = system_prompt

    # ----------------------------------------------------------------- tasks

    def sample_task(self, rng: random.Random) -> Task:
        family = rng.choice(self.families)
        make_params, prompt_t, func, ref_t, make_args = FAMILIES[family]
        params = make_params(rng)
        prompt, reference = prompt_t.format(**params), ref_t.format(**params)
        namespace: dict[str, Any] = {}
        exec(reference, namespace)  # our own reference solution, never model output
        inputs = [make_args(rng, params) for _ in range(self.num_tests + 1)]
        tests = [[args, namespace[func](*args)] for args in inputs]
        for args, expected in tests:
            canonical_json([args, expected])  # every test must cross the sandbox as JSON
        task_id = "code-" + hashlib.sha1(prompt.encode()).hexdigest()[:12]
        return Task(
            id=task_id,
            data={
                "family": family,
                "prompt": prompt,
                "function": func,
                "reference": reference,
                "tests": tests[1:],
                "example": tests[0][0],
            },
        )

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"code env has splits 'train' and 'test', not {split!r}")
        test = split == "test"
        rng = random.Random("code-test" if test else f"code-train-{seed}")
        seen: set[str] = set()
        misses = 0
        while not test or len(seen) < self.num_test_tasks:
            task = self.sample_task(rng)
            if (split_bucket(task.data["prompt"]) < self.test_fraction) != test or (test and task.id in seen):
                misses += 1
                if misses > 100_000:
                    return  # the families have fewer distinct test prompts than asked for
                continue
            misses = 0
            seen.add(task.id)
            yield task

    # --------------------------------------------------------------- episode

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": task.data["prompt"]}]

    def tools(self) -> list[Tool]:
        return [self.python_tool()]

    async def reward(self, task: Task, state: dict[str, Any], messages: list[Message]) -> dict[str, float]:
        text = final_assistant_text(messages)
        source = extract_code(text) if text is not None else None
        if source is None:
            return {"tests_passed": 0.0}
        sandbox = state.get("sandbox")
        if sandbox is None:
            async with self.pool.session() as sandbox:
                passed, total = await self.grade(sandbox, task, source)
        else:
            passed, total = await self.grade(sandbox, task, source)
        return {"tests_passed": passed / total}

    async def grade(self, sandbox: Any, task: Task, source: str) -> tuple[int, int]:
        """Run the hidden tests on ``source`` in ``sandbox``; returns (passed, total)."""
        tests = task.data["tests"]
        await sandbox.reset()
        results = await sandbox.call_function(source, task.data["function"], [args for args, _ in tests])
        passed = sum(same_value(result.value, expected) for result, (_, expected) in zip(results, tests))
        return passed, len(tests)

    def demonstration(self, task: Task) -> list[Message]:
        func, example = task.data["function"], task.data["example"]
        code = f"{task.data['reference']}\n\nprint({func}({', '.join(repr(a) for a in example)}))"
        namespace: dict[str, Any] = {}
        exec(task.data["reference"], namespace)  # our own reference solution
        shown = ExecResult(stdout=f"{namespace[func](*example)}\n").render(self.sandbox_settings)
        call = {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}
        return [
            *self.initial_messages(task),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "python", "content": shown},
            {"role": "assistant", "content": f"```python\n{task.data['reference']}\n```"},
        ]
