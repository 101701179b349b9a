"""Tracking against a real SQLite store and a real ``mlflow server``, read back with MlflowClient."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.config import TrackingSection
from agentrl.net import free_port
from agentrl.tracking import NullTracker, Tracker, flatten, open_tracker

pytestmark = pytest.mark.timeout(180)

PARAMS = {"learner": {"lr": 3e-4, "clip_eps_low": 0.2}, "actors": {"group_size": 8}, "run": {"name": "t"}}


def log_a_run(tracker: Tracker, tmp: Path) -> Path:
    tracker.log_params(PARAMS)
    tracker.set_tags({"variant": "test"})
    for step in range(3):
        tracker.log_metrics({"loss": 1.0 / (step + 1), "reward/mean": 0.5 * step}, step=step)
    artifact = tmp / "resolved_config.toml"
    artifact.write_text("[learner]\nlr = 0.0003\n")
    tracker.log_artifact(artifact)
    tracker.log_json(
        {"step": 2, "episodes": [{"reward": 1.0, "messages": [{"role": "user", "content": "hi"}]}]},
        "samples/step_000002.json",
    )
    tracker.close()
    return artifact


def check_run(uri: str, run_id: str, artifact: Path, tmp: Path) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {
        "learner.lr": "0.0003",
        "learner.clip_eps_low": "0.2",
        "actors.group_size": "8",
        "run.name": "t",
    }
    assert run.data.tags["variant"] == "test"
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(0, 1.0), (1, 0.5), (2, 1 / 3)]
    assert run.data.metrics["reward/mean"] == 1.0
    assert sorted(f.path for f in client.list_artifacts(run_id)) == [artifact.name, "samples"]
    local = client.download_artifacts(run_id, artifact.name, str(tmp))
    assert Path(local).read_text() == artifact.read_text()
    local = client.download_artifacts(run_id, "samples/step_000002.json", str(tmp))
    assert json.loads(Path(local).read_text())["episodes"][0]["messages"] == [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def sqlite_run(tmp_path_factory):
    """One run logged to the default store; the database is reused by the server test."""
    tmp = tmp_path_factory.mktemp("sqlite")
    cwd = tmp / "cwd"
    cwd.mkdir()
    old = os.getcwd()
    os.chdir(cwd)  # artifacts must not land in the working directory
    try:
        run_dir = tmp / "run"
        tracker = open_tracker(TrackingSection(), run_dir, run_name="first")
        assert isinstance(tracker, Tracker)
        artifact = log_a_run(tracker, tmp)
    finally:
        os.chdir(old)
    assert not list(cwd.iterdir()), "nothing may be written to the working directory"
    return run_dir, tracker, artifact, tmp


def test_sqlite_store_under_the_run_dir(sqlite_run) -> None:
    run_dir, tracker, artifact, tmp = sqlite_run
    assert tracker.tracking_uri == f"sqlite:///{run_dir.resolve()}/mlflow.db"
    assert (run_dir / "mlflow.db").is_file()
    check_run(tracker.tracking_uri, tracker.run_id, artifact, tmp)
    from mlflow import MlflowClient

    run = MlflowClient(tracker.tracking_uri).get_run(tracker.run_id)
    assert run.info.run_name == "first"
    assert run.info.artifact_uri.startswith((run_dir.resolve() / "mlartifacts").as_uri())


def test_resume_keeps_params_and_reopens_the_run(sqlite_run, caplog) -> None:
    run_dir, first, _, _ = sqlite_run
    from mlflow import MlflowClient

    with pytest.raises(ValueError, match="cannot resume"):
        open_tracker(TrackingSection(), run_dir, resume_run_id="0" * 32)
    tracker = open_tracker(TrackingSection(), run_dir, resume_run_id=first.run_id)
    assert tracker.run_id == first.run_id
    client = MlflowClient(tracker.tracking_uri)
    assert client.get_run(first.run_id).info.status == "RUNNING"
    with caplog.at_level(logging.WARNING, logger="agentrl.tracking"):
        tracker.log_params({"learner": {"lr": 1e-3, "new_key": 1}})  # lr is immutable in MLflow
    assert "learner.lr" in caplog.text
    with pytest.raises(TypeError, match="'loss'"):
        tracker.log_metrics({"loss": "high"}, step=3)
    with pytest.raises(RuntimeError), tracker:
        raise RuntimeError("training crashed")
    run = client.get_run(first.run_id)
    assert run.info.status == "FAILED"
    assert run.data.params["learner.lr"] == "0.0003" and run.data.params["learner.new_key"] == "1"


def test_a_json_artifact_that_fails_warns(tmp_path, caplog) -> None:
    tracker = open_tracker(TrackingSection(), tmp_path / "run")
    with pytest.raises(ValueError, match=".json"):
        tracker.log_json({}, "samples/step_1.txt")
    artifacts = tmp_path / "run" / "mlartifacts"
    if artifacts.exists():
        shutil.rmtree(artifacts)
    artifacts.write_text("a file where the artifact store should be")
    with caplog.at_level("WARNING", logger="agentrl.tracking"):
        tracker.log_json({"step": 1}, "samples/step_000001.json")  # the store fails: training goes on
    assert "MLflow log_dict failed" in caplog.text
    tracker.close()


def test_disabled_tracking_is_a_null_object(tmp_path) -> None:
    tracker = open_tracker(TrackingSection(enabled=False), tmp_path / "run")
    assert isinstance(tracker, NullTracker) and tracker.run_id is None
    tracker.log_params(PARAMS)
    tracker.log_metrics({"loss": 1.0}, step=0)
    tracker.log_artifact(tmp_path / "missing")
    tracker.log_json({"a": 1}, "samples/step_000001.json")
    tracker.set_tags({"a": 1})
    tracker.close()
    assert not (tmp_path / "run").exists()


def test_flatten() -> None:
    assert flatten({"a": {"b": {"c": 1}, "d": 2}, "e": [1], "f": {}}) == {"a.b.c": 1, "a.d": 2, "e": [1], "f": {}}


# ------------------------------------------------------------------ a real mlflow server


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"mlflow server did not answer {url} within {timeout_s} s")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _stop_group(proc: subprocess.Popen, timeout_s: float = 1.0) -> None:
    """SIGTERM the server's process group, wait for every member, SIGKILL what is left."""
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        proc.poll()  # reap the leader
        time.sleep(0.1)
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(5)


