"""Start inference servers: the embedded engine, or SGLang when it is installed.

``engine_command`` builds the argv; ``EngineProcess`` runs one server in its own process
group (so stopping it stops its whole tree) and waits until ``/health`` answers. SGLang is
only ever run as ``python -m sglang.launch_server`` in a child process -- never imported --
and when it is missing we fail at once with the install hint instead of at first request.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Sequence

SGLANG_INSTALL_HINT = (
    "the 'sglang' backend needs SGLang (a CUDA machine): pip install 'agentrl[sglang]' "
    "(or pip install 'sglang[all]>=0.5' sglang-router); use --backend embedded on machines without it"
)


class EngineLaunchError(RuntimeError):
    """A server could not be started or did not become ready; the message says why."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def require_sglang() -> None:
    if not sglang_available():
        raise EngineLaunchError(SGLANG_INSTALL_HINT)


def engine_command(model_path: str, port: int, *, backend: str = "embedded", host: str = "127.0.0.1",
                   extra: Sequence[str] = ()) -> list[str]:
    """argv for a server process serving ``model_path`` on ``host:port``."""
    if backend == "embedded":
        return [sys.executable, "-m", "agentrl.engine.server", "--model", str(model_path),
                "--host", host, "--port", str(port), *extra]
    if backend == "sglang":
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
                "--host", host, "--port", str(port), *extra]
    raise ValueError(f"unknown engine backend {backend!r}; choose embedded or sglang")


def engine_args(backend: str, *, device: str = "auto", dtype: str = "auto", max_running_requests: int = 64,
                max_context_tokens: int = 2048, weight_version: str = "0", num_threads: int = 0,
                sglang_args: Sequence[str] = ()) -> list[str]:
    """The shared settings as flags of either server (SGLang's own flag names for ``sglang``)."""
    if backend == "sglang":
        args = ["--context-length", str(max_context_tokens), "--max-running-requests", str(max_running_requests),
                "--weight-version", str(weight_version)]
        if dtype != "auto":
            args += ["--dtype", dtype]
        return args + list(sglang_args)
    return ["--device", device, "--dtype", dtype, "--max-running-requests", str(max_running_requests),
            "--max-context-tokens", str(max_context_tokens), "--weight-version", str(weight_version),
            "--num-threads", str(num_threads)]


def wait_ready(url: str, timeout_s: float, *, process: subprocess.Popen | None = None) -> None:
    """Poll ``url/health`` until it answers 200; raise if ``process`` dies or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise EngineLaunchError(f"engine at {url} exited with code {process.returncode} before it was ready")
        try:
            r = httpx.get(f"{url.rstrip('/')}/health", timeout=2.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(0.2)
    raise EngineLaunchError(f"engine at {url} not ready after {timeout_s:.0f} s ({last})")


class EngineProcess:
    """One server process (its own process group), started with :meth:`start`, ended with :meth:`stop`."""

    def __init__(self, model_path: str, port: int, *, backend: str = "embedded", host: str = "127.0.0.1",
                 extra: Sequence[str] = (), log_path: str | Path | None = None, env: dict | None = None):
        if backend == "sglang":
            require_sglang()
        self.url = f"http://{host}:{port}"
        self.argv = engine_command(model_path, port, backend=backend, host=host, extra=extra)
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        self.process: subprocess.Popen | None = None
        self._log: IO | None = None

    def start(self, wait_s: float = 300.0) -> "EngineProcess":
        out = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
            out = self._log
        self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=self.env if self.env is not None else os.environ.copy())
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

    def __enter__(self) -> "EngineProcess":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_engines(model_path: str, num_engines: int, *, backend: str = "embedded", host: str = "127.0.0.1",
                  base_port: int = 0, extra: Sequence[str] = (), log_dir: str | Path | None = None,
                  wait_s: float = 300.0) -> list[EngineProcess]:
    """Start ``num_engines`` servers (ports ``base_port + i``, or free ports when 0) and wait for all."""
    procs = []
    try:
        for i in range(num_engines):
            port = base_port + i if base_port else free_port(host)
            log_path = Path(log_dir) / f"engine{i}.log" if log_dir else None
            procs.append(EngineProcess(model_path, port, backend=backend, host=host, extra=extra,
                                       log_path=log_path).start(wait_s=0))
        for p in procs:
            wait_ready(p.url, wait_s, process=p.process)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def engines_from_config(cfg, *, log_dir: str | Path | None = None, wait_s: float = 300.0) -> list[EngineProcess]:
    """Start the ``[engine]`` section's ``num_engines`` servers for ``cfg.model.path`` (what ``agentrl run``
    does when ``engine.urls`` is empty); returns them ready, their URLs in ``.url``."""
    e, m = cfg.engine, cfg.model
    extra = engine_args(e.backend, device=e.device, dtype=m.dtype, max_running_requests=e.max_running_requests,
                        max_context_tokens=e.max_context_tokens, num_threads=cfg.run.torch_num_threads,
                        sglang_args=e.sglang_args)
    if e.backend == "sglang":
        require_sglang()
    return start_engines(m.path, e.num_engines, backend=e.backend, host=e.host, base_port=e.base_port,
                         extra=extra, log_dir=log_dir, wait_s=wait_s)
