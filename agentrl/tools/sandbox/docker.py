"""The ``docker`` backend: one container per sandbox, driven through the docker SDK.

A sandbox is a container started from ``settings.image`` (see ``sandboxes/python/``) with

* ``network_mode="none"``, all capabilities dropped, ``no-new-privileges``,
* ``mem_limit`` = ``memory_mb`` + 64 MB for the runner (no swap), ``pids_limit`` =
  ``max_processes`` + 2 (the keep-alive and the exec'd runner),
  ``cpus`` CPUs. The process limit is the container's pids cgroup, not ``RLIMIT_NPROC``:
  that rlimit counts every process of the uid on the whole host, so sandboxes sharing uid
  65534 would eat each other's quota;
* a keep-alive main process that reaps orphans and exits after ``lifetime_s`` (``auto_remove`` then deletes
  the container, so even a crashed host process leaves nothing behind for long), and the
  label ``agentrl.sandbox=1``.

Each run copies the runner and its payload into ``/.agentrl`` with ``put_archive`` and execs
``python3 -I /.agentrl/runner.py`` as uid 65534 in ``/work``; the runner applies the per-run
limits. If the exec outlives ``wall_time_s`` + 10 s, the container is killed and the sandbox
is marked broken (the pool replaces it). :meth:`reset` runs the runner's reset as uid 65534,
which kills that uid's leftover processes and empties ``/work``.

The SDK is synchronous; every call runs in a worker thread.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
import weakref
from typing import Any

import trio

from agentrl.tools.sandbox.base import ExecResult, Sandbox, SandboxSettings, parse_report, runner_source

SANDBOX_USER = "65534:65534"
HOST_GRACE_S = 10.0
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


def docker_client(settings: SandboxSettings):
    """A docker SDK client for ``settings.docker_host`` (or the environment's DOCKER_HOST)."""
    try:
        import docker
    except ImportError:
        raise RuntimeError("the docker sandbox needs the docker SDK: pip install 'agentrl[docker]'") from None
    if settings.docker_host:
        return docker.DockerClient(base_url=settings.docker_host, version="auto", timeout=60)
    return docker.from_env(version="auto", timeout=60)


def docker_unavailable(settings: SandboxSettings | None = None) -> str | None:
    """None when a daemon answers and the image exists, else the reason."""
    settings = settings or SandboxSettings(backend="docker")
    try:
        client = docker_client(settings)
        client.ping()
    except Exception as e:
        return f"no docker daemon reachable ({type(e).__name__}: {e})"
    try:
        client.images.get(settings.image)
    except Exception:
        return f"docker image {settings.image!r} not found (build it with sandboxes/python/build_local_image.sh)"
    finally:
        client.close()
    return None


def _tar(files: dict[str, str | bytes], mode: int = 0o644) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class DockerSandbox(Sandbox):
    def __init__(self, settings: SandboxSettings, client: Any, container: Any):
        self.settings = settings
        self.client = client
        self.container = container
        self.broken = False
        self._counter = 0
        self._finalizer = weakref.finalize(self, _remove_quietly, container)

    @classmethod
    async def create(cls, settings: SandboxSettings, slot: int = 0) -> "DockerSandbox":
        client = await trio.to_thread.run_sync(docker_client, settings)
        # The main process reaps orphans (SIGCHLD ignored: no zombies eating the pids limit)
        # and ends the container after lifetime_s.
        keepalive = f"import signal, time; signal.signal(signal.SIGCHLD, signal.SIG_IGN); time.sleep({float(settings.lifetime_s)})"
        container = await trio.to_thread.run_sync(lambda: client.containers.run(
            settings.image, ["python3", "-c", keepalive], detach=True, auto_remove=True,
            network_mode="none", mem_limit=f"{settings.memory_mb + 64}m",
            memswap_limit=f"{settings.memory_mb + 64}m", pids_limit=settings.max_processes + 2,
            nano_cpus=int(settings.cpus * 1e9), cap_drop=["ALL"], security_opt=["no-new-privileges"],
            labels={"agentrl.sandbox": "1"}, working_dir="/work", environment=_ENV,
        ))
        sandbox = cls(settings, client, container)
        await trio.to_thread.run_sync(lambda: container.put_archive("/", _tar_dir(".agentrl")))
        return sandbox

    async def _exec(self, payload: dict[str, Any]) -> ExecResult:
        if self.broken:
            return ExecResult(exit_code=None, error="the sandbox container is gone")
        self._counter += 1
        name = f"payload-{self._counter}.json"
        archive = _tar({"runner.py": runner_source(), name: json.dumps(payload)})

        def call() -> tuple[int, tuple[bytes | None, bytes | None]]:
            self.container.put_archive("/.agentrl", archive)
            return self.container.exec_run(
                ["python3", "-I", "/.agentrl/runner.py", f"/.agentrl/{name}"],
                user=SANDBOX_USER, workdir="/work", environment=_ENV, demux=True,
            )

        try:
            with trio.move_on_after(self.settings.wall_time_s + HOST_GRACE_S) as scope:
                exit_code, (out, err) = await trio.to_thread.run_sync(call, abandon_on_cancel=True)
        except Exception as e:  # the daemon or the container failed, not the code
            self.broken = True
            return ExecResult(exit_code=None, error=f"docker exec failed: {type(e).__name__}: {e}")
        if scope.cancelled_caught:
            self.broken = True
            await trio.to_thread.run_sync(_remove_quietly, self.container)
            return ExecResult(exit_code=None, limit="wall_time")
        result = parse_report((out or b"").decode(errors="replace"), (err or b"").decode(errors="replace"))
        if result.error:
            result.error += f" (exit code {exit_code})"
        return result

    async def run(self, code: str, *, files: dict[str, str] | None = None, stdin: str = "") -> ExecResult:
        # pids_limit bounds the processes (max_processes=0: the runner sets no RLIMIT_NPROC).
        return await self._exec(self.settings.payload("run", code, files, stdin, workdir="/work", max_processes=0))

    async def reset(self) -> None:
        result = await self._exec(self.settings.payload("reset", workdir="/work", sweep_uid=True))
        if result.error:
            raise RuntimeError(f"could not reset the docker sandbox: {result.error}")

    async def close(self) -> None:
        self.broken = True
        await trio.to_thread.run_sync(self._finalizer)
        await trio.to_thread.run_sync(self.client.close)


def _tar_dir(name: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
        tar.addfile(info)
    return buf.getvalue()


def _remove_quietly(container: Any) -> None:
    try:
        container.remove(force=True)
    except Exception:
        pass  # already gone (auto_remove) or the daemon is down: the lifetime limit ends it
