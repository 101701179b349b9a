"""The quickstart, shortened, learning against a real SGLang 0.5.23 server that ``agentrl run`` starts itself
(``engine.backend = "sglang"``, ``engine.sglang_python``: SGLang's CPU flags, the ``sgl_kernel`` stand-in and
a KV pool sized from the run), every weight push over gloo into SGLang.

Shortened for time (SGLang's CPU path made a learner step ~18 s): the warm start is the quickstart's own SFT,
built once per session (``quickstart_warm_start``) and copied in as ``<run>/sft/model``, which ``agentrl run``
reuses; 4 learner steps of 8 groups (the quickstart's step size: 34% -> 83.5% greedy in 2 steps on the embedded
engine, docs/performance.md "Time to skill"); 100 held-out tasks before and after instead of 200, so a rise of
20 points is 4 standard errors of either evaluation.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._processes import stop_agentrl_run
from tests.conftest_sglang import log_tail, require, sglang_python

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "calculator" / "config.toml"
RUN_S = 1200  # the whole `agentrl run` (SGLang start, two evaluations, 4 steps); generous for a loaded machine


@pytest.mark.timeout(1800)  # the warm start (~70 s idle, 10 min on a loaded machine) + the run
def test_shortened_quickstart_learns_against_a_real_sglang_server(quickstart_warm_start, engine_model, tmp_path):
    from agentrl.engine.launch import sglang_problem

    python = sglang_python()
    require(sglang_problem(python))
    run_dir = tmp_path / "run"
    shutil.copytree(quickstart_warm_start, run_dir / "sft" / "model")
    argv = [
        sys.executable,
        "-m",
        "agentrl",
        "run",
        str(EXAMPLE),
        "--run-dir",
        str(run_dir),
        "-s",
        "engine.backend=sglang",
        "-s",
        f"engine.sglang_python={python}",
        "-s",
        f"model.path={engine_model}",
        "-s",
        "learner.max_steps=4",
        "-s",
        "eval.num_tasks=100",
        "-s",
        "tracking.enabled=false",
    ]
    log = tmp_path / "agentrl-run.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            proc.wait(RUN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"agentrl run did not finish within {RUN_S} s; its output:\n{log_tail(log)}")
        finally:
            stop_agentrl_run(proc)
    engine_log = run_dir / "logs" / "engine0.log"
    assert proc.returncode == 0, f"agentrl run failed:\n{log_tail(log)}\nengine0.log:\n{log_tail(engine_log)}"

    summary = json.loads((run_dir / "summary.json").read_text())
    assert any("reusing the warm-started model" in e for e in summary["events"])
    assert "The server is fired up and ready to roll!" in engine_log.read_text(errors="replace")  # SGLang's own words
    assert summary["learner_steps"] == 4
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["n"] == after["n"] == 100 and before["n_failed"] == after["n_failed"] == 0
    assert summary["success_rise"] >= 0.20, (before["success_rate"], after["success_rate"])
    assert len(summary["policy_versions_seen"]) >= 2
