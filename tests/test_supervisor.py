"""The supervisor with real child processes: restarts, failure, clean stop."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio
import trio.lowlevel

from agentrl.run.supervisor import ChildFailed, ChildSpec, Supervisor


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _gone_soon(pid: int, within_s: float = 3.0) -> bool:
    """A killed process may take a moment to disappear from the process table."""
    import time

    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _child_failure(sup: Supervisor, *specs: ChildSpec) -> ChildFailed:
    """Start ``specs`` under ``sup`` and wait for a failure: the :class:`ChildFailed` it raises."""

    async def main() -> None:
        async with trio.open_nursery() as n:
            for spec in specs:
                await sup.start(n, spec)
            n.start_soon(sup.wait_for_failure)

    with pytest.raises(BaseExceptionGroup) as info:
        trio.run(main)
    failed = info.value.subgroup(ChildFailed)
    assert failed is not None
    return failed.exceptions[0]


def test_restarts_then_fails_naming_child_and_log(tmp_path: Path) -> None:
    events: list[tuple[str, str]] = []
    sup = Supervisor(stop_grace_s=2, on_event=lambda n, w: events.append((n, w)))
    crash = ChildSpec(
        "actor", _py("print('boom from actor'); raise SystemExit(3)"), tmp_path / "actor.log", max_restarts=2
    )
    err = _child_failure(sup, crash)
    assert err.name == "actor" and err.returncode == 3
    assert "boom from actor" in err.log_tail
    assert sup.children["actor"].restarts == 2
    assert sum("restart" in w for _, w in events) == 2
    assert (tmp_path / "actor.log").read_text().count("boom from actor") == 3


def test_a_killed_child_is_restarted_with_its_restart_command(tmp_path: Path) -> None:
    """kill -9 of a child (an engine): restarted once, with ``restart_argv`` (an engine comes back
    without a weight version), after which it finishes and is left alone."""
    import signal

    events: list[tuple[str, str]] = []
    sup = Supervisor(stop_grace_s=2, on_event=lambda n, w: events.append((n, w)))
    ready = tmp_path / "first.pid"
    first = _py(
        f"import os, time; open({str(ready)!r}, 'w').write(str(os.getpid())); print('first', flush=True); "
        "time.sleep(60)"
    )
    spec = ChildSpec(
        "engine0",
        first,
        tmp_path / "engine0.log",
        max_restarts=1,
        restart_argv=_py("print('restarted without a version')"),
    )

    async def main() -> None:
        async with trio.open_nursery() as n:
            await sup.start(n, spec)
            with trio.fail_after(30):  # the child's readiness signal: it wrote its pid
                while not ready.exists() or not ready.read_text():
                    await trio.sleep(0.05)
            os.kill(int(ready.read_text()), signal.SIGKILL)
            assert await sup.wait_finished("engine0") == 0

    trio.run(main)
    assert sup.children["engine0"].restarts == 1
    assert [w for _, w in events if "restart" in w] == ["exited with status -9; restart 1/1"]
    assert (tmp_path / "engine0.log").read_text().splitlines() == ["first", "restarted without a version"]


def test_critical_failure_stops_the_others(tmp_path: Path) -> None:
    sup = Supervisor(stop_grace_s=2)
    sleeper = ChildSpec("engine", _py("import time; time.sleep(60)"), tmp_path / "engine.log")
    learner = ChildSpec(
        "learner", _py("import time; time.sleep(0.5); raise SystemExit(1)"), tmp_path / "learner.log", critical=True
    )
    assert _child_failure(sup, sleeper, learner).name == "learner"
    engine_pid = sup.children["engine"].process.pid
    assert _gone_soon(engine_pid)


def test_cancel_stops_process_tree_and_finished_child_is_not_restarted(tmp_path: Path) -> None:
    sup = Supervisor(stop_grace_s=1)
    # a child that ignores SIGTERM and has a grandchild: both must be gone after cancellation
    stubborn = ChildSpec(
        "stubborn",
        _py(
            "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(p.pid, flush=True); time.sleep(60)"
        ),
        tmp_path / "stubborn.log",
    )
    done = ChildSpec("oneshot", _py("print('ok')"), tmp_path / "oneshot.log")

    async def main() -> None:
        async with trio.open_nursery() as n:
            await sup.start(n, stubborn)
            await sup.start(n, done)
            assert await sup.wait_finished("oneshot") == 0
            log = tmp_path / "stubborn.log"
            with trio.fail_after(30):  # the stubborn child has started its grandchild (and said which)
                while not log.read_text().strip():
                    await trio.sleep(0.05)
            n.cancel_scope.cancel()

    trio.run(main)
    assert sup.children["oneshot"].restarts == 0
    grandchild = int((tmp_path / "stubborn.log").read_text().split()[0])
    assert _gone_soon(sup.children["stubborn"].process.pid)
    assert _gone_soon(grandchild)


def test_copy_redacted_replaces_secrets_split_across_chunks(tmp_path: Path) -> None:
    """Fed one byte at a time (every secret split at every place), with a secret that begins inside a
    false start of itself and one that contains another: no secret reaches the log, nothing else changes."""
    from trio.testing import memory_stream_one_way_pair

    from agentrl.run.supervisor import copy_redacted

    text = b"key=sk-sk-abc123; admin=sk-abc123-admin\nnot a key: sk-ab\ntail without newline sk-abc12"
    log = tmp_path / "engine.log"

    async def main() -> None:
        send, receive = memory_stream_one_way_pair()
        done = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(copy_redacted, receive, log, ("sk-abc123", "sk-abc123-admin", ""), done)
            for i in range(len(text)):
                await send.send_all(text[i : i + 1])
                await trio.lowlevel.checkpoint()
            await send.aclose()
        assert done.is_set()

    trio.run(main)
    assert log.read_bytes() == (b"key=sk-<redacted>; admin=<redacted>\nnot a key: sk-ab\ntail without newline sk-abc12")


def test_a_redacted_child_logs_everything_but_its_secrets(tmp_path: Path) -> None:
    """A child that writes its secret in pieces on stdout and stderr and dies: the log has all its
    output but the secret, and the failure quotes its last line (copied before the log is read)."""
    sup = Supervisor(stop_grace_s=2)
    code = (
        "import sys, time\n"
        "for part in ('api_key=sk-', 'live', '-42 ok\\n'):\n"
        "    sys.stdout.write(part); sys.stdout.flush(); time.sleep(0.2)\n"
        "sys.stderr.write('Traceback: bad key sk-live-42'); sys.stderr.flush(); sys.exit(5)"
    )
    spec = ChildSpec("engine0", _py(code), tmp_path / "engine0.log", critical=True, redact=("sk-live-42",))
    err = _child_failure(sup, spec)
    assert (tmp_path / "engine0.log").read_text() == "api_key=<redacted> ok\nTraceback: bad key <redacted>"
    assert err.returncode == 5 and err.log_tail.endswith("Traceback: bad key <redacted>")


def test_copy_redacted_is_the_whole_texts_redaction_however_it_is_chunked(tmp_path: Path) -> None:
    import random

    from trio.testing import memory_stream_one_way_pair

    from agentrl.run.supervisor import copy_redacted, redact

    keys = ("sk-abc123", "sk-abc123-admin", "k9k9k")
    rng = random.Random(0)
    pieces = [b"sk-", b"abc", b"123", b"-admin", b"k9", b"k", b"\n", b"x", b"s", b"-"]
    for trial in range(200):
        text = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 60)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
        log = tmp_path / f"log{trial}"

        async def main() -> None:
            send, receive = memory_stream_one_way_pair()
            async with trio.open_nursery() as n:
                n.start_soon(copy_redacted, receive, log, keys, trio.Event())
                for a, b in zip([0, *cuts], [*cuts, len(text)]):
                    await send.send_all(text[a:b])
                    await trio.lowlevel.checkpoint()
                await send.aclose()

        trio.run(main)
        expected = redact(text, sorted((k.encode() for k in keys), key=len, reverse=True))
        assert log.read_bytes() == expected, (text, cuts)
        assert b"sk-abc123" not in log.read_bytes() and b"k9k9k" not in log.read_bytes()
