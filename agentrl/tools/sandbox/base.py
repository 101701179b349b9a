"""The sandbox interface shared by the ``local`` (bubblewrap), ``docker`` and ``e2b`` backends.

A :class:`Sandbox` runs Python code and returns an :class:`ExecResult`; it keeps a work directory
for one episode, and :meth:`Sandbox.reset` empties it and ends leftover processes before the next
episode. Every backend runs the same stdlib-only runner (``executor.py``) inside, which applies
the per-run limits and reports as JSON, so limits and reports read the same everywhere; a backend
adds its outer wall and implements :meth:`Sandbox.execute`.

:meth:`Sandbox.call_function` is for graders: each call of a function from untrusted source runs
in a fresh process and returns JSON text (:class:`CallResult`); expected values never enter the
sandbox. :class:`SandboxSettings` mirrors the ``[sandbox]`` config section. See docs/tools.md.
"""

from __future__ import annotations

import abc
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

RUNNER_PATH = Path(__file__).with_name("executor.py")
MARKER = "__AGENTRL_RESULT__"


@dataclass
class SandboxSettings:
    backend: str = "local"  # local | docker | e2b
    image: str = "agentrl-python:latest"  # docker image
    e2b_template: str = ""  # e2b template; empty = the SDK's default
    pool_size: int = 4  # idle sandboxes kept for reuse
    cpu_time_s: float = 5.0
    wall_time_s: float = 10.0
    memory_mb: int = 256
    max_processes: int = 32
    max_output_chars: int = 4000
    max_file_mb: int = 16  # largest file (and stdout/stderr) a run may write
    max_open_files: int = 256  # RLIMIT_NOFILE of everything in the sandbox
    tmpfs_mb: int = 64  # size of the private /tmp
    work_mb: int = 64  # size of /work (a tmpfs; see the backends for where it lives)
    uid_base: int = 61000  # when agentrl is root (local) and always (docker): sandboxes run as uid_base + n
    python: str = ""  # local backend: interpreter inside the sandbox; empty = /usr/bin/python3
    docker_host: str = ""  # empty: DOCKER_HOST or the default socket
    cpus: float = 1.0  # docker: CPU share of a container
    lifetime_s: float = 3600.0  # docker/e2b: a container/VM ends itself after this long
    max_live: int = 0  # most sandboxes alive at once (0: unbounded); acquire waits beyond it

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> SandboxSettings:
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sandbox setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        settings = cls(**values)
        if settings.backend not in ("local", "docker", "e2b"):
            raise ValueError(f"sandbox backend must be local, docker or e2b, got {settings.backend!r}")
        return settings

    def payload(
        self,
        action: str = "run",
        code: str = "",
        files: dict[str, str] | None = None,
        stdin: str = "",
        workdir: str = "/work",
        sweep_uid: bool = False,
        function: str = "",
        calls: list[list[Any]] | None = None,
    ) -> dict[str, Any]:
        """The runner's input for one invocation."""
        return {
            "action": action,
            "code": code,
            "files": files or {},
            "stdin": stdin,
            "workdir": workdir,
            "cpu_time_s": self.cpu_time_s,
            "wall_time_s": self.wall_time_s,
            "memory_mb": self.memory_mb,
            "max_processes": self.max_processes,
            "max_output_bytes": 4 * self.max_output_chars,
            "max_file_bytes": self.max_file_mb << 20,
            "sweep_uid": sweep_uid,
            "function": function,
            "calls": calls or [],
        }

    @property
    def total_memory_mb(self) -> int:
        """What one run may hold in all (local cgroup, docker container): ``memory_mb`` for the
        code, 64 MB for the runner, and the tmpfs it can fill (/tmp, /dev/shm, /work), whose
        pages count as memory; so files never eat into the code's share."""
        return self.memory_mb + 64 + 2 * self.tmpfs_mb + self.work_mb

    def sandbox_uid(self, slot: int) -> int:
        """The unprivileged uid of sandbox ``slot`` of this process: its own, so that
        ``RLIMIT_NPROC`` (counted per uid on the whole host) bounds this sandbox alone."""
        return self.uid_base + (os.getpid() * 64 + slot) % 100_000


_LIMIT_TEXT = {
    "wall_time": "wall-clock time limit of {wall:g} s exceeded",
    "cpu_time": "CPU time limit of {cpu:g} s exceeded",
    "memory": "memory limit of {mem} MB exceeded",
    "file_size": "output/file size limit exceeded",
    "processes": "process limit reached",
}


