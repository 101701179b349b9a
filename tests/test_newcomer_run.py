"""A newcomer's env in a real ``agentrl run --no-live``: an env file that imports a module next to it
(loaded by path in the run, the learner and the actor processes), a reward that raises on about
half the tasks. The plain progress line is printed although the table is off; each distinct
reward error is logged once by the actor and said once by the run, and ``summary.json`` holds
it with its count, which matches the actors' own reports. A second run into the same folder
after the env file changed starts afresh instead of reusing the folder's state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._processes import stop_agentrl_run

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "calculator" / "config.toml"

HELPERS = 'BAD_ENDINGS = "02468ace"  # task ids ending in one of these: the reward raises\n'
FLAKY_ENV = """
from calc_helpers import BAD_ENDINGS  # a module next to this file

from agentrl.envs.calculator import CalculatorEnv


class FlakyCalc(CalculatorEnv):
    name = "flaky"

    async def reward(self, task, state, messages):
        if task.id[-1] in BAD_ENDINGS:
            raise KeyError("dozen")
        return await super().reward(task, state, messages)
"""
ERROR = "reward of FlakyCalc failed: KeyError: 'dozen'"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agentrl.models.builder import init_model

    return init_model(tmp_path_factory.mktemp("newcomer_model") / "tiny", "tiny")


def _run(env_file: Path, model: Path, run_dir: Path) -> tuple[int, str, str]:
    overrides = [
        f"env.cls={env_file}:FlakyCalc",
        f"model.path={model}",
        "sft.enabled=false",
        "learner.max_steps=2",
        "learner.groups_per_step=2",
        "actors.group_size=2",
        "actors.num_concurrent_episodes=8",
        "learner.dynamic_sampling=false",
        "actors.max_new_tokens_per_turn=24",
        "eval.num_tasks=4",
        "tracking.enabled=false",
        "learner.checkpoint_every_steps=0",
    ]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentrl",
            "run",
            str(EXAMPLE),
            "--no-live",
            "--run-dir",
            str(run_dir),
            *[x for o in overrides for x in ("-s", o)],
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        out, err = proc.communicate(timeout=420)
    finally:
        stop_agentrl_run(proc)  # too slow: every child stopped, none left behind
    return proc.returncode, out, err


def test_a_flaky_reward_is_visible_and_a_changed_env_starts_afresh(tiny_model: Path, tmp_path: Path) -> None:
    from agentrl.run.accounting import final_reports

    envs = tmp_path / "my_envs"
    envs.mkdir()
    (envs / "calc_helpers.py").write_text(HELPERS)
    env_file = envs / "flaky_calc.py"
    env_file.write_text(FLAKY_ENV)
    run_dir = tmp_path / "run"

    rc, out, err = _run(env_file, tiny_model, run_dir)
    assert rc == 0, out[-3000:] + err[-5000:]
    # --no-live: the plain progress line, as a run whose stdout is not a terminal prints it
    assert any(line.startswith("[") and " step " in line and "| policy v" in line for line in out.splitlines()), out
    summary = json.loads((run_dir / "summary.json").read_text())
    errors = summary["reward_errors"]
    assert [(e["env"], e["error"]) for e in errors] == [("flaky", ERROR)], errors
    reports = final_reports(run_dir)
    assert reports and errors[0]["count"] == sum(r["reward_errors"] for r in reports) > 0
    assert all(
        r["reward_error_kinds"] in ([], [{"env": "flaky", "error": ERROR, "count": r["reward_errors"]}])
        for r in reports
    )
    actor_log = (run_dir / "logs" / "actor0.log").read_text()
    assert actor_log.count(f"reward error in env flaky (first of its kind, counted from now on): {ERROR}") == 1
    assert err.count(f"actors: reward error in env flaky: {ERROR}") == 1  # the run says it once, when first seen
    assert any(f"reward error in env flaky: {ERROR}" in e for e in summary["events"])
    # the learner's GET /model_info every 2 s while it waits is not an INFO line in its log
    assert "HTTP Request" not in (run_dir / "logs" / "learner.log").read_text()

    # the same folder again, after the env file changed: the old state is set aside, not reused
    env_file.write_text(FLAKY_ENV.replace('"dozen"', '"dozens"'))
    rc, out, err = _run(env_file, tiny_model, run_dir)
    assert rc == 0, out[-3000:] + err[-5000:]
    superseded = list(run_dir.glob("superseded-*"))
    assert len(superseded) == 1 and (superseded[0] / "summary.json").exists()
    assert "env code changed since this folder's last run" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [e["error"] for e in summary["reward_errors"]] == ["reward of FlakyCalc failed: KeyError: 'dozens'"]