@pytest.fixture(scope="module", autouse=True)
def mlflow_server(tmp_path_factory):
    """``mlflow server`` in its own process group, started first so that it boots (imports,
    schema migrations: tens of seconds on a busy 2-core machine) while the SQLite tests run."""
    tmp = tmp_path_factory.mktemp("server")
    port = free_port()
    log_path = tmp / "server.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server",
             "--backend-store-uri", f"sqlite:///{tmp / 'server.db'}",
             "--artifacts-destination", str(tmp / "artifacts"),
             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp,
            # MLflow 3's job runner adds eight processes (huey workers) that these tests do not use
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}", proc, tmp
    finally:
        _stop_group(proc)
    assert not _group_alive(proc.pid), "the server's process group is gone"


def test_real_mlflow_server(mlflow_server, tmp_path) -> None:
    uri, proc, server_dir = mlflow_server
    try:
        _wait_http(f"{uri}/health", proc, timeout_s=120)
    except (RuntimeError, TimeoutError) as e:
        raise AssertionError(f"{e}\n{(server_dir / 'server.log').read_text()[-3000:]}") from None
    tracker = open_tracker(TrackingSection(uri=uri, experiment="served"), tmp_path / "run", run_name="served")
    assert isinstance(tracker, Tracker)
    artifact = log_a_run(tracker, tmp_path)
    check_run(uri, tracker.run_id, artifact, tmp_path / "download")
    # the server, not this process, stored the artifact, under its --artifacts-destination
    assert list((server_dir / "artifacts").rglob(artifact.name))
    assert not (tmp_path / "run" / "mlflow.db").exists()
