"""Start, watch and stop the processes of a run, under one trio nursery.

Each child is a :class:`ChildSpec`: an argv, a log file, a restart budget and whether it is
*critical*. The supervisor:

* starts every child in its own process group (so a child's own children -- torchrun's
  ranks, uvicorn workers -- are stopped with it) with stdout/stderr going to its log file;
  through a pipe that replaces the spec's ``redact`` secrets by ``<redacted>`` when it has some
  (an SGLang engine's keys, which SGLang logs at start);
* restarts a non-critical child that exits with an error or is killed, up to ``max_restarts``
  times, backing off 0.5, 1, 2, 4, 5, 5 ... seconds, with ``restart_argv`` when the spec has
  one (an engine comes back without a weight version, see ``agentrl.run.process_plan``), and reports
  each restart through ``on_event``;
* when a critical child exits with an error, or a child runs out of restarts, stops all
  the others and raises :class:`ChildFailed` naming the child and quoting the end of its log;
* on cancellation (Ctrl-C, or the caller leaving the nursery) sends SIGTERM to every
  process group, waits ``stop_grace_s``, then SIGKILLs what is left. Nothing outlives it.
  Children named with a ``stop_first`` prefix (``agentrl run``: the actors) are stopped first;
  the others wait for them (at most ``stop_grace_s``), so a stopping actor still gets the
  learner's acknowledgements and prints its final report, and a clean stop kills no actor.

A child that exits with status 0 is done: it is not restarted (``agentrl learn`` finishing
its steps is how a run ends). See docs/run.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from agentrl.run.process_plan import ChildSpec  # what to start; here: how


class ChildFailed(RuntimeError):
    """A child the run cannot do without has failed."""

    def __init__(self, name: str, returncode: int | None, log_path: Path, log_tail: str):
        self.name, self.returncode, self.log_path, self.log_tail = name, returncode, log_path, log_tail
        super().__init__(
            f"{name} exited with status {returncode} (log: {log_path})\n--- end of its log ---\n{log_tail}"
        )


@dataclass
class ChildState:
    spec: ChildSpec
    process: trio.Process | None = None
    restarts: int = 0
    exited: bool = False
    returncode: int | None = None
    logged: trio.Event | None = None  # set when a redacted child's output has all reached its log


REDACTED = b"<redacted>"
LOG_DRAIN_S = 5.0  # how long an exited child's last output may take to reach its log (grandchildren hold the pipe)
STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL; an actor's drain (ActorSettings.drain_timeout_s) ends well inside it


def redact(data: bytes, secrets: list[bytes]) -> bytes:
    for secret in secrets:
        data = data.replace(secret, REDACTED)
    return data


def _safe_cut(data: bytes, secrets: list[bytes]) -> int:
    """Where ``data`` can be cut with no secret across the cut: before the longest end of ``data``
    that a secret begins with (the next bytes may finish it; a whole secret can be the start of a
    longer one), and before any whole secret that would straddle the cut."""
    cut = len(data)
    for secret in secrets:
        for n in range(min(len(secret) - 1, len(data)), len(data) - cut, -1):
            if data.endswith(secret[:n]):
                cut = len(data) - n
                break
    moved = True
    while moved:
        moved = False
        for secret in secrets:
            i = data.find(secret, max(0, cut - len(secret) + 1))
            if -1 < i < cut:
                cut, moved = i, True
    return cut


async def copy_redacted(
    stream: trio.abc.ReceiveStream, log_path: Path, secrets: tuple[str, ...], done: trio.Event
) -> None:
    """Append ``stream`` to ``log_path`` with every secret replaced, also across chunk boundaries;
    the end of a chunk that may be the start of a secret waits for the next chunk (or the end)."""
    keys = sorted({s.encode() for s in secrets if s}, key=len, reverse=True)
    pending = b""
    with trio.CancelScope(shield=True):  # opened even when cancelled: ``done`` is always set
        log = await trio.open_file(log_path, "ab", buffering=0)
    try:
        async for chunk in stream:
            pending += chunk
            cut = _safe_cut(pending, keys)
            await log.write(redact(pending[:cut], keys))
            pending = pending[cut:]
    finally:
        with trio.CancelScope(shield=True):
            await log.write(redact(pending, keys))
            await log.aclose()
            done.set()
            await stream.aclose()


def log_tail(path: Path, num_lines: int = 20) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(lines[-num_lines:])


class Supervisor:
    """Owns the children of one run. Use :meth:`start` inside a nursery, then :meth:`wait`."""

    def __init__(
        self,
        stop_grace_s: float = STOP_GRACE_S,
        on_event: Callable[[str, str], None] | None = None,
        stop_first: tuple[str, ...] = (),
    ):
        self.children: dict[str, ChildState] = {}
        self.stop_grace_s = stop_grace_s
        self.stop_first = tuple(stop_first)
        self.on_event = on_event or (lambda name, what: None)
        self._failure: ChildFailed | None = None
        self._failed = trio.Event()

    async def start(self, nursery: trio.Nursery, spec: ChildSpec) -> ChildState:
        if spec.name in self.children:
            raise ValueError(f"a child named {spec.name!r} is already supervised")
        state = ChildState(spec)
        self.children[spec.name] = state
        await nursery.start(self._watch, state)
        return state

    async def _spawn(self, state: ChildState, pumps: trio.Nursery) -> None:
        spec = state.spec
        argv = spec.restart_argv if state.restarts and spec.restart_argv else spec.argv
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        if spec.redact:
            state.process = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={**os.environ, **spec.env},
                cwd=spec.cwd,
                start_new_session=True,
            )
            state.logged = trio.Event()
            stdout = state.process.stdout
            assert stdout is not None  # stdout=PIPE
            pumps.start_soon(copy_redacted, stdout, spec.log_path, spec.redact, state.logged)
        else:
            log = await trio.to_thread.run_sync(lambda: open(spec.log_path, "ab", buffering=0))
            with log:
                state.process = await trio.lowlevel.open_process(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **spec.env},
                    cwd=spec.cwd,
                    start_new_session=True,
                )
        self.on_event(spec.name, f"started (pid {state.process.pid})")

    async def _watch(self, state: ChildState, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as pumps:  # the log copies of redacted children
            await self._spawn(state, pumps)
            task_status.started()
            try:
                while True:
                    assert state.process is not None
                    code = await state.process.wait()
                    state.returncode = code
                    if state.logged is not None:  # its last words (a traceback) are in the log before it is read
                        with trio.move_on_after(LOG_DRAIN_S):
                            await state.logged.wait()
                    if code == 0:
                        state.exited = True
                        self.on_event(state.spec.name, "finished")
                        return
                    if state.spec.critical or state.restarts >= state.spec.max_restarts:
                        state.exited = True
                        self._fail(state)
                        return
                    state.restarts += 1
                    self.on_event(
                        state.spec.name,
                        f"exited with status {code}; restart {state.restarts}/{state.spec.max_restarts}",
                    )
                    await trio.sleep(min(0.5 * 2 ** (state.restarts - 1), 5.0))
                    await self._spawn(state, pumps)
            finally:
                with trio.CancelScope(shield=True):
                    await self._stop(state)
                    if state.logged is not None:
                        with trio.move_on_after(LOG_DRAIN_S):
                            await state.logged.wait()
                pumps.cancel_scope.cancel()  # a pipe a stray grandchild keeps open must not hold the run

    def _fail(self, state: ChildState) -> None:
        if self._failure is None:
            spec = state.spec
            self._failure = ChildFailed(spec.name, state.returncode, spec.log_path, log_tail(spec.log_path))
            self.on_event(spec.name, f"failed with status {state.returncode}")
            self._failed.set()

    async def _stop(self, state: ChildState) -> None:
        proc = state.process
        if proc is None or proc.returncode is not None:
            _kill_group(proc, signal.SIGKILL)  # leftovers of an exited leader
            return
        if self.stop_first and not state.spec.name.startswith(self.stop_first):
            with trio.move_on_after(self.stop_grace_s):
                await self._first_ones_stopped()
        _kill_group(proc, signal.SIGTERM)
        with trio.move_on_after(self.stop_grace_s):
            await proc.wait()
        _kill_group(proc, signal.SIGKILL)
        await proc.wait()

    async def _first_ones_stopped(self) -> None:
        """Until no child named with a ``stop_first`` prefix runs (they are being stopped too)."""
        while any(
            c.spec.name.startswith(self.stop_first) and c.process is not None and c.process.poll() is None
            for c in self.children.values()
        ):
            await trio.sleep(0.05)

    async def wait_for_failure(self) -> None:
        """Return only by raising :class:`ChildFailed` when a child has failed for good."""
        await self._failed.wait()
        assert self._failure is not None
        raise self._failure

    async def wait_finished(self, name: str) -> int | None:
        """Wait until child ``name`` has exited for good; return its status."""
        state = self.children[name]
        while not state.exited:
            await trio.sleep(0.1)
        return state.returncode


def _kill_group(proc: trio.Process | None, sig: int) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
