"""Start inference servers: the embedded engine, or SGLang when it is installed.

``engine_command`` builds the argv; ``EngineProcess`` runs one server in its own process group (so
stopping it stops its whole tree) and waits until ``/health`` answers. SGLang is only ever run as
``python -m sglang.launch_server`` in a child process, never imported, from ``engine.sglang_python``
(its own virtualenv); a missing SGLang fails at once with the install hint. On a machine without a
GPU agentrl passes SGLang's CPU flags and environment itself (:data:`SGLANG_CPU_FLAGS`,
:func:`sglang_cpu_env`, the ``sgl_kernel`` stand-in in ``sglang_cpu/``) and sizes its KV pool
(:func:`cpu_kv_tokens`). See docs/engine.md.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"  # the SGLang release agentrl is tested against (tests/sglang_spec.py, the real-SGLang tier)
SGLANG_INSTALL_HINT = (
    f"SGLang pins its own torch and transformers, so give it a virtualenv of its own: AGENTRL_SGLANG=1 bash "
    f"scripts/install.sh (builds .venv-sglang with sglang=={SGLANG_VERSION}), or python -m venv V && "
    f'V/bin/pip install sglang=={SGLANG_VERSION}; then set engine.sglang_python = "V/bin/python" '
    f'(serve-engine: --sglang-python). Or use the embedded engine (engine.backend = "embedded")'
)
# SGLang's CPU path (REFERENCE.md): torch-native attention and sampling; the x86 default backend needs sgl_kernel
SGLANG_CPU_FLAGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--skip-server-warmup",
)
SGLANG_CPU_SHIM = Path(__file__).parent / "sglang_cpu"  # the folder holding the sgl_kernel stand-in


class EngineLaunchError(RuntimeError):
    """A server could not be started or did not become ready; the message says why."""


def sglang_problem(python: str = "") -> str | None:
    """Why ``python`` (default: this interpreter) cannot start SGLang, or None when it can. Asks the
    interpreter for sglang's installed version without importing sglang (a fraction of a second)."""
    python = python or sys.executable
    probe = (
        "import importlib.metadata as m, importlib.util as u, sys\n"
        "sys.exit(3) if u.find_spec('sglang') is None else print(m.version('sglang'))"
    )
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"engine.sglang_python {python!r} cannot be run ({e}). {SGLANG_INSTALL_HINT}"
    if out.returncode != 0:
        return f"{python} has no sglang. {SGLANG_INSTALL_HINT}"
    version = out.stdout.strip()
    if version != SGLANG_VERSION:
        log.warning("%s has sglang %s; agentrl is tested against %s", python, version, SGLANG_VERSION)
    return None


def require_sglang(python: str = "") -> None:
    problem = sglang_problem(python)
    if problem:
        raise EngineLaunchError(problem)


