"""The real-SGLang tier (marker ``sglang``): SGLang 0.5.23 itself, on the CPU, started by agentrl's own
launch code (``agentrl.engine.launch``: ``engine_args(..., on_cpu=True)``, ``sglang_cpu_env``, ``EngineProcess``).

* ``sglang_server``: ONE real server per session (each costs ~25 s of start-up and ~1 GB) on the tiny model of
  ``engine_model``, with ``--api-key``, ``--admin-api-key`` and ``--weight-version 0``. Tests leave it as they
  found it: unpaused, the original weights, version "0".
* ``embedded_twin``: the embedded engine with the same keys and version, so that the tests parametrised over
  ``engine`` (``["embedded", "sglang"]``) hold both to one expectation; where they differ, SGLang is right.
* ``start_sglang``: a further server, for a test that needs one of its own (the router test).
* ``quickstart_warm_start``: the quickstart's SFT, run once per session for the tests that learn.

Where SGLang comes from: ``$AGENTRL_SGLANG_PYTHON``, else ``<repo>/.venv-sglang/bin/python`` (built by
``AGENTRL_SGLANG=1 bash scripts/install.sh``). When it is missing or the server does not start, the tier skips
with the reason; with ``CI=true`` it fails with the reason and the server log's tail (CI must run it).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
API_KEY, ADMIN_KEY = "api-" + secrets.token_hex(8), "admin-" + secrets.token_hex(8)
START_S = 300.0  # an idle 2-core machine starts it in ~25 s; a loaded one took 200 s (imports in two processes)
KV_TOKENS = 16384  # --max-total-tokens: enough for every request the tests run at once
FLAGS = dict(max_running_requests=64, max_context_tokens=1024, num_threads=1)


def sglang_python() -> str:
    return os.environ.get("AGENTRL_SGLANG_PYTHON") or str(ROOT / ".venv-sglang" / "bin" / "python")


def require(reason: str | None) -> None:
    """Skip with ``reason`` locally; fail in CI, which must run this tier."""
    if reason is None:
        return
    if IN_CI:
        pytest.fail(f"CI must run the real-SGLang tier: {reason}", pytrace=False)
    pytest.skip(reason)


def log_tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


@dataclass
class Engine:
    """One running server of either kind, with its keys, and what the tests ask of it."""

    kind: str  # "embedded" | "sglang"
    url: str
    process: Any  # agentrl.engine.launch.EngineProcess
    api_key: str = API_KEY
    admin_key: str = ADMIN_KEY
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=120))

    def headers(self, admin: bool = False) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key if admin else self.api_key}"}

    def get(self, path: str, *, admin: bool = False) -> httpx.Response:
        return self.http.get(self.url + path, headers=self.headers(admin))

    def post(self, path: str, body: dict | None = None, *, admin: bool = False) -> httpx.Response:
        return self.http.post(self.url + path, json=body if body is not None else {}, headers=self.headers(admin))

    def control(self, path: str, body: dict | None = None) -> httpx.Response:
        """An admin route, which must answer 200."""
        r = self.post(path, body, admin=True)
        assert r.status_code == 200, (self.kind, path, r.status_code, r.text)
        return r

    def generate(self, body: dict) -> dict:
        r = self.post("/generate", body)
        assert r.status_code == 200, (self.kind, r.status_code, r.text)
        return r.json()

    def version(self) -> str:
        return str(self.get("/model_info").json()["weight_version"])

    def reset(self) -> None:
        """As the session left it: generating, version "0" (a test that changes weights restores them itself)."""
        self.control("/continue_generation")
        if self.version() != "0":
            self.control("/update_weight_version", {"new_version": "0", "abort_all_requests": False})


def start_sglang(
    model: Path,
    log_path: Path,
    *,
    api_key: str = API_KEY,
    admin_key: str = ADMIN_KEY,
    extra: tuple[str, ...] = (),
):
    """A real SGLang server on the CPU, started by agentrl's launch code; skips (fails in CI) when it cannot start."""
    from agentrl.engine.launch import (
        EngineLaunchError,
        EngineProcess,
        engine_args,
        sglang_cpu_env,
        sglang_problem,
        wait_ready,
    )
    from agentrl.net import free_port

    python = sglang_python()
    require(sglang_problem(python))
    args = engine_args(
        "sglang",
        weight_version="0",
        api_key=api_key,
        admin_api_key=admin_key,
        on_cpu=True,
        max_total_tokens=KV_TOKENS,
        **FLAGS,
    )
    proc = EngineProcess(
        str(model),
        free_port(),
        backend="sglang",
        python=python,
        extra=[*args, *extra],
        log_path=log_path,
        env={**os.environ, **sglang_cpu_env()},
    )
    proc.start(wait_s=0)
    try:
        wait_ready(proc.url, START_S, process=proc.process)
    except EngineLaunchError as e:
        proc.stop()
        require(f"the real SGLang server did not start ({e}); the end of {log_path}:\n{log_tail(log_path)}")
    return proc


