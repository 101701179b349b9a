"""The Env API: loading by import path, make_env, reward and cleanup safety, task sources, docs."""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
import sys
import time
from pathlib import Path

import pytest
import trio

from agentrl.config import load_config
from agentrl.envs import demonstrations, load_env, make_env, run_cleanup, score_episode, total_reward
from agentrl.envs.base import Env, Task
from agentrl.envs.sources import TaskSource, load_records
from agentrl.episode.rollout import toolbox_for
from agentrl.episode.turn import EpisodeLimits

DOCS = Path(__file__).resolve().parents[1] / "docs" / "envs.md"


class RaisingEnv(Env):
    def __init__(self, mode: str = "raise"):
        self.mode = mode
        self.cleaned: list[str] = []

    def tasks(self, split="train", seed=0):
        yield Task("t0", {})

    def initial_messages(self, task):
        return [{"role": "user", "content": "hi"}]

    async def reward(self, task, state, messages):
        if self.mode == "raise":
            raise ZeroDivisionError("bad reward")
        if self.mode == "nan":
            return {"a": 1.0, "b": math.nan}
        return {"a": 0.5, "b": 0.25}

    async def cleanup(self, task, state):
        if self.mode == "slow-cleanup":
            await trio.sleep(30)
        await trio.sleep(0.05)  # an await that a cancelled scope would interrupt without the shield
        self.cleaned.append(task.id)
        if self.mode == "raise-cleanup":
            raise OSError("disk gone")


def test_reward_that_raises_scores_zero_with_a_message():
    env = RaisingEnv("raise")
    total, comps, error = trio.run(score_episode, env, Task("t0"), {}, [])
    assert (total, comps) == (0.0, {}) and "reward of RaisingEnv failed: ZeroDivisionError: bad reward" in error
    total, comps, error = trio.run(score_episode, RaisingEnv("nan"), Task("t0"), {}, [])
    assert total == 0.0 and "not finite" in error
    assert trio.run(score_episode, RaisingEnv("ok"), Task("t0"), {}, []) == (0.75, {"a": 0.5, "b": 0.25}, None)
    assert total_reward(2) == (2.0, {})


def test_reward_beyond_the_bound_scores_zero_with_a_message():
    score = functools.partial(score_episode, max_abs_reward=0.3)  # the component 0.5 is beyond it
    total, comps, error = trio.run(score, RaisingEnv("ok"), Task("t0"), {}, [])
    assert (total, comps) == (0.0, {}) and "exceeds learner.max_abs_reward=0.3" in error
    score = functools.partial(score_episode, max_abs_reward=0.75)  # the total 0.75 is at the bound: fine
    assert trio.run(score, RaisingEnv("ok"), Task("t0"), {}, []) == (0.75, {"a": 0.5, "b": 0.25}, None)


def test_cleanup_always_runs_and_never_raises():
    env = RaisingEnv("raise-cleanup")
    assert "cleanup of RaisingEnv failed: OSError: disk gone" in trio.run(run_cleanup, env, Task("a"), {})
    assert env.cleaned == ["a"]

    cancelled = RaisingEnv("ok")

    async def episode():
        with trio.move_on_after(0.05):
            try:
                await trio.sleep(10)
            finally:
                assert await run_cleanup(cancelled, Task("b"), {}) is None

    trio.run(episode)
    assert cancelled.cleaned == ["b"]  # ran to the end although the episode was cancelled

    start = time.monotonic()
    message = trio.run(lambda: run_cleanup(RaisingEnv("slow-cleanup"), Task("c"), {}, limit_s=0.2))
    assert "longer than 0.2 s" in message and time.monotonic() - start < 5


def test_load_env_errors_name_the_problem():
    with pytest.raises(ValueError, match="module:Class"):
        load_env("agentrl.envs.calculator.CalculatorEnv")
    with pytest.raises(ValueError, match="cannot import env module 'no_such_pkg'"):
        load_env("no_such_pkg:Env")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        load_env("agentrl.envs.calculator:Nope")
    with pytest.raises(ValueError, match="not a subclass"):
        load_env("agentrl.envs.calculator:CalculatorTool")
    with pytest.raises(ValueError, match=r"cannot construct .* with kwargs \['colour'\]"):
        load_env("agentrl.envs.calculator:CalculatorEnv", {"colour": "red"})


