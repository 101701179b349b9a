"""The ``local`` backend: bubblewrap, an unprivileged uid, a cgroup per run and rlimits.

Each run is ``[sh gate] prlimit ... bwrap ... python3 -I runner.py payload.json``: all namespaces
unshared (no network, no host processes), the host's ``/usr`` read-only, tmpfs ``/tmp``,
``/dev/shm`` and ``/work`` the only writable places, environment cleared. As root, bwrap runs as a
uid of its own per sandbox, since ``RLIMIT_NPROC`` does not bind root.

What bounds a run's total (``limits``): ``cgroup`` when one can be made (``cgroups.py``; the first
process waits at the gate until it is in the group), else ``rlimits`` (``prlimit``; the total is
then bounded by processes x address space). ``/work`` is capped at ``work_mb`` either way.

Invariants: the runner is the init of the run's pid namespace (``--as-pid-1``), so every process is
reaped by its parent; a run that overstays is ended innermost first (the runner, then bwrap, then
what is left in the cgroup), since killing bwrap first would orphan its child. See docs/tools.md.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

import trio

from agentrl.tools.sandbox.base import ExecResult, Sandbox, SandboxSettings, parse_report, runner_source
from agentrl.tools.sandbox.cgroups import RunCgroup, find_cgroups

HOST_GRACE_S = 5.0
WORK_INODES = 16384
MAX_CAPTURE_BYTES = 4 << 20  # the runner's report is at most ~3 x max_output_bytes; keep the tail
# The run's first process waits here until the host has moved it into the run's cgroup.
GATE = 'read -r _ && exec "$@" </dev/null'
# bwrap's own init (pid 1 in the sandbox) keeps the environment it was started with, and the
# code can read it from /proc/1/environ: start bwrap with nothing of the host's environment.
_HOST_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def bwrap_available() -> str | None:
    """None when the local backend can run here, else the reason it cannot."""
    for tool in ("bwrap", "prlimit"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install bubblewrap util-linux)"
    return None


def _python_inside(settings: SandboxSettings) -> tuple[str, list[str]]:
    """The interpreter to run inside, and extra read-only binds it needs."""
    if settings.python:
        path = Path(settings.python)
        if not path.is_absolute():
            raise ValueError(f"sandbox.python must be an absolute path, got {settings.python!r}")
        return str(path), [] if str(path).startswith("/usr/") else [str(Path(path).resolve().parents[1])]
    if Path("/usr/bin/python3").exists():
        return "/usr/bin/python3", []
    base = Path(sys.base_prefix)
    return str(base / "bin" / "python3"), [str(base)]


def _mount_work(path: Path, size_mb: int, uid: int) -> bool:
    """A tmpfs of ``size_mb`` owned by ``uid`` on ``path``; False where mounting is not allowed."""
    options = f"size={size_mb}m,nr_inodes={WORK_INODES},mode=0700,uid={uid},gid={uid}"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "agentrl-work", str(path)], capture_output=True, check=False
    )
    return done.returncode == 0


@functools.lru_cache(maxsize=1)
def _remove_stale_roots() -> None:
    """Unmount and delete the sandbox folders of agentrl processes that died without closing
    them (their pid is in the folder's name); once per process."""
    prefix = os.path.join(tempfile.gettempdir(), "agentrl-sandbox-")
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 1 and fields[0] == "agentrl-work" and fields[1].startswith(prefix):
            root = os.path.dirname(fields[1])
            try:
                os.kill(int(root[len(prefix) :].split("-")[0]), 0)
            except ProcessLookupError:
                _remove_root(root, True)
            except (OSError, ValueError):
                pass


def _remove_root(root: str, work_mounted: bool) -> None:
    if work_mounted:
        subprocess.run(["umount", "--lazy", os.path.join(root, "work")], capture_output=True, check=False)
    shutil.rmtree(root, ignore_errors=True)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc, as the kill path needs them once)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return found


async def _read_tail(stream: Any, keep: bytearray) -> None:
    """Read ``stream`` to its end, keeping only the last MAX_CAPTURE_BYTES."""
    while chunk := await stream.receive_some(65536):
        keep += chunk
        if len(keep) > MAX_CAPTURE_BYTES:
            del keep[: len(keep) - MAX_CAPTURE_BYTES]


