"""A user-written environment, outside the agentrl package, loaded by import path
(``env.cls = "tests._actors_user_env:AddEnv"``), plus a scripted agent that solves it."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import trio

from agentrl.agents import AgentEnv
from agentrl.envs.base import Env, Message, Task
from agentrl.tools.base import Tool, tool
from agentrl.tools.parsing import get_parser


@tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return str(a + b)


@tool
async def wait(seconds: float) -> str:
    """Wait, then say so.

    Args:
        seconds: how long.
    """
    await trio.sleep(seconds)
    return "done waiting"


class AddEnv(Env):
    name = "add"

    def __init__(self, num_tasks: int = 1000, reward_raises: bool = False, max_operand: int = 99):
        self.num_tasks = num_tasks
        self.reward_raises = reward_raises
        self.max_operand = max_operand
        self.cleaned_up = 0

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        rng = random.Random(f"{split}-{seed}")
        for i in range(self.num_tasks):
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            yield Task(id=f"{split}-{seed}-{i}", data={"a": a, "b": b})

    def initial_messages(self, task: Task) -> list[Message]:
        return [
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": f"What is {task.data['a']} + {task.data['b']}?"},
        ]

    def tools(self) -> list[Tool]:
        return [add, wait]

    def eval_group(self, task: Task) -> str:
        return "even" if task.data["a"] % 2 == 0 else "odd"

    async def cleanup(self, task: Task, state: dict[str, Any]) -> None:
        self.cleaned_up += 1

    async def reward(self, task: Task, state: dict[str, Any], messages: list[Message]) -> float:
        if self.reward_raises:
            raise RuntimeError("the scorer crashed")
        last = messages[-1]
        right = str(task.data["a"] + task.data["b"])
        return 1.0 if last["role"] == "assistant" and re.search(rf"\b{right}\b", last["content"]) else 0.0


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def solver(turn: int, prompt: str) -> str:
    """A scripted agent for AddEnv: call add, then state the tool's result."""
    if turn == 0:
        a, b = re.findall(r"What is (\d+) \+ (\d+)\?", prompt)[-1]
        return call("add", a=int(a), b=int(b))
    result = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt, flags=re.S)[-1]
    return f"The answer is {result}."


ADD_SCHEMA = add.schema()


class AddAgentEnv(AgentEnv):
    """AddEnv's tasks played by agent code with the OpenAI SDK: ask, run the ``add`` tool it calls, answer.

    ``rewrite_history``: the second call sends a fresh conversation (the question and the tool's
    result in one user message), as an agent that compacts its context does: every episode is then
    two sequences.

    ``tool_format``: the model's tool-call format (``env.tool_parser``, by ``get_parser`` name; "" keeps
    the default), as a user's env takes it from ``env.kwargs``.
    """

    name = "add-agent"

    def __init__(self, num_tasks: int = 1000, rewrite_history: bool = False, tool_format: str = ""):
        self.tasks_of = AddEnv(num_tasks=num_tasks)
        self.rewrite_history = rewrite_history
        if tool_format:
            self.tool_parser = get_parser(tool_format)

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        return self.tasks_of.tasks(split, seed)

    def eval_group(self, task: Task) -> str:
        return self.tasks_of.eval_group(task)

    async def run(self, task: Task, client: Any) -> float:
        a, b = task.data["a"], task.data["b"]
        messages = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": f"What is {a} + {b}?"}]
        for _ in range(4):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD_SCHEMA])
            message = reply.choices[0].message
            if not message.tool_calls:
                return 1.0 if re.search(rf"\b{a + b}\b", message.content or "") else 0.0
            call = message.tool_calls[0]
            result = str(sum(json.loads(call.function.arguments).values()))
            if self.rewrite_history:
                messages = messages[:1] + [
                    {
                        "role": "user",
                        "content": f"What is {a} + {b}? The add tool says:\n"
                        f"<tool_response>\n{result}\n</tool_response>",
                    }
                ]
            else:
                messages += [
                    message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": result},
                ]
        return 0.0


def prompt_solver(turn: int, prompt: str) -> str:
    """:func:`solver` that answers once a tool result is in the prompt, whatever the turn (for agents
    that start a fresh conversation with the result)."""
    return solver(1 if "<tool_response>" in prompt.rsplit("<|im_start|>user", 1)[-1] else 0, prompt)