def test_make_env_passes_kwargs_and_sandbox_settings(tmp_path):
    calc = make_env(load_config(None, ["env.kwargs={max_ops = 2, max_operand = 9}"]))
    assert (calc.max_ops, calc.max_operand) == (2, 9)
    code = make_env(
        load_config(None, ["env.cls=agentrl.envs.code:CodeEnv", "sandbox.memory_mb=64", "sandbox.pool_size=1"])
    )
    assert code.sandbox_settings.memory_mb == 64 and code.sandbox_settings.pool_size == 1
    refined = make_env(
        load_config(
            None, ["env.cls=agentrl.envs.code:CodeEnv", "sandbox.memory_mb=64", "env.kwargs={sandbox = {max_live = 3}}"]
        )
    )
    assert refined.sandbox_settings.max_live == 3 and refined.sandbox_settings.memory_mb == 64
    cfg = load_config(None, ["env.tool_timeout_s=1.5", "env.tool_max_output_chars=99"])
    box = toolbox_for(make_env(cfg), cfg)
    assert (box.timeout_s, box.max_output_chars, [t["function"]["name"] for t in box.schemas()]) == (
        1.5,
        99,
        ["calculator"],
    )
    with pytest.raises(ValueError, match="cannot import env module"):
        make_env(load_config(None, ["env.cls=missing_mod:Env"]))


def test_episode_limits_prefer_the_env_then_the_config():
    def limits(env):
        got = EpisodeLimits.from_config(cfg, env)
        return got.max_turns, got.max_total_tokens

    cfg = load_config(None, ["env.max_turns=3", "env.max_total_tokens=500"])
    assert limits(RaisingEnv()) == (3, 500)
    env = RaisingEnv()
    env.max_turns, env.max_total_tokens = 8, 99999
    assert limits(env) == (8, cfg.engine.max_context_tokens)
    env.max_turns = 0  # an env's own 0 is a limit, not "unset"
    assert limits(env)[0] == 0


def test_demonstrations_helper_skips_tasks_without_demos():
    env = load_env("agentrl.envs.calculator:CalculatorEnv", {"max_ops": 3, "demo_max_ops": 1})
    records = list(demonstrations(env, 30, seed=3))
    assert len(records) == 30 and len({r["task_id"] for r in records}) == 30
    assert all(r["messages"][2]["tool_calls"][0]["function"]["name"] == "calculator" for r in records)
    assert list(demonstrations(RaisingEnv(), 5)) == []


def test_make_demos_cli(tmp_path):
    import subprocess

    cfg = tmp_path / "run.toml"
    cfg.write_text('[env]\ncls = "agentrl.envs.search_qa:SearchQAEnv"\n')
    out = tmp_path / "demos.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "agentrl", "make-demos", str(cfg), "-o", str(out), "-n", "7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 7 and lines[0]["messages"][-1]["content"].startswith("The answer is")


# ---------------------------------------------------------------------- task sources

ROWS = [
    {"id": "q1", "question": "1+1", "answer": "2"},
    {"id": "q2", "question": "2+2", "answer": "4"},
    {"question": "3+3", "answer": "6"},
]


def test_jsonl_json_and_split_placeholder(tmp_path):
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    (tmp_path / "test.json").write_text(json.dumps(ROWS[:1]))
    src = TaskSource(train=tmp_path / "train.jsonl", test=tmp_path / "test.json")
    assert [t.id for t in src.tasks("test")] == ["q1"]
    train = list(itertools.islice(src.tasks("train", seed=1), 9))
    assert sorted(t.id for t in train[:3]) == ["q1", "q2", "train-2"]  # every pass covers every record
    assert {t.data["answer"] for t in train} == {"2", "4", "6"}
    assert [t.id for t in itertools.islice(src.tasks("train", seed=1), 9)] == [t.id for t in train]
    (tmp_path / "test.jsonl").write_text(json.dumps(ROWS[2]) + "\n")
    placeholder = TaskSource(str(tmp_path / "{split}.jsonl"))
    assert [t.data["answer"] for t in placeholder.tasks("test")] == ["6"]


def test_parquet_and_folders(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "data.parquet")
    assert load_records(tmp_path / "data.parquet") == [
        {"id": "q1", "question": "1+1", "answer": "2"},
        {"id": "q2", "question": "2+2", "answer": "4"},
        {"id": None, "question": "3+3", "answer": "6"},
    ]
    assert [t.id for t in TaskSource(test=tmp_path / "data.parquet").tasks("test")] == ["q1", "q2", "test-2"]
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "train-0.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (folder / "train-1.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    (folder / "test-0.jsonl").write_text(json.dumps(ROWS[2]) + "\n")
    assert [r["answer"] for r in load_records(folder, "train")] == ["2", "4"]
    assert [r["answer"] for r in load_records(folder, "test")] == ["6"]