@dataclass
class ExecResult:
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = 0  # None: killed on a time-out or the sandbox failed
    limit: str = ""  # which limit stopped the code: wall_time, cpu_time, memory, file_size, processes
    truncated: bool = False
    duration_s: float = 0.0
    error: str = ""  # the sandbox itself failed (not the code)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.limit and not self.error

    def render(self, settings: SandboxSettings | None = None, max_chars: int | None = None) -> str:
        """What the model sees: output, then errors, then one bracketed status line if not clean."""
        s = settings or SandboxSettings()
        max_chars = max_chars or s.max_output_chars
        parts = []
        if self.stdout:
            parts.append(self.stdout.rstrip("\n"))
        if self.stderr:
            parts.append(self.stderr.rstrip("\n"))
        text = "\n".join(parts)
        if len(text) > max_chars:
            text, truncated = text[:max_chars], True
        else:
            truncated = self.truncated
        notes = []
        if self.error:
            notes.append(f"sandbox error: {self.error}")
        if self.limit:
            notes.append(
                _LIMIT_TEXT.get(self.limit, self.limit).format(wall=s.wall_time_s, cpu=s.cpu_time_s, mem=s.memory_mb)
            )
        elif self.exit_code is not None and self.exit_code < 0:
            notes.append(f"killed by signal {-self.exit_code}")
        elif self.exit_code:
            notes.append(f"exit code {self.exit_code}")
        if truncated:
            notes.append("output truncated")
        if notes:
            text = (text + "\n" if text else "") + "[" + "; ".join(notes) + "]"
        return text or "(no output)"


@dataclass
class CallResult:
    """One call of :meth:`Sandbox.call_function`: the JSON text of the return value, or why not."""

    value: str | None = None  # json.dumps of what the function returned, as the sandbox wrote it
    error: str = ""


def parse_calls(result: ExecResult, count: int) -> list[CallResult]:
    """The ``count`` call results of a "calls" report; every call failed if the report is
    missing, malformed or of another length (whatever the sandbox wrote, never more)."""
    reported = result.extra.get("calls")
    if result.error or not isinstance(reported, list) or len(reported) != count:
        why = result.error or (f"stopped: {result.limit}" if result.limit else "no valid report of the calls")
        return [CallResult(error=why) for _ in range(count)]
    calls = []
    for item in reported:
        value = item.get("value") if isinstance(item, dict) else None
        error = item.get("error") if isinstance(item, dict) else None
        calls.append(
            CallResult(
                value=value if isinstance(value, str) else None,
                error=str(error)[:300] if error else ("" if isinstance(value, str) else "no result"),
            )
        )
    return calls


def parse_report(stdout: str, stderr: str = "") -> ExecResult:
    """Decode the runner's report from its stdout (the line after the marker)."""
    idx = stdout.rfind(MARKER)
    if idx < 0:
        detail = (stderr or stdout).strip()[-500:] or "no output"
        return ExecResult(exit_code=None, error=f"the sandbox runner did not report ({detail})")
    try:
        report = json.loads(stdout[idx + len(MARKER) :].strip().splitlines()[0])
    except (ValueError, IndexError, RecursionError) as e:
        return ExecResult(exit_code=None, error=f"unreadable sandbox report: {e}")
    wrong = (
        [k for k, kinds in _REPORT_FIELDS.items() if k in report and not isinstance(report[k], kinds)]
        if isinstance(report, dict)
        else ["(not an object)"]
    )
    if wrong:
        return ExecResult(exit_code=None, error=f"unreadable sandbox report: bad {', '.join(wrong)}")
    return ExecResult(
        **{k: v for k, v in report.items() if k in _REPORT_FIELDS},
        extra={k: v for k, v in report.items() if k not in _REPORT_FIELDS},
    )


_REPORT_FIELDS: dict[str, tuple[type, ...]] = {
    "stdout": (str,),
    "stderr": (str,),
    "exit_code": (int, type(None)),
    "limit": (str,),
    "truncated": (bool,),
    "duration_s": (int, float),
    "error": (str,),
}


def runner_source() -> str:
    return RUNNER_PATH.read_text()


class Sandbox(abc.ABC):
    """One sandbox; used by one episode at a time. Backends implement ``execute``, ``reset``
    and ``close``, and set ``work_path`` where the work directory inside is not ``/work``."""

    settings: SandboxSettings
    work_path: str = "/work"

    @abc.abstractmethod
    async def execute(self, payload: dict[str, Any]) -> ExecResult:
        """Run the runner on ``payload`` (see ``SandboxSettings.payload``) and return its report."""

    async def run(self, code: str, *, files: dict[str, str] | None = None, stdin: str = "") -> ExecResult:
        """Run ``code`` with Python inside the sandbox, within the settings' limits."""
        return await self.execute(self.settings.payload("run", code, files, stdin, workdir=self.work_path))

    async def call_function(self, source: str, function: str, arg_lists: list[list[Any]]) -> list[CallResult]:
        """Call ``function`` (defined by ``source``) on each argument list, each call in a fresh
        process in this sandbox, all within one ``wall_time_s``; one :class:`CallResult` per call."""
        payload = self.settings.payload(
            "calls",
            source,
            workdir=self.work_path,
            sweep_uid=True,
            function=function,
            calls=[list(args) for args in arg_lists],
        )
        return parse_calls(await self.execute(payload), len(arg_lists))

    @abc.abstractmethod
    async def reset(self) -> None:
        """Empty the work directory and end leftover processes (between episodes)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Destroy the sandbox and everything it started."""