def sglang_cpu_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What an SGLang process on the CPU needs in its environment: SGLang's CPU switch, and the
    ``sgl_kernel`` stand-in first on ``PYTHONPATH`` (before anything ``environ`` already has there)."""
    environ = os.environ if environ is None else environ
    path = os.pathsep.join(p for p in (str(SGLANG_CPU_SHIM), environ.get("PYTHONPATH", "")) if p)
    return {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": path}


def cpu_kv_tokens(cfg) -> int:
    """SGLang's ``--max-total-tokens`` for an engine on the CPU: every request it may run at once
    (its share of the actors' concurrent episodes, at most ``max_running_requests``) at the longest
    episode's token budget. Too small a pool makes SGLang retract requests under load."""
    e = cfg.engine
    episodes = cfg.actors.num_processes * cfg.actors.num_concurrent_episodes
    per_engine = -(-episodes // max(1, len(e.urls) or e.num_engines))
    longest = min(e.max_context_tokens, max(s.max_total_tokens for s in cfg.env_sections))
    return max(min(e.max_running_requests, per_engine) * longest, e.max_context_tokens)


def engine_command(
    model_path: str,
    port: int,
    *,
    backend: str = "embedded",
    host: str = "127.0.0.1",
    extra: Sequence[str] = (),
    python: str = "",
) -> list[str]:
    """argv for a server process serving ``model_path`` on ``host:port``; ``python`` is SGLang's
    interpreter (default: this one)."""
    if backend == "embedded":
        return [
            sys.executable,
            "-m",
            "agentrl.run.engine_process",
            "--model",
            str(model_path),
            "--host",
            host,
            "--port",
            str(port),
            *extra,
        ]
    if backend == "sglang":
        return [
            python or sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model_path),
            "--host",
            host,
            "--port",
            str(port),
            *extra,
        ]
    raise ValueError(f"unknown engine backend {backend!r}; choose embedded or sglang")


def engine_args(
    backend: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    max_running_requests: int = 64,
    max_context_tokens: int = 2048,
    weight_version: str = "0",
    num_threads: int = 0,
    gpus_per_engine: int = 1,
    mem_fraction_static: float = 0.0,
    api_key: str = "",
    admin_api_key: str = "",
    api_key_env: str = "",
    admin_api_key_env: str = "",
    sglang_args: Sequence[str] = (),
    on_cpu: bool = False,
    max_total_tokens: int = 0,
) -> list[str]:
    """The shared settings as flags of either server (SGLang's own flag names for ``sglang``).

    ``--weight-version`` is always there: a server started without it reports ``"default"``
    until the first update. An SGLang engine sees only its own GPUs (``CUDA_VISIBLE_DEVICES``,
    agentrl/run/placement.py), so it starts at ``--base-gpu-id 0`` with ``--tp-size`` = its GPUs.
    Keys are SGLang's ``--api-key``/``--admin-api-key``; the embedded engine reads its keys from
    the environment itself, from the variables named by ``--api-key-env``/``--admin-api-key-env``.
    ``on_cpu``: SGLang's CPU flags (float32 unless ``dtype`` says otherwise) and, when
    ``max_total_tokens`` is set, its KV pool size.
    """
    if backend == "sglang":
        args = [
            "--tp-size",
            str(gpus_per_engine),
            "--base-gpu-id",
            "0",
            "--context-length",
            str(max_context_tokens),
            "--max-running-requests",
            str(max_running_requests),
            "--weight-version",
            str(weight_version),
        ]
        if mem_fraction_static:
            args += ["--mem-fraction-static", str(mem_fraction_static)]
        if on_cpu:
            args += list(SGLANG_CPU_FLAGS)
            dtype = "float32" if dtype == "auto" else dtype
        if max_total_tokens:
            args += ["--max-total-tokens", str(max_total_tokens)]
        if dtype != "auto":
            args += ["--dtype", dtype]
        if api_key:
            args += ["--api-key", api_key]
        if admin_api_key:
            args += ["--admin-api-key", admin_api_key]
        return args + list(sglang_args)
    if gpus_per_engine != 1:
        raise ValueError(f"the embedded engine runs on one device; got gpus_per_engine = {gpus_per_engine}")
    args = [
        "--device",
        device,
        "--dtype",
        dtype,
        "--max-running-requests",
        str(max_running_requests),
        "--max-context-tokens",
        str(max_context_tokens),
        "--weight-version",
        str(weight_version),
        "--num-threads",
        str(num_threads),
    ]
    if api_key_env:
        args += ["--api-key-env", api_key_env]
    if admin_api_key_env:
        args += ["--admin-api-key-env", admin_api_key_env]
    return args


def config_engine_args(
    cfg, *, secret: Callable[[str], str] | None = None, weight_version: str = "0", on_cpu: bool = False
) -> list[str]:
    """``engine_args`` for a run config's ``[engine]`` and ``[model]`` sections. ``secret(var)`` gives the
    value of an API-key variable (default: ``agentrl.secrets.read_secret``; SGLang takes keys as flags).
    ``on_cpu``: the engine is placed on no GPU (SGLang's CPU flags; a KV pool sized by :func:`cpu_kv_tokens`
    unless ``engine.sglang_args`` sets ``--max-total-tokens``)."""
    from agentrl.secrets import read_secret

    e = cfg.engine
    secret = secret or read_secret
    sglang_args = list(e.sglang_args)
    if e.backend == "sglang":
        keys = {"api_key": secret(e.api_key_env), "admin_api_key": secret(e.admin_api_key_env)}
        lora = cfg.learner.lora
        if lora.served_adapter:  # adapters loaded later by the learner: SGLang must size its LoRA pool now
            sglang_args += [
                "--enable-lora",
                "--max-lora-rank",
                str(lora.rank),
                "--lora-target-modules",
                *lora.target_modules,
            ]
    else:  # the embedded engine takes /load_lora_adapter without flags
        keys = {"api_key_env": e.api_key_env, "admin_api_key_env": e.admin_api_key_env}
    sized = any(a.split("=", 1)[0] == "--max-total-tokens" for a in sglang_args)
    kv_tokens = cpu_kv_tokens(cfg) if on_cpu and e.backend == "sglang" and not sized else 0
    return engine_args(
        e.backend,
        device=e.device,
        dtype=cfg.model.dtype,
        max_running_requests=e.max_running_requests,
        max_context_tokens=e.max_context_tokens,
        weight_version=weight_version,
        num_threads=cfg.run.torch_num_threads,
        gpus_per_engine=e.gpus_per_engine,
        mem_fraction_static=e.mem_fraction_static,
        sglang_args=sglang_args,
        on_cpu=on_cpu and e.backend == "sglang",
        max_total_tokens=kv_tokens,
        **keys,
    )


def wait_ready(url: str, timeout_s: float, *, process: subprocess.Popen | None = None) -> None:
    """Poll ``url/health`` until it answers 200; raise if ``process`` dies or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise EngineLaunchError(f"engine at {url} exited with code {process.returncode} before it was ready")
        try:
            # SGLang's /health generates a token and checks each second, up to 20 s: wait longer than that
            r = httpx.get(f"{url.rstrip('/')}/health", timeout=max(1.0, min(30.0, deadline - time.monotonic())))
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(0.2)
    raise EngineLaunchError(f"engine at {url} not ready after {timeout_s:.0f} s ({last})")


class EngineProcess:
    """One server process (its own process group), started with :meth:`start`, ended with :meth:`stop`."""

    def __init__(
        self,
        model_path: str,
        port: int,
        *,
        backend: str = "embedded",
        host: str = "127.0.0.1",
        extra: Sequence[str] = (),
        log_path: str | Path | None = None,
        env: dict | None = None,
        python: str = "",
    ):
        if backend == "sglang":
            require_sglang(python)
        self.url = f"http://{host}:{port}"
        self.argv = engine_command(model_path, port, backend=backend, host=host, extra=extra, python=python)
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        self.process: subprocess.Popen | None = None
        self._log: IO | None = None

    def start(self, wait_s: float = 300.0) -> EngineProcess:
        out = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
            out = self._log
        self.process = subprocess.Popen(
            self.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env if self.env is not None else os.environ.copy(),
        )
        if wait_s > 0:
            try:
                wait_ready(self.url, wait_s, process=self.process)
            except EngineLaunchError as e:
                self.stop()
                hint = f"; see {self.log_path}" if self.log_path else ""
                raise EngineLaunchError(f"{e}{hint}") from None
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        p = self.process
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout_s)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> EngineProcess:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
