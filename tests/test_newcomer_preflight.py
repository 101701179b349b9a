"""What ``agentrl run --dry-run`` and ``agentrl make-demos`` check of a newcomer's own env before
anything trains: a reward that raises or is not finite, demonstrations that call a tool the env
does not have (or with arguments its schema refuses), the first prompt on a fresh clone (the
tiny model built, or the command that builds it named), and an env file that imports a module
next to it. The checks run in real ``agentrl`` processes where the CLI is the border."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.run.preflight import DEMOS_CHECKED, check_env, summary_lines

ROOT = Path(__file__).resolve().parent.parent

# A two-tool unit-conversion env, as a newcomer writes it: its table lives in a module next to it.
UNIT_TABLE = """FACTORS = {("km", "m"): 1000, ("kg", "g"): 1000, ("h", "min"): 60}
"""

UNITS_ENV = '''
import math

from unit_table import FACTORS  # a sibling module of this file

from agentrl.envs.base import Env, Task
from agentrl.tools.base import ToolError, tool


@tool
def factor(from_unit: str, to_unit: str) -> str:
    """The factor from one unit to another.

    Args:
        from_unit: the unit converted from.
        to_unit: the unit converted to.
    """
    if (from_unit, to_unit) not in FACTORS:
        raise ToolError(f"no factor from {from_unit} to {to_unit}")
    return str(FACTORS[(from_unit, to_unit)])


@tool
def multiply(a: float, b: float) -> str:
    """a times b.

    Args:
        a: a number.
        b: another number.
    """
    return str(a * b)


class Units(Env):
    name = "units"
    mode = "ok"  # what the subclasses below break

    def tasks(self, split="train", seed=0):
        for i, (pair, f) in enumerate(sorted(FACTORS.items())):
            yield Task(id=f"{split}-{i}", data={"value": 3, "from": pair[0], "to": pair[1], "answer": 3 * f})

    def initial_messages(self, task):
        d = task.data
        return [{"role": "user", "content": f"How many {d['to']} are {d['value']} {d['from']}?"}]

    def tools(self):
        return [factor, multiply]

    async def reward(self, task, state, messages):
        if self.mode == "raises":
            return {"dozen": 12}["dozens"]  # KeyError: 'dozens'
        if self.mode == "nan":
            return math.nan
        return float(str(task.data["answer"]) in messages[-1]["content"])

    def demonstration(self, task):
        d = task.data
        calls = [("factor", {"from_unit": d["from"], "to_unit": d["to"]}),
                 ("multiply", {"a": d["value"], "b": d["answer"] / d["value"]})]
        if self.mode == "unknown_tool":
            calls[1] = ("times", {"a": d["value"], "b": 2})
        if self.mode == "bad_arguments":
            calls[0] = ("factor", {"from": d["from"], "to_unit": d["to"]})
        out = self.initial_messages(task)
        for name, args in calls:
            out += [{"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]},
                    {"role": "tool", "name": name, "content": "..."}]
        return out + [{"role": "assistant", "content": f"{d['answer']} {d['to']}"}]


class RaisingReward(Units):
    mode = "raises"


class NanReward(Units):
    mode = "nan"


class UnknownTool(Units):
    mode = "unknown_tool"


class BadArguments(Units):
    mode = "bad_arguments"
'''


def _write_env(parent: Path) -> Path:
    folder = parent / "my_envs"
    folder.mkdir()
    (folder / "unit_table.py").write_text(UNIT_TABLE)
    (folder / "units_env.py").write_text(UNITS_ENV)
    return folder


@pytest.fixture
def env_dir(tmp_path: Path) -> Path:
    return _write_env(tmp_path)


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory: pytest.TempPathFactory):
    """The check on a fresh clone: no model folder yet, ``model.init_size = "tiny"`` (the default).
    The model it builds is the one every other test here renders prompts with."""
    folder = tmp_path_factory.mktemp("preflight")
    env_dir = _write_env(folder)
    missing = folder / "models" / "tiny"
    return missing, check_env(_cfg(env_dir, "Units", missing))


@pytest.fixture
def tiny_model(fresh_clone) -> Path:
    return fresh_clone[0]


def _cfg(env_dir: Path, cls: str, model: Path, *extra: str):
    return load_config(
        None, [f"env.cls={env_dir / 'units_env.py'}:{cls}", f"model.path={model}", "sft.enabled=true", *extra]
    )


def _agentrl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentrl", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_a_sound_env_from_a_file_that_imports_its_sibling_passes(env_dir: Path, tiny_model: Path) -> None:
    report = check_env(_cfg(env_dir, "Units", tiny_model))
    text = "\n".join(summary_lines(report))
    assert report.ok, text
    assert "tools: factor, multiply" in text and "first prompt:" in text
    # three tasks demonstrated (every one of them), two calls each, each demonstration right
    assert "demonstrations: 3 checked (6 tool calls), rewards of the first 3: 1, 1, 1" in text
    assert "answered 'I do not know.': 0" in text


@pytest.mark.parametrize(
    "cls, expected",
    [
        ("RaisingReward", "the demonstration of task 'train-0': reward of RaisingReward failed: KeyError: 'dozens'"),
        ("NanReward", "the demonstration of task 'train-0': reward of NanReward is not finite: nan"),
        (
            "UnknownTool",
            "the demonstration of task 'train-0', message 3: calls the unknown tool 'times'; "
            "the env's tools: factor, multiply",
        ),
        (
            "BadArguments",
            "the demonstration of task 'train-0', message 1: factor is missing required argument(s): from_unit",
        ),
    ],
)
def test_each_broken_piece_is_a_problem(env_dir: Path, tiny_model: Path, cls: str, expected: str) -> None:
    report = check_env(_cfg(env_dir, cls, tiny_model))
    assert not report.ok
    assert any(p.startswith(expected) for p in report.problems), report.problems
    if cls == "RaisingReward":  # a wrong answer is scored too: the reward raises there as well
        assert any("answered 'I do not know.': reward of RaisingReward failed: KeyError" in p for p in report.problems)
    if cls in ("UnknownTool", "BadArguments"):  # one line per bad call, the rest counted; SFT is named
        assert sum("message" in p for p in report.problems) == 3
        assert "(SFT would teach the model these calls)" in report.problems[2]


def test_bad_calls_past_the_first_few_are_counted(env_dir: Path, tiny_model: Path) -> None:
    from agentrl.envs import load_env
    from agentrl.envs.base import Task
    from agentrl.run.preflight import MAX_CALL_PROBLEMS, DemoChecker

    env = load_env(f"{env_dir / 'units_env.py'}:UnknownTool")
    checker = DemoChecker(env, scored=0)
    task = Task(id="t", data={"value": 3, "from": "km", "to": "m", "answer": 3000})
    for _ in range(MAX_CALL_PROBLEMS + 4):
        checker.add(task, env.demonstration(task))
    problems, notes = checker.finish()
    assert len(problems) == MAX_CALL_PROBLEMS + 1
    assert problems[-1] == "... and 4 more bad tool calls in the demonstrations (SFT would teach the model these calls)"
    assert notes == [
        f"demonstrations: {MAX_CALL_PROBLEMS + 4} checked ({2 * (MAX_CALL_PROBLEMS + 4)} tool calls), "
        "rewards of the first 0: -"
    ]
    assert DEMOS_CHECKED >= 3


def test_dry_run_and_make_demos_exit_2_for_a_raising_reward_and_an_unknown_tool(
    env_dir: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """The real CLI, in the newcomer's own folder (relative env path; the sibling import works there)."""
    sets = ["-s", f"model.path={tiny_model}", "-s", "sft.enabled=true"]
    config = tmp_path / "run.toml"
    config.write_text("[run]\nname = 'units'\n")
    out = _agentrl("run", str(config), "--dry-run", *sets, "-s", "env.cls=units_env.py:RaisingReward", cwd=env_dir)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert "# env check: " in out.stdout and "problem(s)" in out.stdout
    assert (
        "PROBLEM: the demonstration of task 'train-0': reward of RaisingReward failed: KeyError: 'dozens'" in out.stdout
    )

    demos = tmp_path / "demos.jsonl"
    out = _agentrl(
        "make-demos",
        str(config),
        "-o",
        str(demos),
        "-n",
        "5",
        *sets,
        "-s",
        "env.cls=units_env.py:UnknownTool",
        cwd=env_dir,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert (
        "make-demos: PROBLEM: units: the demonstration of task 'train-0', message 3: calls the unknown tool 'times'"
        in out.stderr
    )
    assert not demos.exists() and not list(tmp_path.glob("demos.jsonl*"))  # nothing written, no partial file left

    out = _agentrl(
        "make-demos", str(config), "-o", str(demos), "-n", "5", *sets, "-s", "env.cls=units_env.py:Units", cwd=env_dir
    )
    assert out.returncode == 0, out.stdout + out.stderr
    records = [json.loads(line) for line in demos.read_text().splitlines()]
    assert len(records) == 3 and records[0]["tools"][0]["function"]["name"] == "factor"


def test_a_fresh_clone_builds_the_tiny_model_or_names_the_command(fresh_clone, env_dir: Path, tmp_path: Path) -> None:
    missing, report = fresh_clone
    assert report.ok, report.problems
    assert (missing / "config.json").exists()
    assert any(n.startswith(f"built the tiny model at {missing}") for n in report.notes)
    assert any(n.startswith("first prompt:") for n in report.notes)

    bigger = tmp_path / "models" / "small"
    report = check_env(_cfg(env_dir, "Units", bigger, "model.init_size=small"))
    text = "\n".join(summary_lines(report))
    assert report.ok and not bigger.exists()
    assert "# env check: ok, but 1 piece(s) not checked" in text
    assert f"NOT CHECKED: the first prompt: no model at {bigger} yet" in text
    assert f"`agentrl init-model {bigger} --size small --seed 0`" in text

    report = check_env(_cfg(env_dir, "Units", bigger, "model.init_size="))
    assert not report.ok and not bigger.exists()
    assert report.problems == [
        f"no model at {bigger} (config.json missing) and model.init_size is empty, so a run "
        f"cannot start: build one with `agentrl init-model {bigger} --size tiny --seed 0`, or "
        "set model.path to a Hugging Face model folder"
    ]


def test_a_tool_error_raised_on_purpose_is_not_a_crash(env_dir: Path) -> None:
    import trio

    from agentrl.envs import load_env
    from agentrl.tools.base import ToolBox, ToolCall, tool

    box = ToolBox(load_env(f"{env_dir / 'units_env.py'}:Units").tools())
    unknown = trio.run(box.execute, ToolCall("factor", {"from_unit": "dozen", "to_unit": "m"}))
    assert unknown.is_error and unknown.error_kind == "tool_error" and not unknown.tool_fault
    assert unknown.content == "Error: no factor from dozen to m"
    mistake = trio.run(box.execute, ToolCall("multiply", {"a": 2, "b": "x"}))  # the model's mistake
    assert mistake.error_kind == "bad_arguments" and not mistake.tool_fault

    @tool
    def lookup(unit: str) -> str:
        """A lookup with a bug."""
        return {"km": "1000"}[unit]

    crash = trio.run(ToolBox([lookup]).execute, ToolCall("lookup", {"unit": "dozen"}))
    assert crash.error_kind == "crash" and crash.tool_fault
    assert crash.content == "Error: lookup failed: KeyError: 'dozen'"
