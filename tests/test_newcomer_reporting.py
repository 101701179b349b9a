"""What a newcomer reads while and after training: reward errors from the actors' logs to the run's
progress line, table, events and summary; evaluations logged at the step they describe; "did you
mean" for an unknown config key; help texts that keep their [brackets]; a re-run into a folder
whose env or SFT config changed, which starts afresh instead of reusing the old warm start."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from agentrl.actors.metrics import (
    MAX_REWARD_ERROR_KINDS,
    OTHER_REWARD_ERRORS,
    REWARD_ERRORS_MARKER,
    ActorStats,
    RewardErrors,
    parse_reward_errors,
)
from agentrl.config import ConfigError, load_config
from agentrl.protocol import Trajectory, TrajectoryGroup

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "calculator" / "config.toml"


@pytest.fixture
def actor_log(tmp_path: Path):
    """The actor's logger writing to ``logs/actor<i>.log`` as an actor process's stderr would."""
    logger = logging.getLogger("agentrl.actors")
    handlers = []

    def open_log(index: int) -> Path:
        """From now on the logger writes to actor ``index``'s log (only)."""
        for old in handlers:
            logger.removeHandler(old)
        path = tmp_path / "logs" / f"actor{index}.log"
        path.parent.mkdir(exist_ok=True)
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        handlers.append(handler)
        return path

    old_level = logger.level
    logger.setLevel(logging.INFO)
    yield open_log
    for handler in handlers:
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(old_level)


def _group(env: str, errors: list[str | None]) -> TrajectoryGroup:
    trajectories = []
    for i, error in enumerate(errors):
        md = {"episode_id": f"e{i}", "finish_reason": "answer", **({"reward_error": error} if error else {})}
        trajectories.append(
            Trajectory(
                tokens=[1, 2, 3],
                loss_mask=[0, 1, 1],
                behavior_logprobs=[0.0, -1.0, -1.0],
                weight_versions=[0, 0, 0],
                reward=0.0,
                metadata=md,
            )
        )
    return TrajectoryGroup(group_id="g", task_id="t", env=env, trajectories=trajectories)


def test_actor_stats_log_each_reward_error_once_and_count_it(actor_log, tmp_path: Path) -> None:
    path = actor_log(0)
    stats = ActorStats()
    for _ in range(3):
        stats.add_group(
            _group("units", ["reward of U failed: KeyError: 'dozen'", None, "reward of U failed: KeyError: 'dozen'"])
        )
    stats.add_group(_group("units", ["reward of U is not finite: nan"]))
    summary = stats.summary()  # the final report: its line goes out whatever the time since the last
    assert summary["reward_errors"] == 7
    assert summary["reward_error_kinds"] == [
        {"env": "units", "error": "reward of U failed: KeyError: 'dozen'", "count": 6},
        {"env": "units", "error": "reward of U is not finite: nan", "count": 1},
    ]
    text = path.read_text()
    assert text.count("(first of its kind, counted from now on): reward of U failed: KeyError: 'dozen'") == 1
    assert text.count("(first of its kind, counted from now on): reward of U is not finite: nan") == 1
    lines = [parse_reward_errors(line) for line in text.splitlines() if REWARD_ERRORS_MARKER in line]
    assert lines[-1] == {"id": stats.reward_error_kinds.id, "errors": summary["reward_error_kinds"]}
    # each new message goes out at once; repeats wait for REWARD_ERRORS_EVERY_S or the report
    assert [sum(e["count"] for e in line["errors"]) for line in lines] == [1, 7]


def test_one_message_per_task_does_not_grow_without_bound(actor_log) -> None:
    actor_log(0)
    errors = RewardErrors()
    for i in range(MAX_REWARD_ERROR_KINDS + 30):
        errors.add("units", f"KeyError: 'unit{i}'")
    listed = errors.as_list()
    assert len(listed) == MAX_REWARD_ERROR_KINDS + 1
    assert {"env": "units", "error": OTHER_REWARD_ERRORS, "count": 30} in listed
    assert errors.total() == MAX_REWARD_ERROR_KINDS + 30