class LocalSandbox(Sandbox):
    def __init__(self, settings: SandboxSettings, slot: int = 0):
        reason = bwrap_available()
        if reason:
            raise RuntimeError(f"the local sandbox cannot run: {reason}")
        self.settings = settings
        self.python, self.extra_binds = _python_inside(settings)
        if os.geteuid() == 0:
            _remove_stale_roots()
        self.root = Path(tempfile.mkdtemp(prefix=f"agentrl-sandbox-{os.getpid()}-"))
        self.workdir = self.root / "work"
        self.ctl = self.root / "ctl"
        self.workdir.mkdir()
        self.ctl.mkdir()
        (self.ctl / "runner.py").write_text(runner_source())
        os.chmod(self.root, 0o755)
        os.chmod(self.ctl, 0o755)
        self.uid: int | None = None
        self.cgroups = find_cgroups() if os.geteuid() == 0 else "agentrl is not root"
        self.work_mounted = False
        if os.geteuid() == 0:
            self.uid = settings.sandbox_uid(slot)
            os.chown(self.workdir, self.uid, self.uid)
            self.work_mounted = _mount_work(self.workdir, settings.work_mb, self.uid)
        os.chmod(self.workdir, 0o700)
        self._finalizer = weakref.finalize(self, _remove_root, str(self.root), self.work_mounted)
        self._counter = 0

    @property
    def limits(self) -> str:
        """How the run's total is bounded: "cgroup", or "rlimits" (see the module docstring)."""
        return "rlimits" if isinstance(self.cgroups, str) else "cgroup"

    def command(self, payload_name: str) -> list[str]:
        s = self.settings
        outer_nproc = s.max_processes + 8  # bwrap, its init and the runner count too
        outer_as = (s.memory_mb + 256) << 20
        argv = [
            "prlimit",
            f"--nproc={outer_nproc}",
            f"--as={outer_as}",
            f"--cpu={int(s.cpu_time_s) + 5}",
            f"--fsize={s.max_file_mb << 20}",
            f"--nofile={s.max_open_files}",
            "--core=0",
            "--",
            "bwrap",
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--as-pid-1",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            p = Path(top)
            if p.is_symlink():
                argv += ["--symlink", os.readlink(p), top]
            elif p.is_dir():
                argv += ["--ro-bind", top, top]
        for extra in self.extra_binds:
            argv += ["--ro-bind", extra, extra]
        argv += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(s.tmpfs_mb << 20),
            "--tmpfs",
            "/dev/shm",
            "--size",
            str(s.tmpfs_mb << 20),
            "--tmpfs",
            "/tmp",
            "--ro-bind",
            str(self.ctl),
            "/.agentrl",
        ]
        if self.work_mounted:
            argv += ["--bind", str(self.workdir), "/work"]
        else:
            argv += ["--size", str(s.work_mb << 20), "--tmpfs", "/work"]
        argv += [
            # bwrap's root and /dev are tmpfs of unbounded size: read-only once all is mounted
            "--remount-ro",
            "/dev",
            "--remount-ro",
            "/",
            "--chdir",
            "/work",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/local/bin:/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/work",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--setenv",
            "PYTHONDONTWRITEBYTECODE",
            "1",
            "--",
            self.python,
            "-I",
            "/.agentrl/runner.py",
            f"/.agentrl/{payload_name}",
        ]
        return argv

    async def execute(self, payload: dict[str, Any]) -> ExecResult:
        self._counter += 1
        name = f"payload-{self._counter}.json"
        path = self.ctl / name
        group: RunCgroup | None = None
        oom_kills = 0
        try:
            path.write_text(json.dumps(payload))
            os.chmod(path, 0o644)
            if not isinstance(self.cgroups, str):  # cgroupfs writes block for ms: not on the event loop
                s = self.settings
                group = await trio.to_thread.run_sync(
                    RunCgroup, self.cgroups, s.total_memory_mb << 20, s.max_processes + 8
                )
            returncode, out, err = await self._run_bwrap(name, group)
        finally:
            path.unlink(missing_ok=True)
            if group:
                oom_kills = group.oom_kills()
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(group.destroy)
        if returncode is None:
            return ExecResult(exit_code=None, limit="wall_time")
        result = parse_report(out.decode(errors="replace"), err.decode(errors="replace"))
        if oom_kills and not result.limit:
            result.limit = "memory"
        if result.error and returncode:
            result.error += f" (bwrap exit code {returncode})"
        return result

    async def _run_bwrap(self, payload_name: str, group: RunCgroup | None) -> tuple[int | None, bytearray, bytearray]:
        """Start the run (in ``group``, through the gate, if given), wait for it within the host's
        time limit, and end and reap it; returns bwrap's exit code (None: timed out) and output."""
        argv = self.command(payload_name)
        if group:
            argv = ["sh", "-c", GATE, "sh", *argv]
        options: dict[str, Any] = {}
        if self.uid is not None:
            options = {"user": self.uid, "group": self.uid, "extra_groups": []}
        out, err = bytearray(), bytearray()
        proc = await trio.lowlevel.open_process(
            argv,
            stdin=subprocess.PIPE if group else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=_HOST_ENV,
            **options,
        )
        try:
            if group:
                await trio.to_thread.run_sync(group.add, proc.pid)  # ~5 ms a hierarchy on cgroup v1
                assert proc.stdin is not None, "opened with stdin=PIPE"
                await proc.stdin.send_all(b"go\n")
                await proc.stdin.aclose()
            with trio.move_on_after(self.settings.wall_time_s + HOST_GRACE_S) as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_read_tail, proc.stdout, out)
                    nursery.start_soon(_read_tail, proc.stderr, err)
                    await proc.wait()
        finally:
            with trio.CancelScope(shield=True):
                await _end(proc)
        return (None if scope.cancelled_caught else proc.returncode), out, err

    async def reset(self) -> None:
        # Every process of a run dies with its pid namespace; only the files need to go.
        for child in self.workdir.iterdir():
            if child.is_dir() and not child.is_symlink():
                await trio.to_thread.run_sync(shutil.rmtree, child, True)
            else:
                child.unlink(missing_ok=True)

    async def close(self) -> None:
        self._finalizer()


async def _end(proc: trio.Process) -> None:
    """Kill and reap a run that is still going, innermost first (see the module docstring)."""
    if proc.returncode is None:
        for child in _children(proc.pid):  # bwrap's child: the runner, pid 1 of the run's namespace
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
        with trio.move_on_after(2.0):
            await proc.wait()
        if proc.returncode is None:  # bwrap did not follow its child, or the gate never opened
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            await stream.aclose()
