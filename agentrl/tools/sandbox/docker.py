"""The ``docker`` backend: one container per sandbox, driven through the docker SDK.

A container from ``settings.image``: no network, all capabilities dropped, ``no-new-privileges``, a
read-only root with tmpfs ``/work``, ``/tmp`` and ``/dev/shm`` only, memory
(``SandboxSettings.total_memory_mb``, no swap) and pids limits, and a uid of its own per sandbox
(``RLIMIT_NPROC`` counts per uid on the whole host). A keep-alive main process exits after
``lifetime_s`` and ``auto_remove`` deletes the container, so a crashed host leaves nothing for long.

Each run execs ``python3 -I -c RUNNER -`` with the payload on stdin (nothing is copied in); an exec
that outlives ``wall_time_s`` + 10 s kills the container and marks the sandbox broken.
:meth:`reset` runs the runner's reset. The SDK is synchronous; every call runs in a worker thread.
See docs/tools.md.
"""

from __future__ import annotations

import json
import socket
import weakref
from typing import Any

import trio

from agentrl.tools.sandbox.base import ExecResult, Sandbox, SandboxSettings, parse_report, runner_source

HOST_GRACE_S = 10.0
WORK_INODES = 16384
MAX_CAPTURE_BYTES = 4 << 20  # the runner's report is at most ~3 x max_output_bytes; keep the tail
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


class DockerSandbox(Sandbox):
    def __init__(self, settings: SandboxSettings, client: Any, container: Any, uid: int):
        self.settings = settings
        self.client = client
        self.container = container
        self.uid = uid
        self.broken = False
        self._finalizer = weakref.finalize(self, _remove_quietly, container)

    @classmethod
    async def create(cls, settings: SandboxSettings, slot: int = 0) -> DockerSandbox:
        from docker.types import Ulimit

        client = await trio.to_thread.run_sync(docker_client, settings)
        uid = settings.sandbox_uid(slot)
        nproc = settings.max_processes + 2
        # The main process reaps orphans (SIGCHLD ignored: no zombies eating the pids limit)
        # and ends the container after lifetime_s.
        keepalive = f"import signal, time; signal.signal(signal.SIGCHLD, signal.SIG_IGN); time.sleep({float(settings.lifetime_s)})"
        container = await trio.to_thread.run_sync(
            lambda: client.containers.run(
                settings.image,
                ["python3", "-c", keepalive],
                detach=True,
                auto_remove=True,
                network_mode="none",
                read_only=True,
                tmpfs={
                    "/work": f"size={settings.work_mb}m,nr_inodes={WORK_INODES},mode=0700,uid={uid},gid={uid}",
                    "/tmp": f"size={settings.tmpfs_mb}m,nr_inodes={WORK_INODES},mode=1777",
                },
                shm_size=f"{settings.tmpfs_mb}m",
                mem_limit=f"{settings.total_memory_mb}m",
                memswap_limit=f"{settings.total_memory_mb}m",
                pids_limit=nproc,
                nano_cpus=int(settings.cpus * 1e9),
                ulimits=[
                    Ulimit(name="nofile", soft=settings.max_open_files, hard=settings.max_open_files),
                    Ulimit(name="nproc", soft=nproc, hard=nproc),
                ],
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                labels={"agentrl.sandbox": "1"},
                working_dir="/work",
                environment=_ENV,
            )
        )
        return cls(settings, client, container, uid)

    async def execute(self, payload: dict[str, Any]) -> ExecResult:
        if self.broken:
            return ExecResult(exit_code=None, error="the sandbox container is gone")
        data = json.dumps(payload).encode()

        def call() -> tuple[int | None, bytes, bytes]:
            from docker.utils.socket import frames_iter

            api = self.client.api
            exec_id = api.exec_create(
                self.container.id,
                ["python3", "-I", "-c", runner_source(), "-"],
                stdin=True,
                user=f"{self.uid}:{self.uid}",
                workdir="/work",
                environment=_ENV,
            )["Id"]
            sock = api.exec_start(exec_id, socket=True)
            try:
                sock._sock.sendall(data)
                sock._sock.shutdown(socket.SHUT_WR)
                streams = {1: bytearray(), 2: bytearray()}
                for stream, chunk in frames_iter(sock, tty=False):
                    keep = streams.get(stream)
                    if keep is not None:
                        keep += chunk
                        del keep[: max(0, len(keep) - MAX_CAPTURE_BYTES)]
            finally:
                sock.close()
            return api.exec_inspect(exec_id)["ExitCode"], bytes(streams[1]), bytes(streams[2])

        try:
            with trio.move_on_after(self.settings.wall_time_s + HOST_GRACE_S) as scope:
                exit_code, out, err = await trio.to_thread.run_sync(call, abandon_on_cancel=True)
        except Exception as e:  # the daemon or the container failed, not the code
            self.broken = True
            return ExecResult(exit_code=None, error=f"docker exec failed: {type(e).__name__}: {e}")
        if scope.cancelled_caught:
            self.broken = True
            await trio.to_thread.run_sync(_remove_quietly, self.container)
            return ExecResult(exit_code=None, limit="wall_time")
        result = parse_report(out.decode(errors="replace"), err.decode(errors="replace"))
        if result.error:
            result.error += f" (exit code {exit_code})"
        return result

    async def reset(self) -> None:
        payload = self.settings.payload("reset", workdir="/work", sweep_uid=True)
        result = await self.execute({**payload, "scratch_dirs": ["/tmp", "/dev/shm"]})
        if result.error:
            raise RuntimeError(f"could not reset the docker sandbox: {result.error}")

    async def close(self) -> None:
        self.broken = True
        await trio.to_thread.run_sync(self._finalizer)
        await trio.to_thread.run_sync(self.client.close)


def _remove_quietly(container: Any) -> None:
    try:
        container.remove(force=True)
    except Exception:
        pass  # already gone (auto_remove) or the daemon is down: the lifetime limit ends it