def test_the_run_reads_every_actor_process_and_says_each_error_once(actor_log, tmp_path: Path, caplog) -> None:
    from agentrl.run.report import RunState, progress_line, progress_table

    cfg = load_config(EXAMPLE)
    state = RunState(tmp_path)
    first, restarted, other = RewardErrors(), RewardErrors(), RewardErrors()
    path = actor_log(0)
    first.add("calc", "KeyError: 'dozen'")
    first.add("calc", "KeyError: 'dozen'")
    first.write(force=True)
    with path.open("a") as f:  # a killed process's last line, cut short: not read; the next process appends to it
        f.write(f"x INFO agentrl.actors: {REWARD_ERRORS_MARKER}" + '{"id": "dead", "errors": [{"env": "calc", "er')
    with caplog.at_level(logging.WARNING, logger="agentrl.run"):
        state.read_reward_errors()
        assert state.reward_errors == [{"env": "calc", "error": "KeyError: 'dozen'", "count": 2}]
        restarted.add("calc", "KeyError: 'dozen'")  # the same log: a restarted actor, its own id
        actor_log(1)
        other.add("search", "ValueError: [no] answer")
        other.add("search", "ValueError: [no] answer")
        other.write(force=True)
        state.read_reward_errors()
        state.read_reward_errors()
    assert state.reward_errors == [
        {"env": "calc", "error": "KeyError: 'dozen'", "count": 3},
        {"env": "search", "error": "ValueError: [no] answer", "count": 2},
    ]
    said = [r.getMessage() for r in caplog.records if r.name == "agentrl.run"]
    assert said == [
        "actors: reward error in env calc: KeyError: 'dozen' (episodes scored 0; counted in summary.json "
        "reward_errors)",
        "actors: reward error in env search: ValueError: [no] answer (episodes scored 0; "
        "counted in summary.json reward_errors)",
    ]
    assert " | reward errors 5" in progress_line(state, cfg)

    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(progress_table(state, cfg))  # the message's [brackets] are text, not markup
    assert re.search(
        r"reward errors +│ 5 episodes scored 0 \(2 kinds; most: 3 × env calc: KeyError: 'dozen'\)",
        console.export_text(),
    ), console.export_text()


def test_summary_holds_the_reward_errors(actor_log, tmp_path: Path) -> None:
    from agentrl.run.report import RunState, summarize

    actor_log(0)
    errors = RewardErrors()
    errors.add("calc", "KeyError: 'dozen'")
    summary = summarize(RunState(tmp_path), load_config(EXAMPLE), tmp_path)
    assert summary["reward_errors"] == [{"env": "calc", "error": "KeyError: 'dozen'", "count": 1}]
    assert json.loads((tmp_path / "summary.json").read_text())["reward_errors"] == summary["reward_errors"]


def test_evaluations_are_logged_at_the_step_they_describe() -> None:
    from agentrl.run.report import summary_metrics

    def result(rate: float, **extra) -> dict:
        return {"n": 4, "success_rate": rate, "reward_mean": rate, "success_by_group": {}, **extra}

    summary = {
        "eval_before": result(0.25),
        "evals_during_training": [result(0.5, policy_version=10)],
        "eval_after": result(0.75),
        "success_rise": 0.5,
        "learner_steps": 20,
        "reward_errors": [{"env": "calc", "error": "KeyError", "count": 7}],
    }
    steps = {step: metrics for step, metrics in summary_metrics(summary)}
    assert sorted(steps) == [0, 10, 20]
    assert steps[0]["eval_before/success_rate"] == 0.25 and not any(k.startswith("eval_after") for k in steps[0])
    assert steps[10]["eval/success_rate"] == 0.5
    assert steps[20]["eval_after/success_rate"] == 0.75 and steps[20]["eval/success_rise"] == 0.5
    assert steps[20]["actors/reward_errors"] == 7


