"""The code env: tasks, and its episode flow with a real (bubblewrap) sandbox.

The grader against forging answers, on both backends: ``test_code_grading.py``.
"""

from __future__ import annotations

import itertools

import pytest
import trio
from _sandbox_helpers import require

from agentrl.envs.base import run_cleanup, score_episode
from agentrl.envs.code import FAMILIES, CodeEnv, extract_code
from agentrl.tools.base import ToolBox, ToolCall
from agentrl.tools.sandbox.local import bwrap_available

SANDBOX = {"cpu_time_s": 2, "wall_time_s": 4, "memory_mb": 256, "pool_size": 2}


@pytest.fixture(scope="module")
def env():
    require(bwrap_available())
    env = CodeEnv(sandbox=SANDBOX)
    yield env
    trio.run(env.aclose)


def answer(env, task, text):
    return env.initial_messages(task) + [{"role": "assistant", "content": text}]


def test_tasks_splits_and_hidden_tests():
    env = CodeEnv()
    test = list(env.tasks("test"))
    train = list(itertools.islice(env.tasks("train"), 500))
    assert len(test) == 100 and not {t.id for t in test} & {t.id for t in train}
    assert {t.data["family"] for t in train} == set(FAMILIES)
    for task in train[:50]:
        namespace: dict = {}
        exec(task.data["reference"], namespace)
        fn = namespace[task.data["function"]]
        assert len(task.data["tests"]) == 6
        assert all(fn(*args) == expected for args, expected in task.data["tests"])
    with pytest.raises(ValueError, match="unknown code task families"):
        CodeEnv(families=["sort"])


def test_extract_code():
    assert (
        extract_code("Here:\n```python\ndef f():\n    return 1\n```\nand\n```\ndef g(): pass\n```") == "def g(): pass\n"
    )
    assert extract_code("def f(x): return x") == "def f(x): return x"
    assert extract_code("I cannot do it.") is None


def test_episode_with_the_python_tool_and_grading(env):
    """setup -> python tool calls in the episode's sandbox -> graded reward -> cleanup back to the pool."""
    task = next(t for t in env.tasks("train") if t.data["family"] == "clip")

    async def main():
        state = await env.setup(task)
        box = ToolBox(env.tools())
        demo = env.demonstration(task)
        fn = demo[2]["tool_calls"][0]["function"]
        shown = await box.execute(ToolCall(fn["name"], fn["arguments"]), state)
        assert shown.content == demo[3]["content"]  # the demonstration shows what the sandbox prints
        await box.execute(ToolCall("python", {"code": "open('solution_notes.txt', 'w').write('x')"}), state)
        good = await score_episode(env, task, state, demo)
        func = task.data["function"]
        wrong = await env.reward(task, state, answer(env, task, f"```python\ndef {func}(x):\n    return x\n```"))
        missing = await env.reward(task, state, answer(env, task, "no idea"))
        await run_cleanup(env, task, state)
        return good, wrong, missing, state

    good, wrong, missing, state = trio.run(main)
    assert good == (1.0, {"tests_passed": 1.0}, None)
    assert 0.0 <= wrong["tests_passed"] < 1.0
    assert missing == {"tests_passed": 0.0}
    assert "sandbox" not in state and len(env.pool._idle) == 1


def test_files_left_by_the_agent_cannot_shadow_the_grader(env):
    task = next(t for t in env.tasks("train") if t.data["family"] == "add_k")

    async def main():
        state = await env.setup(task)
        box = ToolBox(env.tools())
        # the agent plants a json module in its work directory...
        await box.execute(ToolCall("python", {"code": "open('json.py', 'w').write('raise SystemExit(0)')"}), state)
        try:
            return await env.reward(task, state, env.demonstration(task))  # ...the grader resets first
        finally:
            await env.cleanup(task, state)

    assert trio.run(main) == {"tests_passed": 1.0}


def test_cleanup_runs_when_the_episode_is_cancelled(env):
    task = next(env.tasks("train"))

    async def main():
        before = env.pool.stats["created"] + env.pool.stats["reused"]
        state = {}
        with trio.move_on_after(0.5):
            try:
                state.update(await env.setup(task))
                await ToolBox(env.tools()).execute(ToolCall("python", {"code": "import time\ntime.sleep(30)"}), state)
            finally:
                await run_cleanup(env, task, state)
        assert env.pool.stats["created"] + env.pool.stats["reused"] == before + 1
        return state

    assert "sandbox" not in trio.run(main)
