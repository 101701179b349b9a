"""An evaluation counts and shows what went wrong without failing an episode: episodes the
engine aborted, rewards that raised, tool calls that crashed (issue: `agentrl eval` reported
``n_failed: 0, errors: []`` while half its episodes had been aborted)."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from agentrl.engine.client import EngineClient
from agentrl.envs.base import load_env
from agentrl.episode.evaluation import describe_problems, evaluate
from agentrl.episode.turn import EpisodeLimits
from agentrl.run.evaluate import eval_metrics
from agentrl.tools.base import tool
from tests._actors_helpers import HttpEngineClient, ScriptedEngine, TurnScript, load_tokenizer, tiny_tokenizer_dir
from tests._actors_user_env import AddEnv, call

LIMITS = EpisodeLimits(max_turns=4, max_total_tokens=512, max_new_tokens_per_turn=32, max_empty_aborts=1)


def test_aborted_episodes_and_reward_errors_are_counted_against_a_real_engine(engine_urls, engine_model):
    """The engine is paused and every queued request aborted, as when it fails a whole batch:
    every episode ends 'aborted'; the env's reward raises on each. Both are counted, with the
    first messages, and said in words."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine_model)
    env = load_env("tests._actors_user_env:AddEnv", {"num_tasks": 5, "reward_raises": True})
    tasks = list(env.tasks("test"))
    url = engine_urls[0]

    async def main():
        async with EngineClient([url]) as client:
            await client.pause("abort")
            done = trio.Event()

            async def abort_queued():
                while not done.is_set():
                    await client.abort()
                    with trio.move_on_after(0.02):
                        await done.wait()

            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(abort_queued)
                    with trio.fail_after(120):
                        result = await evaluate(client, tokenizer, env, tasks, greedy=True, limits=LIMITS)
                    done.set()
            finally:
                await client.continue_generation()
            return result

    result = trio.run(main)
    assert result["n"] == 5 and result["n_failed"] == 0
    assert result["finish_reasons"] == {"aborted": 5}
    assert result["n_aborted"] == 5 and result["n_reward_errors"] == 5
    assert result["problems"]["aborted"]["first"] == ["aborted by /abort_request"]
    assert "RuntimeError: the scorer crashed" in result["problems"]["reward_errors"]["first"][0]
    lines = describe_problems(result)
    assert lines[0].startswith("5 of 5 episodes were aborted by the engine") and "aborted by /abort_request" in lines[0]
    assert lines[1].startswith("5 of 5 episodes' rewards raised (scored 0)") and "the scorer crashed" in lines[1]
    metrics = eval_metrics(result, "eval_before")
    assert metrics["eval_before/n_aborted"] == 5.0 and metrics["eval_before/n_reward_errors"] == 5.0
    assert httpx.get(url + "/server_info", timeout=10).json()["paused"] is False  # left as found


@tool
def broken_add(a: int, b: int) -> str:
    """Add two integers, badly.

    Args:
        a: the first number.
        b: the second number.
    """
    raise ZeroDivisionError("the adder fell over")


class BrokenToolEnv(AddEnv):
    def tools(self):
        return [broken_add]


def test_tool_crashes_are_counted_but_the_model_s_own_mistakes_are_not(tmp_path_factory):
    tokenizer = load_tokenizer(tiny_tokenizer_dir(tmp_path_factory))
    env = BrokenToolEnv(num_tasks=3)
    tasks = list(env.tasks("test"))

    def script(turn: int, prompt: str) -> str:
        if turn == 0:
            a, b = prompt.rsplit("What is ", 1)[1].split("?")[0].split(" + ")
            return call("broken_add", a=int(a), b=int(b)) + call("broken_add", a="x", b=1)  # one crash, one bad call
        return "I could not add them."

    with ScriptedEngine(TurnScript(tokenizer, script)) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                return await evaluate(
                    client,
                    tokenizer,
                    env,
                    tasks,
                    limits=EpisodeLimits(max_total_tokens=1024, max_new_tokens_per_turn=200),
                )

        result = trio.run(main)
    assert result["finish_reasons"] == {"answer": 3}
    assert result["n"] == 3 and result["n_aborted"] == 0 and result["n_reward_errors"] == 0
    assert result["n_tool_faults"] == 3  # the crashes; the calls with a wrong argument type are the model's
    assert result["problems"]["tool_faults"]["first"] == [
        "Error: broken_add failed: ZeroDivisionError: the adder fell over"
    ]
    assert describe_problems(result) == [
        "3 tool calls crashed or timed out (to answer with an error on purpose, a tool raises ToolError); first: Error: broken_add failed: ZeroDivisionError: the adder fell over"
    ]