@pytest.mark.parametrize(
    "override, key, suggestion",
    [
        ("learner.lrr=0.1", "learner.lrr", "learner.lr"),
        ("sft.num_demos=5", "sft.num_demos", "sft.num_demonstrations"),
        ("lerner.lr=0.1", "lerner", "learner"),  # an unknown section
        ("env.clss=x:Y", "env.clss", "env.cls"),
        ("learner.lora.rnk=4", "learner.lora.rnk", "learner.lora.rank"),
    ],
)
def test_unknown_keys_get_did_you_mean(override: str, key: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == f"unknown key '{key}' in the defaults (with overrides); did you mean '{suggestion}'?"


def test_unknown_keys_in_envs_entries_and_far_from_any_field(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[[envs]]\nclss = "a:B"\n[learner]\nlearning_rate = 1e-3\n')
    with pytest.raises(ConfigError) as e:
        load_config(config)
    assert f"unknown key 'envs.0.clss' in {config}; did you mean 'envs.0.cls'?" in str(e.value)
    assert f"unknown key 'learner.learning_rate' in {config}" in str(e.value)  # nothing close: no guess


def test_every_commands_help_keeps_its_bracketed_text() -> None:
    """Rich markup eats ``[envs]``; each command's help shows every bracketed word of its docstring
    and options as written (``\\[`` in a docstring is the escape)."""
    import inspect

    from typer.testing import CliRunner

    from agentrl.cli import app

    runner = CliRunner()
    checked = 0
    for command in app.registered_commands:
        name = command.name or command.callback.__name__
        texts = [inspect.getdoc(command.callback) or ""]
        texts += [
            getattr(a, "help", "") or ""
            for p in inspect.signature(command.callback).parameters.values()
            for a in getattr(p.annotation, "__metadata__", ())
        ]
        words = {w.replace("\\[", "[") for t in texts for w in re.findall(r"(?:\\?\[)+[^\]\s]*\]+", t)}
        shown = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"}).output
        for word in words:
            checked += 1
            assert word in shown, f"agentrl {name} --help lost {word!r}:\n{shown}"
    assert checked >= 2  # make-demos' [[envs]] and serve-search's [...] at least


def test_a_changed_env_or_sft_sets_the_old_folder_aside(tmp_path: Path) -> None:
    from agentrl.run.fingerprint import FINGERPRINT_FILE, run_fingerprint, supersede_changed_run

    env_file = tmp_path / "units_env.py"
    env_file.write_text("from agentrl.envs.calculator import CalculatorEnv as Units\n")
    cfg = load_config(EXAMPLE, [f"env.cls={env_file}:Units"])
    run_dir = tmp_path / "run"
    assert supersede_changed_run(cfg, run_dir) == ""  # a new folder
    (run_dir / "sft" / "model").mkdir(parents=True)
    (run_dir / "sft" / "model" / "config.json").write_text("{}")
    (run_dir / "learner_status.json").write_text('{"warning": "an old learner\'s warning"}')
    (run_dir / FINGERPRINT_FILE).write_text(json.dumps(run_fingerprint(cfg)))

    assert supersede_changed_run(cfg, run_dir) == ""  # the same config and code: a restart reuses it
    assert (run_dir / "sft" / "model" / "config.json").exists()

    env_file.write_text(env_file.read_text() + "# edited\n")
    said = supersede_changed_run(load_config(EXAMPLE, [f"env.cls={env_file}:Units", "sft.epochs=9"]), run_dir)
    archive = next(run_dir.glob("superseded-*"))
    assert said == (
        f"env code, sft changed since this folder's last run: its warm start, checkpoints, journal, logs "
        f"and metrics moved to {archive}; this run starts afresh, with a new warm start"
    )
    assert sorted(p.name for p in run_dir.iterdir()) == [archive.name]  # nothing old left to reuse or replay
    assert (archive / "sft" / "model" / "config.json").exists() and (archive / "learner_status.json").exists()

    (run_dir / FINGERPRINT_FILE).write_text(json.dumps(run_fingerprint(cfg)))
    said = supersede_changed_run(load_config(EXAMPLE, [f"env.cls={env_file}:Units", "env.kwargs.max_ops=1"]), run_dir)
    assert said.startswith("env changed since") and len(list(run_dir.glob("superseded-*"))) == 2


def test_an_env_file_imports_its_sibling_module(tmp_path: Path) -> None:
    from agentrl.envs import load_env

    (tmp_path / "newcomer_unit_table_7.py").write_text("FACTOR = 12\n")
    (tmp_path / "dozen_env.py").write_text(
        "from newcomer_unit_table_7 import FACTOR\n"
        "from agentrl.envs.calculator import CalculatorEnv\n"
        "class Dozen(CalculatorEnv):\n    factor = FACTOR\n"
    )
    env = load_env(f"{tmp_path / 'dozen_env.py'}:Dozen")
    assert env.factor == 12


def test_mlflow_holds_each_evaluation_at_its_step(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from agentrl.run.report import create_mlflow_run, log_to_mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = create_mlflow_run(load_config(EXAMPLE, [f"tracking.uri={uri}"]), tmp_path)
    cfg = load_config(EXAMPLE, [f"tracking.uri={uri}", f"tracking.run_id={run_id}"])
    result = {"n": 4, "success_rate": 0.5, "reward_mean": 0.5, "success_by_group": {}}
    summary = {
        "eval_before": result,
        "evals_during_training": [{**result, "policy_version": 6}],
        "eval_after": result,
        "success_rise": 0.0,
        "learner_steps": 12,
        "reward_errors": [],
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    log_to_mlflow(cfg, tmp_path, summary)
    client = MlflowClient(tracking_uri=uri)
    steps = {
        name: [m.step for m in client.get_metric_history(run_id, name)]
        for name in (
            "eval_before/success_rate",
            "eval/success_rate",
            "eval_after/success_rate",
            "eval/success_rise",
            "actors/reward_errors",
        )
    }
    assert steps == {
        "eval_before/success_rate": [0],
        "eval/success_rate": [6],
        "eval_after/success_rate": [12],
        "eval/success_rise": [12],
        "actors/reward_errors": [12],
    }


def test_the_warm_starts_progress_is_logged_while_it_runs(tmp_path: Path, caplog) -> None:
    import trio
    import trio.testing

    from agentrl.run.report import PLAIN_LINE_S
    from agentrl.run.stages import _follow_sft

    log = tmp_path / "sft.log"
    log.write_text("12:00:01 [learner rank 0] INFO sft step 1/10 | nll 3.2000\n")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_follow_sft, log)
            await trio.sleep(PLAIN_LINE_S * 1.5)  # the mock clock jumps: no real waiting
            await trio.sleep(PLAIN_LINE_S)  # no new step: nothing said again
            with log.open("a") as f:
                f.write("12:00:09 [learner rank 0] INFO sft step 4/10 | nll 2.1000\n")
            await trio.sleep(PLAIN_LINE_S)
            nursery.cancel_scope.cancel()

    with caplog.at_level(logging.INFO, logger="agentrl.run"):
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [r.getMessage() for r in caplog.records if r.name == "agentrl.run"] == [
        "sft: step 1/10 | nll 3.2000",
        "sft: step 4/10 | nll 2.1000",
    ]
