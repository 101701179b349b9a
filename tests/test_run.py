"""`agentrl run` end to end with real processes: warm start, engine, learner, actors, MLflow.

The shortened quickstart (the quickstart's own warm start, which is deterministic on a CPU,
then 8 instead of 20 asynchronous GRPO steps with max_staleness 1; 200 held-out tasks) must
raise greedy success by at least 10 points and consume data from
more than one policy version; the other runs check failure handling, stop signals, the CPU
examples and a run of two envs. The live view and ``summary.json`` are tested without processes in
tests/test_run_report.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from agentrl.config import load_config
from agentrl.run.stages import run
from tests._processes import stop_agentrl_run

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "calculator" / "config.toml"

pytestmark = pytest.mark.slow  # every test here starts real processes: engines, a learner, actors


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agentrl.models.builder import init_model

    return init_model(tmp_path_factory.mktemp("run_model") / "tiny", "tiny")


def _short(model: Path, *extra: str):
    return load_config(
        EXAMPLE,
        [
            f"model.path={model}",
            "sft.num_demonstrations=160",
            "sft.epochs=1.0",
            "sft.batch_tokens=4096",
            "learner.max_steps=4",
            "learner.groups_per_step=4",
            "actors.group_size=4",
            "actors.num_concurrent_episodes=32",
            "learner.dynamic_sampling=false",
            "learner.max_staleness=1",
            "actors.max_staleness=1",
            "eval.num_tasks=16",
            "actors.max_new_tokens_per_turn=32",
            *extra,
        ],
    )


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _start_strict_engine(cfg, model: Path, log_dir: Path, env: dict[str, str]):
    """An embedded engine started the way users start SGLang by hand, with what real SGLang does
    that a naive client trips over: no --weight-version (it reports "default"), --tp-size 2 (two
    ranks in the weight group), an api key and an admin key, and a build without
    /begin_weight_update and /end_weight_update (404)."""
    from agentrl.engine.launch import EngineProcess, engine_args
    from agentrl.net import free_port

    flags = engine_args(
        "embedded",
        device="cpu",
        max_running_requests=cfg.engine.max_running_requests,
        max_context_tokens=cfg.engine.max_context_tokens,
        num_threads=1,
    )
    i = flags.index("--weight-version")
    flags = flags[:i] + flags[i + 2 :] + ["--tp-size", "2", "--disable-weight-update-bracket"]
    return EngineProcess(
        str(model), free_port(), extra=flags, log_path=log_dir / "strict-engine.log", env={**os.environ, **env}
    ).start(wait_s=240)


@pytest.mark.timeout(900)
def test_shortened_quickstart_learns_against_an_sglang_strict_engine(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quickstart_warm_start: Path
) -> None:
    """The quickstart's own warm start, then 8 RL steps of RLOO against an engine that behaves like a
    hand-started SGLang server (see _start_strict_engine): the run sets the version, forms a
    weight group with both TP ranks, skips the missing routes, sends the keys, and learns by at least
    20 points (GRPO, the quickstart's own, is the real-SGLang tier's: tests/test_sglang_quickstart.py)."""
    run_dir = tmp_path / "run"
    keys = {"AGENTRL_ENGINE_API_KEY": "api-key-for-the-test", "AGENTRL_ENGINE_ADMIN_API_KEY": "admin-key-for-the-test"}
    for name, value in keys.items():
        monkeypatch.setenv(name, value)  # every child of the run reads its keys from these
    sets = [f"model.path={tiny_model}", "learner.max_steps=8", "eval.num_tasks=200", "learner.advantage=rloo"]
    cfg = load_config(EXAMPLE, sets)
    assert cfg.learner.max_staleness >= 1
    warm = run_dir / "sft" / "model"  # `agentrl run` reuses a warm start it finds there
    shutil.copytree(quickstart_warm_start, warm)  # the quickstart's SFT of the same tiny model, once per session
    engine = _start_strict_engine(cfg, warm, tmp_path, keys)
    try:
        assert (
            httpx.get(
                engine.url + "/model_info",
                timeout=10,
                headers={"Authorization": f"Bearer {keys['AGENTRL_ENGINE_API_KEY']}"},
            ).json()["weight_version"]
            == "default"
        )
        cfg = load_config(EXAMPLE, [*sets, f'engine.urls=["{engine.url}"]'])
        summary = run(cfg, run_dir, live_display=False)
        assert httpx.post(engine.url + "/pause_generation", json={"mode": "abort"}, timeout=10).status_code == 401
    finally:
        engine.stop()
    assert "reusing the warm-started model" in " ".join(summary["events"])

    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["learner_steps"] == summary["learner_steps"] == 8
    before, after = on_disk["eval_before"], on_disk["eval_after"]
    assert before["n"] == after["n"] == 200 and before["n_failed"] == after["n_failed"] == 0
    assert on_disk["success_rise"] == pytest.approx(after["success_rate"] - before["success_rate"])
    assert on_disk["success_rise"] >= 0.20, (before, after)
    # what the demonstrations left undone is what RL fixed: the multi-operator questions
    multi = lambda e: e["success_by_group"]["2 ops"] + e["success_by_group"]["3 ops"]  # noqa: E731
    assert multi(after) > multi(before) + 0.2
    assert on_disk["warm_start"]["enabled"] and on_disk["warm_start"]["env_kwargs"]["demo_shortcut_rate"] > 0
    assert (run_dir / "sft" / "model" / "config.json").exists()
    for child in ("learner", "actor0"):
        assert (run_dir / "logs" / f"{child}.log").stat().st_size > 0
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "has no /begin_weight_update (SGLang before 0.5.23?)" in learner_log  # said once, then skipped
    assert learner_log.count("has no /begin_weight_update") == 1
    # the engines served several policy versions, and the learner consumed off-policy data
    assert len(on_disk["policy_versions_seen"]) >= 3
    rows = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    versions_consumed = {
        int(r["policy_version"]) - lag for r in rows for lag in range(0, 3) if r.get(f"staleness/{lag}", 0) > 0
    }
    assert len(versions_consumed) >= 2
    from agentrl.learner.loop import groups_for_step

    trained = sum(
        groups_for_step(s, cfg.learner.groups_per_step, cfg.learner.first_groups_per_step) for s in range(1, 9)
    )
    assert on_disk["groups_produced"]["groups_delivered"] >= on_disk["groups_consumed"] >= trained
    # one MLflow run holds the learner's metrics and the supervisor's evaluations
    from mlflow import MlflowClient

    cfg = load_config(run_dir / "config.toml")
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    mlrun = client.get_run(cfg.tracking.run_id)
    assert "eval_before/success_rate" in mlrun.data.metrics and "eval_after/success_rate" in mlrun.data.metrics
    assert mlrun.data.metrics["eval/success_rise"] == pytest.approx(on_disk["success_rise"])
    assert mlrun.data.metrics["eval_after/success/3 ops"] == pytest.approx(after["success_by_group"]["3 ops"])
    assert "loss/total" in mlrun.data.metrics
    assert mlrun.info.status == "FINISHED"


@pytest.mark.timeout(900)
def test_ppo_with_a_critic_learns_the_quickstart(tiny_model: Path, tmp_path: Path, quickstart_warm_start: Path) -> None:
    """PPO with a critic (GAE over model tokens, a zero-initialised value head) from the quickstart's
    warm start: 8 steps of a real run raise greedy success by at least 20 points (33% to 82% when measured),
    and the critic learns: its values start at exactly 0 and rise towards the returns."""
    run_dir = tmp_path / "run"
    shutil.copytree(quickstart_warm_start, run_dir / "sft" / "model")
    sets = ["learner.max_steps=8", "learner.algorithm=ppo", "learner.advantage=gae", "tracking.enabled=false"]
    summary = run(load_config(EXAMPLE, [f"model.path={tiny_model}", *sets]), run_dir, live_display=False)
    assert summary["learner_steps"] == 8
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["n"] == after["n"] == 200 and after["n_failed"] == 0
    assert after["success_rate"] - before["success_rate"] >= 0.20, (before, after)
    rows = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    critic = [r for r in rows if "critic/value_loss" in r]
    assert len(critic) == 8
    values = [r["critic/value_mean"] for r in critic]
    assert values[0] == pytest.approx(0.0, abs=1e-6) and values[-1] > 0.01 and sum(values[4:]) > sum(values[:4]), values


def test_cli_run_reports_a_failing_child_with_exit_1_and_stops_the_others(tiny_model: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentrl",
            "run",
            str(EXAMPLE),
            "--no-live",
            "--run-dir",
            str(tmp_path / "run"),
            "-s",
            f"model.path={tiny_model}",
            "-s",
            "sft.enabled=false",
            "-s",
            "learner.device=cuda",
            "-s",
            "tracking.enabled=false",
            "-s",
            "eval.num_tasks=4",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "0,1"},  # a pretend GPU for the learner
    )
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        stop_agentrl_run(proc)  # too slow: every child stopped, none left behind
    assert proc.returncode == 1, err[-2000:]
    assert "learner exited with status" in err and "end of its log" in err
    events = json.loads((tmp_path / "run" / "summary.json").read_text())["events"]
    assert any("learner: failed" in e for e in events)
    pids = [int(line.split("pid ")[1].rstrip(")")) for line in events if "started (pid" in line]
    assert pids and not any(_alive(p) for p in pids)


@pytest.mark.parametrize("example", ["search_qa", "code", "custom_env"])  # reasoning_gym: test_env_reasoning_gym.py
def test_cpu_examples_run_a_few_steps(example: str, tiny_model: Path, tmp_path: Path) -> None:
    cfg = load_config(
        ROOT / "examples" / example / "config.toml",
        [
            f"model.path={tiny_model}",
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
        ],
    )
    cwd = os.getcwd()
    os.chdir(ROOT)  # example paths are relative to the repository root
    try:
        summary = run(cfg, tmp_path / "run", live_display=False)
    finally:
        os.chdir(cwd)
    assert summary["learner_steps"] == 2
    assert summary["eval_after"]["n"] + summary["eval_after"]["n_failed"] == 4
    assert summary["groups_produced"]["groups_delivered"] >= 4
    if example == "search_qa":  # the run started the retrieval server and the episodes searched through it
        assert (tmp_path / "run" / "logs" / "search.log").exists()


@pytest.mark.parametrize("signum, wait_for", [(15, "learner.log"), (1, "engine0.log")])
def test_sigterm_and_sighup_stop_a_real_run_like_ctrl_c(
    signum: int, wait_for: str, tiny_model: Path, tmp_path: Path
) -> None:
    """SLURM, Kubernetes and systemd stop jobs with SIGTERM (terminals hang up with SIGHUP): every
    child is stopped, summary.json is written, the exit status is 128 + the signal."""
    import signal
    import time

    run_dir = tmp_path / "run"
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
            "-s",
            f"model.path={tiny_model}",
            "-s",
            "sft.enabled=false",
            "-s",
            "tracking.enabled=false",
            "-s",
            "eval.num_tasks=4",
            "-s",
            "learner.max_steps=1000",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "logs" / wait_for).exists():  # the stage to interrupt has started
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.2)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        stop_agentrl_run(proc)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err[-2000:]
    assert f"stopped by {name}: every process was stopped" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert any(f"{name} received" in e for e in summary["events"])
    pids = [int(line.split("pid ")[1].rstrip(")")) for line in summary["events"] if "started (pid" in line]
    assert pids and not any(_alive(p) for p in pids)


MIXED = """
[run]
name = "mixed"
torch_num_threads = 1
[engine]
max_context_tokens = 256
max_running_requests = 64
[actors]
num_concurrent_episodes = 16
group_size = 4
max_new_tokens_per_turn = 24
max_staleness = 0          # synchronous: each step waits for exactly the groups its budget started
[[envs]]
cls = "agentrl.envs.calculator:CalculatorEnv"
name = "calc"
max_turns = 3
max_total_tokens = 256
kwargs = { max_ops = 2 }
[[envs]]
cls = "examples/openai_agent/calculator_agent.py:CalculatorAgentEnv"
max_turns = 3
max_total_tokens = 256
kwargs = { max_ops = 2 }
[learner]
max_steps = 2
groups_per_step = 4        # the actor's first four draws (seed 0): calc, agent, calc, calc
max_staleness = 0
dynamic_sampling = false
checkpoint_every_steps = 0
[sft]
enabled = false
[eval]
num_tasks = 4
"""


@pytest.mark.timeout(600)
def test_a_run_mixes_the_calculator_and_its_agent_env_and_reports_each(tiny_model: Path, tmp_path: Path) -> None:
    """`agentrl run` with [[envs]]: agentrl's own calculator env next to the Agents SDK agent env; both
    train in one learner, and evaluations, summary, learner metrics and MLflow report each env."""
    config = tmp_path / "mixed.toml"
    config.write_text(MIXED)
    cfg = load_config(config, [f"model.path={tiny_model}"])
    cwd = os.getcwd()
    os.chdir(ROOT)  # the agent env's path is relative to the repository root
    try:
        summary = run(cfg, tmp_path / "run", live_display=False)
    finally:
        os.chdir(cwd)
    assert summary["learner_steps"] == 2
    for when in ("eval_before", "eval_after"):
        by_env = summary[when]["by_env"]
        assert set(by_env) == {"calc", "calculator-agent"}
        assert (
            all(r["n"] + r["n_failed"] == 4 for r in by_env.values())
            and summary[when]["n"] == 8 - summary[when]["n_failed"]
        )
    assert set(summary["success_rise_by_env"]) == {"calc", "calculator-agent"}
    rows = [json.loads(line) for line in (tmp_path / "run" / "learner_metrics.jsonl").read_text().splitlines()]
    received = {env: rows[-1].get(f"env/{env}/received", 0) for env in ("calc", "calculator-agent")}
    assert all(n >= 1 for n in received.values()), received  # both envs' groups reached the learner
    assert sum(received.values()) == rows[-1]["data/received"]
    batches = [json.loads(line) for line in (tmp_path / "run" / "learner_batches.jsonl").read_text().splitlines()]
    assert len(batches) == 2
    from mlflow import MlflowClient

    planned = load_config(tmp_path / "run" / "config.toml")
    metrics = MlflowClient(tracking_uri=planned.tracking.uri).get_run(planned.tracking.run_id).data.metrics
    for env in ("calc", "calculator-agent"):
        assert f"eval_after/env/{env}/success_rate" in metrics and f"env/{env}/received" in metrics
        assert f"eval/env/{env}/success_rise" in metrics
