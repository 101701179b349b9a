"""The ``local`` backend: bubblewrap, an unprivileged uid and resource limits.

Each run starts ``prlimit ... bwrap ... python3 -I runner.py payload.json`` (about 0.05 s):

* bwrap ``--unshare-all``: new user, pid, network (loopback only, down), ipc, uts and cgroup
  namespaces, so the code sees no network and no host processes; ``--die-with-parent`` and
  the pid namespace end every process of the run when it ends.
* Filesystem: the host's ``/usr`` (and ``/bin``, ``/lib*``, ``/sbin`` as on the host)
  read-only, a private ``/tmp`` tmpfs of ``tmpfs_mb``, a minimal ``/dev`` and ``/proc``, and
  ``/work``: a host directory private to this sandbox, kept across the runs of one episode and
  emptied by :meth:`reset`. Nothing else of the host exists inside (no ``/etc``, ``/home``,
  ``/root``); environment variables are cleared.
* Unprivileged uid: when agentrl runs as root, bwrap itself is started as
  ``uid_base + n`` (no account needed), because ``RLIMIT_NPROC`` does not bind root. Each
  sandbox gets its own uid, so one sandbox's fork bomb cannot use up another's process quota.
  As a normal user, the sandbox runs as that user.
* Limits: ``prlimit`` sets outer limits on the whole run (processes, address space, CPU, file
  size, with some headroom for bwrap and the runner); the runner sets the exact ones on the
  code and enforces the wall-clock limit; the host kills the process group if the run
  outlives ``wall_time_s + 5 s``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import trio

from agentrl.tools.sandbox.base import ExecResult, Sandbox, SandboxSettings, parse_report, runner_source

HOST_GRACE_S = 5.0
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


class LocalSandbox(Sandbox):
    def __init__(self, settings: SandboxSettings, slot: int = 0):
        reason = bwrap_available()
        if reason:
            raise RuntimeError(f"the local sandbox cannot run: {reason}")
        self.settings = settings
        self.python, self.extra_binds = _python_inside(settings)
        self.root = Path(tempfile.mkdtemp(prefix="agentrl-sandbox-"))
        self.workdir = self.root / "work"
        self.ctl = self.root / "ctl"
        self.workdir.mkdir()
        self.ctl.mkdir()
        (self.ctl / "runner.py").write_text(runner_source())
        os.chmod(self.root, 0o755)
        os.chmod(self.ctl, 0o755)
        self.uid: int | None = None
        if os.geteuid() == 0:
            self.uid = settings.uid_base + (os.getpid() * 64 + slot) % 100_000
            os.chown(self.workdir, self.uid, self.uid)
        os.chmod(self.workdir, 0o700)
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self._counter = 0

    def command(self, payload_name: str) -> list[str]:
        s = self.settings
        outer_nproc = s.max_processes + 8  # bwrap, its init and the runner count too
        outer_as = (s.memory_mb + 256) << 20
        argv = [
            "prlimit", f"--nproc={outer_nproc}", f"--as={outer_as}",
            f"--cpu={int(s.cpu_time_s) + 5}", f"--fsize={s.max_file_mb << 20}", "--core=0", "--",
            "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--ro-bind", "/usr", "/usr",
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
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(s.tmpfs_mb << 20), "--tmpfs", "/tmp",
            "--ro-bind", str(self.ctl), "/.agentrl",
            "--bind", str(self.workdir), "/work",
            "--chdir", "/work", "--clearenv",
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
            "--setenv", "HOME", "/work", "--setenv", "LANG", "C.UTF-8",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--", self.python, "-I", "/.agentrl/runner.py", f"/.agentrl/{payload_name}",
        ]
        return argv

    async def _invoke(self, payload: dict) -> ExecResult:
        self._counter += 1
        name = f"payload-{self._counter}.json"
        path = self.ctl / name
        path.write_text(json.dumps(payload))
        os.chmod(path, 0o644)
        options = {}
        if self.uid is not None:
            options = {"user": self.uid, "group": self.uid, "extra_groups": []}

        async def kill_group(proc: trio.Process) -> None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        try:
            with trio.move_on_after(self.settings.wall_time_s + HOST_GRACE_S) as scope:
                proc = await trio.run_process(
                    self.command(name), stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True,
                    check=False, start_new_session=True, deliver_cancel=kill_group, env=_HOST_ENV, **options,
                )
        finally:
            path.unlink(missing_ok=True)
        if scope.cancelled_caught:
            return ExecResult(exit_code=None, limit="wall_time")
        result = parse_report(proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace"))
        if result.error and proc.returncode:
            result.error += f" (bwrap exit code {proc.returncode})"
        return result

    async def run(self, code: str, *, files: dict[str, str] | None = None, stdin: str = "") -> ExecResult:
        # The pid namespace already confines processes, so the runner needs no process limit
        # of its own beyond prlimit's; set it anyway so a fork bomb is reported as such.
        return await self._invoke(self.settings.payload("run", code, files, stdin, workdir="/work"))

    async def reset(self) -> None:
        # Every process of a run dies with its pid namespace; only the files need to go.
        for child in self.workdir.iterdir():
            if child.is_dir() and not child.is_symlink():
                await trio.to_thread.run_sync(shutil.rmtree, child, True)
            else:
                child.unlink(missing_ok=True)

    async def close(self) -> None:
        self._finalizer()