def _save_hf_dataset(path: Path, rows: list[dict]) -> None:
    """Write the layout of ``datasets.Dataset.save_to_disk`` (Arrow stream + state.json)."""
    import pyarrow as pa

    path.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    state = {  # what a real save_to_disk writes (datasets, when installed, reads all of it)
        "_data_files": [{"filename": "data-00000-of-00001.arrow"}],
        "_fingerprint": "0",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (path / "state.json").write_text(json.dumps(state))
    (path / "dataset_info.json").write_text("{}")


def test_hf_datasets_folders(tmp_path):
    _save_hf_dataset(tmp_path / "dd" / "train", ROWS[:2])
    _save_hf_dataset(tmp_path / "dd" / "test", ROWS[2:])
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    src = TaskSource(tmp_path / "dd")
    assert [t.data["answer"] for t in src.tasks("test")] == ["6"]
    assert {t.id for t in itertools.islice(src.tasks("train"), 4)} == {"q1", "q2"}
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\]; split 'dev'"):
        src.records("dev")
    assert [r["id"] for r in load_records(tmp_path / "dd" / "train")] == ["q1", "q2"]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", '{"a": 1}\n{oops\n', "bad.jsonl:2 is not valid JSON"),
        ("obj.json", '{"a": 1}', "must hold a JSON list"),
        ("data.csv", "a,b", "expected .jsonl, .json, .parquet"),
        ("empty.jsonl", "\n", "has no records"),
    ],
)
def test_task_source_errors(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=re.escape(message)):
        TaskSource(train=tmp_path / name).records("train")


def test_task_source_missing_things(tmp_path):
    with pytest.raises(ValueError, match="task data not found"):
        load_records(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="no path for split 'test'"):
        TaskSource(train=tmp_path / "x.jsonl").records("test")
    with pytest.raises(ValueError, match="needs a path"):
        TaskSource()
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="list.json: item 0 is a JSON int, not an object"):
        next(TaskSource(test=tmp_path / "list.json").tasks("test"))


# ---------------------------------------------------------------------------- docs


def test_the_tutorial_env_in_docs_works(tmp_path, monkeypatch):
    """The code blocks of docs/envs.md, run as written: the tutorial env loads and scores."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    module = next(b for b in blocks if "class CapitalsEnv" in b)
    (tmp_path / "my_envs.py").write_text(module)
    (tmp_path / "capitals.jsonl").write_text(
        '{"id": "fr", "country": "France", "capital": "Paris"}\n{"id": "no", "country": "Norway", "capital": "Oslo"}\n'
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["env.cls=my_envs:CapitalsEnv", f"env.kwargs={{path = '{tmp_path / 'capitals.jsonl'}'}}"])
    env = make_env(cfg)
    task = next(env.tasks("train"))
    box = toolbox_for(env, cfg)
    demo = env.demonstration(task)
    assert demo is not None and demo[0]["role"] == "system"

    async def episode():
        state = await env.setup(task)
        try:
            fn = demo[2]["tool_calls"][0]["function"]
            from agentrl.tools.base import ToolCall

            result = await box.execute(ToolCall(fn["name"], fn["arguments"]), state)
            assert result.content == demo[3]["content"]
            follow_up = await env.on_text_turn(task, state, demo[:-1] + [{"role": "assistant", "content": "Hmm?"}])
            return await score_episode(env, task, state, demo), follow_up
        finally:
            await run_cleanup(env, task, state)

    (total, comps, error), follow_up = trio.run(episode)
    assert error is None and total == 1.0 and comps["correct"] == 1.0
    assert isinstance(follow_up, str)


def test_reward_helpers():
    from fractions import Fraction

    from agentrl.envs.rewards import exact_match, final_assistant_text, last_number, normalize_answer

    assert (
        final_assistant_text([{"role": "assistant", "content": "<think>maybe 7</think>The answer is 5."}])
        == "The answer is 5."
    )
    assert final_assistant_text([{"role": "assistant", "content": "x", "tool_calls": [{}]}]) is None
    assert final_assistant_text([{"role": "tool", "content": "5"}]) is None
    assert final_assistant_text([]) is None
    assert last_number("1,234 then -5.5.") == Fraction("-5.5") and last_number("none") is None
    assert normalize_answer("The answer is: The Silver Lamp!") == "silver lamp"
    assert exact_match("answer: Oslo.", ["Paris", "oslo"]) and not exact_match("Oslo, Norway", "Oslo")