def test_a_clean_evaluation_reports_no_problems():
    result = {"n": 4, "n_failed": 0, "problems": {}}
    assert describe_problems(result) == []


def test_agentrl_eval_prints_the_problems_and_logs_them_to_a_real_mlflow_store(engine_urls, engine_model, tmp_path):
    """The CLI end to end against a real engine that aborts every request, with a reward that raises: stdout's
    JSON holds the counts and first messages, stderr says them in words, and the MLflow SQLite store gets the
    counts as eval/* metrics and the whole result (first messages included) as the artifact eval.json.
    ``agentrl eval`` writes no summary file of its own (no --output): stdout and MLflow are its outputs."""
    import json
    import threading

    from mlflow import MlflowClient
    from typer.testing import CliRunner

    from agentrl.cli import app

    url, db = engine_urls[0], tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    overrides = [
        f"model.path={engine_model}",
        f'engine.urls=["{url}"]',
        "env.cls=tests._actors_user_env:AddEnv",
        "env.kwargs.num_tasks=3",
        "env.kwargs.reward_raises=true",
        "eval.num_tasks=3",
        "env.max_total_tokens=512",
        "actors.max_new_tokens_per_turn=32",
        "tracking.enabled=true",
        f"tracking.uri=sqlite:///{db}",
        "tracking.experiment=eval-problems",
        "run.name=probe",
        f"run.run_dir={tmp_path / 'run'}",
    ]
    done, paused = threading.Event(), threading.Event()

    def abort_everything():  # as an engine that fails whole batches does: every request comes back aborted
        with httpx.Client(timeout=10) as http:
            http.post(url + "/pause_generation", json={"mode": "abort"}).raise_for_status()
            paused.set()
            try:
                while not done.wait(0.02):
                    http.post(url + "/abort_request", json={"rid": "", "abort_all": True})
            finally:
                http.post(url + "/continue_generation").raise_for_status()

    aborter = threading.Thread(target=abort_everything, daemon=True)
    aborter.start()
    assert paused.wait(10)
    try:
        config = tmp_path / "eval.toml"
        config.write_text("")  # every setting as an override
        result = CliRunner().invoke(app, ["eval", str(config), *sum((["-s", o] for o in overrides), [])])
    finally:
        done.set()
        aborter.join(10)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed["n"] == 3 and printed["n_failed"] == 0 and printed["finish_reasons"] == {"aborted": 3}
    assert printed["n_aborted"] == 3 and printed["n_reward_errors"] == 3
    assert printed["problems"]["aborted"]["first"] == ["aborted by /abort_request"]
    assert "RuntimeError: the scorer crashed" in printed["problems"]["reward_errors"]["first"][0]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert (
        warnings[0].startswith("warning: 3 of 3 episodes were aborted by the engine")
        and "aborted by /abort_request" in warnings[0]
    )
    assert (
        warnings[1].startswith("warning: 3 of 3 episodes' rewards raised (scored 0)")
        and "the scorer crashed" in warnings[1]
    )
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("*.json"))  # no summary file

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    [run] = client.search_runs([client.get_experiment_by_name("eval-problems").experiment_id])
    assert run.info.run_name == "eval-probe" and run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert (metrics["eval/n"], metrics["eval/n_aborted"], metrics["eval/n_reward_errors"]) == (3.0, 3.0, 3.0)
    assert metrics["eval/env/add/n_aborted"] == 3.0 and metrics["eval/success_rate"] == 0.0
    logged = json.loads(Path(client.download_artifacts(run.info.run_id, "eval.json", str(tmp_path))).read_text())
    assert logged["problems"] == printed["problems"] and logged["by_env"]["add"]["n_reward_errors"] == 3
    assert httpx.get(url + "/server_info", timeout=10).json()["paused"] is False  # left as found