_last_user: list = []  # the last collected test that uses sglang_server
_running: list = []  # the session's server while it runs


def uses_the_server(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return "sglang_server" in getattr(item, "fixturenames", ()) or (
        callspec is not None and callspec.params.get("engine") == "sglang"
    )


def pytest_collection_finish(session):
    _last_user[:] = [item for item in session.items if uses_the_server(item)][-1:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the session's server after the last test that uses it (and its own fixtures' teardown), not at the
    session's end: an idle SGLang scheduler busy-polls a whole core (measured: 100% of one), which every later
    test would lose. (``--sleep-on-idle`` stops that but made each request ~0.8 s: its poller waits up to 1 s.)"""
    try:
        return (yield)
    finally:
        if _last_user and item is _last_user[0]:
            for proc in _running:
                proc.stop()


@pytest.fixture(scope="session")
def sglang_server(engine_model, tmp_path_factory) -> Engine:
    log = tmp_path_factory.mktemp("sglang_logs") / "sglang.log"
    proc = start_sglang(engine_model, log)
    _running.append(proc)
    engine = Engine("sglang", proc.url, proc)
    yield engine
    engine.http.close()
    proc.stop()
    _running.remove(proc)


@pytest.fixture(scope="session")
def embedded_twin(engine_model, tmp_path_factory) -> Engine:
    from agentrl.engine.launch import EngineProcess
    from agentrl.net import free_port
    from tests.conftest_engine import ENGINE_FLAGS

    log = tmp_path_factory.mktemp("sglang_logs") / "embedded.log"
    proc = EngineProcess(
        str(engine_model),
        free_port(),
        log_path=log,
        extra=[*ENGINE_FLAGS, "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY],
    ).start(wait_s=240)
    engine = Engine("embedded", proc.url, proc)
    yield engine
    engine.http.close()
    proc.stop()


@pytest.fixture(params=["embedded", "sglang"])
def engine(request) -> Engine:
    """Each kind in turn, as the session left it; put back so after the test."""
    e: Engine = request.getfixturevalue("embedded_twin" if request.param == "embedded" else "sglang_server")
    e.reset()
    yield e
    e.reset()


@pytest.fixture(scope="session")
def quickstart_warm_start(engine_model, tmp_path_factory) -> Path:
    """The quickstart's own SFT warm start of ``engine_model`` (deterministic on a CPU), built once per
    session (~70 s): a test copies it to ``<run>/sft/model``, which ``agentrl run`` reuses."""
    out = tmp_path_factory.mktemp("quickstart_sft")
    model = out / "model"
    example = ROOT / "examples" / "calculator" / "config.toml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrl",
            "sft",
            "-c",
            str(example),
            "-s",
            f"model.path={engine_model}",
            "-s",
            f"run.run_dir={out}",
            "-s",
            f"sft.output_dir={model}",
            "-s",
            "tracking.enabled=false",
            "-s",
            f"run.torch_num_threads={os.cpu_count() or 1}",
        ],
        cwd=ROOT,
        check=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
    )
    return model
