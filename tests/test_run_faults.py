"""A run that tells the truth after any fault (issue 25, "Faults").

Unit tests of the logic -- the accounting read back from a run folder (without dumps, without a
checkpoint), the summary, the learner's restart note, the stop order, checkpoint writes that
fail -- then two real ``agentrl run`` processes: one killed piece by piece (kill -9 of the actor,
then of the learner after a periodic checkpoint) and stopped with SIGTERM, one whose warm start
never varies and that ends by itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from agentrl.config import load_config
from agentrl.protocol import encode
from tests._learner_helpers import ListSource, Recorder, make_group, tiny_model  # noqa: F401
from tests._processes import stop_agentrl_run

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "calculator" / "config.toml"


# ------------------------------------------------------------------ a run folder, written by hand


def _ranges(seqs: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for q in sorted(seqs):
        if out and q == out[-1][1] + 1:
            out[-1][1] = q
        else:
            out.append([q, q])
    return out


def write_checkpoint(
    run_dir: Path,
    *,
    step: int,
    received: dict[tuple[str, str], list[int]],
    consumed: int,
    dropped: dict[str, int],
    pending: int,
    lineage: str = "lin",
    segment: int = 1,
    root: str = "checkpoints",
) -> Path:
    """A learner checkpoint as save_checkpoint lays it out (what accounting reads of it)."""
    path = run_dir / root / "learn" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    ledger = {
        "sessions": [[a, s, _ranges(seqs)] for (a, s), seqs in received.items()],
        "latest": {a: s for a, s in received},
    }
    counters = {
        "received": sum(len(v) for v in received.values()),
        "consumed": consumed,
        **{f"dropped_{k}": v for k, v in dropped.items()},
    }
    caller = {
        "policy_version": step,
        "lineage": lineage,
        "journal_segment": segment,
        "counters": counters,
        "ledger": ledger,
    }
    torch.save({"step": step, "caller": caller}, path / "trainer_state.pt")
    (path / "pending_groups.bin").write_bytes(msgpack.packb([b"x"] * pending) if pending else b"")
    (path / "meta.json").write_text(
        json.dumps(
            {
                "step": step,
                "lineage": lineage,
                "saved_at": time.time(),
                "caller": {"lineage": lineage, "journal_segment": segment},
            }
        )
    )
    (path.parent / "latest").write_text(path.name)
    return path


def write_batches(run_dir: Path, steps: list[list[tuple[str, str, int]]]) -> None:
    with (run_dir / "learner_batches.jsonl").open("a") as f:
        for i, keys in enumerate(steps, 1):
            f.write(json.dumps({"step": i, "groups": [list(k) for k in keys]}) + "\n")


def write_report(run_dir: Path, index: int, session: str, produced: int, acked: int) -> None:
    log = run_dir / "logs" / f"actor{index}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(
            json.dumps(
                {
                    "actor_id": f"actor{index}",
                    "session": session,
                    "groups_produced": produced,
                    "groups_acked": acked,
                    "groups_delivered": produced,
                    "groups_lost": 0,
                }
            )
            + "\n"
        )


def journal(run_dir: Path, lineage: str, segment: int, keys: list[tuple[str, str, int]]) -> None:
    from agentrl.learner.journal import Journal

    j = Journal(run_dir / "journal", lineage)
    j.segment = segment
    rng = np.random.default_rng(0)
    for a, s, q in keys:
        j.append(encode(make_group(rng, actor_id=a, session=s, seq=q)))
    j.close()


def a_killed_and_a_clean_session(run_dir: Path) -> None:
    """actor0's first session was killed after the learner received seq 0..5 but 3 (lost with it);
    its second session stopped cleanly: produced 4, all acknowledged. The checkpoint at step 2
    consumed 4 groups, dropped 2 (zero variance) and holds 2; one more group of the second session
    arrived after it (in the journal)."""
    killed = [0, 1, 2, 4, 5]
    clean = [0, 1, 2]
    write_checkpoint(
        run_dir,
        step=2,
        received={("actor0", "A"): killed, ("actor0", "B"): clean},
        consumed=4,
        dropped={"zero_variance": 2},
        pending=2,
    )
    write_batches(run_dir, [[("actor0", "A", 0), ("actor0", "A", 1)], [("actor0", "A", 2), ("actor0", "B", 0)]])
    journal(run_dir, "lin", 1, [("actor0", "B", 3)])
    write_report(run_dir, 0, "B", produced=4, acked=4)


def test_accounting_without_dumps_counts_the_killed_session_and_balances(tmp_path: Path) -> None:
    from agentrl.run.accounting import account, balance_line, describe

    a_killed_and_a_clean_session(tmp_path)
    acc = account(tmp_path)
    assert acc["balanced"], acc["problems"]
    assert acc["produced_from"] == "sequence numbers and final reports"
    # the killed session produced at least 6 (its highest number received + 1): 3 of them never arrived
    assert (acc["produced"], acc["received"], acc["abandoned_by_killed_actors"], acc["unacked_at_end"]) == (10, 9, 1, 0)
    assert (acc["consumed"], acc["dropped"], acc["held"], acc["trained"]) == (4, {"zero_variance": 2}, 3, 4)
    assert (acc["actor_sessions"], acc["actor_sessions_killed"], acc["checkpoint_step"]) == (2, 1, 2)
    killed = next(s for s in acc["sessions"] if s["killed"])
    assert killed["session"] == "A" and killed["produced_from"] == "its highest sequence number received"
    line = balance_line(acc)
    assert "produced 10 (2 actor sessions, 1 killed) = received 9 + abandoned 1" in line and line.endswith(": balanced")
    assert describe(acc)[-1] == "balanced: yes"


def test_accounting_names_what_does_not_balance(tmp_path: Path) -> None:
    """The balance has teeth without dumps: a clean session's acknowledged group that the learner does
    not hold, a group trained twice, a received group past what its session reports producing."""
    from agentrl.run.accounting import account, balance_line

    a_killed_and_a_clean_session(tmp_path)
    write_report(tmp_path, 1, "C", produced=2, acked=2)  # acknowledged, but the learner holds none of them
    write_batches(tmp_path, [[("actor0", "A", 0), ("actor0", "A", 0)]])  # step 1 again: the same group twice
    acc = account(tmp_path)
    assert not acc["balanced"]
    problems = " | ".join(acc["problems"])
    assert "actor session C (actor1) reports 2 groups acknowledged; the learner holds 0" in problems
    assert "1 groups trained more than once" in problems
    assert "NOT balanced" in balance_line(acc)
    (tmp_path / "logs" / "actor0.log").write_text("")
    write_report(tmp_path, 0, "B", produced=2, acked=2)  # B's seq 2 and 3 arrived: it never produced them
    assert any("2 received groups that no actor produced" in p for p in account(tmp_path)["problems"])


def test_accounting_of_a_learner_that_never_checkpointed_reads_its_journal(tmp_path: Path) -> None:
    """A failed run whose learner died before any checkpoint still gets its accounting: the journal
    says what was received; no weights survived, so all of it is held (a restart replays it)."""
    from agentrl.run.accounting import account

    journal(tmp_path, "only", 0, [("actor0", "A", q) for q in range(4)])
    acc = account(tmp_path)
    assert acc["balanced"], acc["problems"]
    assert acc["checkpoint"] is None and "no checkpoint" in acc["learner_source"]
    assert (acc["produced"], acc["received"], acc["consumed"], acc["held"], acc["actor_sessions_killed"]) == (
        4,
        4,
        0,
        4,
        1,
    )
    assert not account(tmp_path / "empty")["balanced"]


def test_accounting_takes_the_fallback_checkpoint_when_it_is_newer(tmp_path: Path) -> None:
    from agentrl.run.accounting import account

    write_checkpoint(tmp_path, step=1, received={("actor0", "A"): [0, 1]}, consumed=2, dropped={}, pending=0)
    write_checkpoint(
        tmp_path,
        step=2,
        received={("actor0", "A"): [0, 1, 2, 3]},
        consumed=4,
        dropped={},
        pending=0,
        root="checkpoints_fallback",
    )
    write_batches(tmp_path, [[("actor0", "A", 0), ("actor0", "A", 1)], [("actor0", "A", 2), ("actor0", "A", 3)]])
    acc = account(tmp_path)
    assert acc["balanced"] and acc["checkpoint_step"] == 2 and "checkpoints_fallback" in acc["checkpoint"]


def test_summary_tells_steps_versions_and_every_session(tmp_path: Path) -> None:
    """learner_steps is the checkpoint's step (not the last metrics row), policy_versions_seen shows a
    version going backwards, groups_produced counts the killed session, the learner's stop and its
    failed checkpoint writes are there."""
    from agentrl.run.report import RunState, summarize

    a_killed_and_a_clean_session(tmp_path)
    (tmp_path / "learner_metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    (tmp_path / "learner_status.json").write_text(
        json.dumps(
            {
                "received": 9,
                "consumed": 4,
                "exit_reason": "stopped",
                "stop_message": "",
                "checkpoint_errors": ["checkpoint of step 1 failed 6 times: PermissionError"],
            }
        )
    )
    state = RunState(tmp_path)
    for v in (0, 0, 1, 2, 3, 1, 1, 2):  # the learner came back from its checkpoint at version 1
        state.see_version(v)
    state.rl_started = time.monotonic()
    summary = summarize(state, load_config(EXAMPLE), tmp_path)
    assert summary["learner_steps"] == 2 and summary["accounting"]["checkpoint_step"] == 2
    assert summary["policy_versions_seen"] == [0, 1, 2, 3, 1, 2]
    produced = summary["groups_produced"]
    assert (produced["total"], produced["sessions"], produced["sessions_killed"], produced["of_killed_sessions"]) == (
        10,
        2,
        1,
        6,
    )
    assert produced["groups_delivered"] == 4 + 6
    assert summary["learner_stop"] == {"reason": "stopped", "message": None}
    assert summary["checkpoint_errors"] == ["checkpoint of step 1 failed 6 times: PermissionError"]
    assert any("PermissionError" in e for e in summary["events"])


def test_the_learner_restart_note_says_what_really_happens(tmp_path: Path) -> None:
    from agentrl.run.stages import learner_restart_note

    log = tmp_path / "logs" / "learner.log"
    log.parent.mkdir(parents=True)
    log.write_text(
        "step 3 | loss 0.1\nTraceback (most recent call last):\n  File x\n"
        "PermissionError: [Errno 13] Permission denied: 'checkpoints/learn/step_00000004'\n"
    )
    journal(tmp_path, "lin", 0, [("actor0", "A", q) for q in range(3)])
    note = learner_restart_note(tmp_path)
    assert note.startswith(
        "no checkpoint: starts again from the initial weights, redoing every step, and replays 3 journal groups"
    )
    assert note.endswith(
        "its last error: PermissionError: [Errno 13] Permission denied: 'checkpoints/learn/step_00000004'"
    )
    write_checkpoint(tmp_path, step=2, received={("actor0", "A"): [0, 1]}, consumed=2, dropped={}, pending=0)
    journal(tmp_path, "lin", 1, [("actor0", "A", 2), ("actor0", "A", 3)])
    assert learner_restart_note(tmp_path).startswith(
        f"resumes from its checkpoint at step 2 ({tmp_path / 'checkpoints' / 'learn' / 'step_00000002'}), replays 2 "
        "journal groups received after it and redoes the steps after 2"
    )


def test_restarts_are_printed_on_the_console_as_they_happen(tmp_path: Path, capsys) -> None:
    from agentrl.run.report import RunState
    from agentrl.run.stages import _on_event

    state = RunState(tmp_path)
    _on_event(state, "actor0", "exited with status -9; restart 1/3")
    _on_event(state, "learner", "exited with status 1; restart 1/3")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and state.restarts == {"actor0": 1, "learner": 1}
    assert out[0].startswith("restart: ") and "actor0: exited with status -9; restart 1/3 (its unacknowledged" in out[0]
    assert "learner: exited with status 1; restart 1/3 (no checkpoint: starts again from the initial weights" in out[1]


def test_drop_rows_after_keeps_one_row_per_step(tmp_path: Path) -> None:
    from agentrl.learner.loop import drop_rows_after

    path = tmp_path / "learner_metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    assert drop_rows_after(path, 2) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert drop_rows_after(path, 2) == 0 and drop_rows_after(tmp_path / "absent.jsonl", 0) == 0


def test_a_clean_stop_stops_the_actors_first_and_within_the_grace(tmp_path: Path) -> None:
    """The actors are stopped (SIGTERM) while the learner still runs; the learner gets its SIGTERM only
    once they have exited. An actor's drain ends well inside the grace, so it prints its report."""
    import trio

    from agentrl.actors.actor import ActorSettings
    from agentrl.run.process_plan import ChildSpec
    from agentrl.run.supervisor import STOP_GRACE_S, Supervisor

    assert ActorSettings().drain_timeout_s <= STOP_GRACE_S / 2
    script = (
        "import signal, sys, time, pathlib\n"
        "out = pathlib.Path(sys.argv[1])\n"
        "def stop(*_):\n"
        "    time.sleep(float(sys.argv[2]))\n"
        "    out.write_text(repr(time.monotonic()))\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "pathlib.Path(str(out) + '.up').write_text('')\n"
        "while True: time.sleep(1)\n"
    )

    def spec(name: str, drain_s: float) -> ChildSpec:
        return ChildSpec(
            name, [sys.executable, "-c", script, str(tmp_path / name), str(drain_s)], tmp_path / f"{name}.log"
        )

    async def main() -> None:
        sup = Supervisor(stop_first=("actor",))
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for child in (spec("learner", 0.0), spec("actor0", 1.0), spec("actor1", 0.5)):
                    await sup.start(nursery, child)
                while not all((tmp_path / f"{n}.up").exists() for n in ("learner", "actor0", "actor1")):
                    await trio.sleep(0.05)  # state in other processes: polled with the deadline above
                nursery.cancel_scope.cancel()

    trio.run(main)
    stopped = {n: float((tmp_path / n).read_text()) for n in ("learner", "actor0", "actor1")}
    assert stopped["learner"] > stopped["actor0"] and stopped["learner"] > stopped["actor1"]


# ------------------------------------------------------------------ the learner's checkpoints


def _learner_overrides(model: Path, run_dir: Path, **extra) -> list[str]:
    items = {
        "model.path": f'"{model}"',
        "run.run_dir": f'"{run_dir}"',
        "learner.groups_per_step": "2",
        "learner.max_tokens_per_microbatch": "128",
        "learner.device": '"cpu"',
        "tracking.enabled": "false",
        "actors.group_size": "4",
        "learner.checkpoint_every_steps": "1",
    }
    items.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in items.items()]


def test_a_checkpoint_write_that_fails_is_retried_reported_and_the_weights_survive(
    tiny_model, tmp_path, monkeypatch
) -> None:
    """The checkpoint folder refuses writes (here: a file where the folder goes; root ignores chmod).
    Each write is retried, then goes to the fallback folder, reported; a learner resumes from there and
    its redone steps leave one metrics row per step. When the fallback refuses too, training goes on
    and the final weights still reach the engines."""
    import agentrl.learner.loop as loop
    from agentrl.learner.checkpoint import fallback_root, latest_run_checkpoint
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.loop import Learner, LearnerIO

    monkeypatch.setattr(loop, "CHECKPOINT_BACKOFF_S", 0.0)
    init_distributed("cpu")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "learn").write_text("not a folder")
    rng = np.random.default_rng(0)
    groups = [make_group(rng, group_id=f"g{i}", session="s", seq=i, version=0 if i < 4 else 2) for i in range(6)]
    first = Learner(
        load_config(None, _learner_overrides(tiny_model, tmp_path, **{"learner.max_steps": 2})),
        io=LearnerIO(source=ListSource(groups[:4]), progress=Recorder(), weights=Recorder()),
    )
    assert first.run() == "done" and first.trainer.step == 2
    status = json.loads((tmp_path / "learner_status.json").read_text())
    assert status["checkpoint_step"] == 2 and status["exit_reason"] == "done"
    assert len(status["checkpoint_errors"]) == 2  # steps 1 and 2, each written to the fallback after 3 failures
    assert (
        "written to" in status["checkpoint_errors"][-1] and "after 3 failed writes" in status["checkpoint_errors"][-1]
    )
    assert latest_run_checkpoint(tmp_path, "learn") == fallback_root(tmp_path, "learn") / "step_00000002"

    with (tmp_path / "learner_metrics.jsonl").open("a") as f:  # what a learner killed after step 4 left
        f.write(json.dumps({"step": 3}) + "\n" + json.dumps({"step": 4}) + "\n")
    (tmp_path / "checkpoints_fallback" / "learn" / "latest").unlink()  # it still finds the newest complete one
    import shutil

    shutil.rmtree(tmp_path / "checkpoints_fallback" / "learn" / "step_00000001")
    (tmp_path / "checkpoints_fallback" / "learn").rename(tmp_path / "kept")
    (tmp_path / "checkpoints_fallback" / "learn").parent.rmdir()
    (tmp_path / "checkpoints_fallback").write_text("refuses writes too")
    rec = Recorder()  # a missing batch would wait 1 s (the data clock runs: the checkpoint's groups count)
    second = Learner(
        load_config(
            None,
            _learner_overrides(tiny_model, tmp_path, **{"learner.max_steps": 3, "learner.max_wait_for_data_s": 1.0}),
        ),
        io=LearnerIO(source=ListSource(groups[4:]), progress=rec, weights=rec),
    )
    second._resume = _resume_from(second, tmp_path / "kept" / "step_00000002")
    assert second.run() == "done" and second.trainer.step == 3
    assert [v for v, _ in rec.pushes][-1] == second.version  # the final weights reached the engines
    steps = [json.loads(line)["step"] for line in (tmp_path / "learner_metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    status = json.loads((tmp_path / "learner_status.json").read_text())
    assert (
        status["checkpoint_step"] == 2
        and "failed 6 times, also in the fallback folder" in status["checkpoint_errors"][-1]
    )
    assert "training goes on" in status["checkpoint_errors"][-1]


def _resume_from(learner, path: Path):
    """The learner's own _resume, finding ``path`` as the run's newest checkpoint."""
    import agentrl.learner.checkpoint as checkpoint

    def resume() -> None:
        original = checkpoint.latest_run_checkpoint
        checkpoint.latest_run_checkpoint = lambda run_dir, kind: path
        try:
            type(learner)._resume(learner)
        finally:
            checkpoint.latest_run_checkpoint = original

    return resume


# ------------------------------------------------------------------ real runs


def _start_run(run_dir: Path, model: Path, *sets: str) -> tuple[subprocess.Popen, Path]:
    out = run_dir.parent / "console.txt"
    args = [sys.executable, "-m", "agentrl", "run", str(EXAMPLE), "--no-live", "--run-dir", str(run_dir)]
    for item in (
        f"model.path={model}",
        "sft.enabled=false",
        "tracking.enabled=false",
        "eval.num_tasks=4",
        "learner.groups_per_step=2",
        "actors.group_size=4",
        "actors.num_concurrent_episodes=16",
        "actors.max_new_tokens_per_turn=24",
        *sets,
    ):
        args += ["-s", item]
    with out.open("w") as f:
        proc = subprocess.Popen(
            args, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
    return proc, out


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "learner_metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            pass
    return out


def _until(predicate, what: str, proc: subprocess.Popen, console: Path, deadline: float) -> None:
    while not predicate():  # state in other processes: polled, with a deadline
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {what}:\n{console.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{console.read_text()[-3000:]}"
        time.sleep(0.2)


def _child_pid(run_dir: Path, word: str) -> int | None:
    """The pid of the run's child whose command has ``word`` (``serve-actors``, ``learn``)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if word.encode() in argv and str(run_dir / "config.toml").encode() in argv:
            return int(proc.name)
    return None


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(900)
def test_kill_9_of_the_actor_then_the_learner_then_sigterm_tells_the_truth(tiny_model: Path, tmp_path: Path) -> None:
    """No trajectory dumps. kill -9 of the actor, then of the learner one step after a periodic
    checkpoint, then SIGTERM to the run. The console printed each restart as it happened and the
    balance at the end; the learner's note said it resumes from that checkpoint; the accounting
    counts the killed actor session in what was produced and balances; the actor session SIGTERM
    stopped is not counted as killed; learner_steps is the checkpoint's step; the policy versions
    show the one going backwards; learner_metrics.jsonl has one row per step."""
    run_dir = tmp_path / "run"
    proc, console = _start_run(
        run_dir,
        tiny_model,
        "learner.max_steps=1000",
        "learner.checkpoint_every_steps=2",
        "learner.dynamic_sampling=false",
    )
    deadline = time.monotonic() + 700
    try:
        _until(lambda: len(_steps(run_dir)) >= 2, "two learner steps", proc, console, deadline)
        actor = _child_pid(run_dir, "serve-actors")
        assert actor is not None
        os.kill(actor, signal.SIGKILL)
        _until(
            lambda: "actor0: exited with status -9; restart 1/3" in console.read_text(),
            "the actor's restart line",
            proc,
            console,
            deadline,
        )
        killed_at = max(_steps(run_dir))
        # one step after a checkpoint (every 2 steps), past the actor's restart
        _until(
            lambda: (s := max(_steps(run_dir))) >= killed_at + 2 and s % 2 == 1,
            "a step after a checkpoint",
            proc,
            console,
            deadline,
        )
        learner = _child_pid(run_dir, "learn")
        assert learner is not None
        resumed_from = max(_steps(run_dir)) - 1
        killed = f"pid {learner}, group {os.getpgid(learner)}: {Path(f'/proc/{learner}/cmdline').read_bytes()!r}"
        os.killpg(learner, signal.SIGKILL)
        _until(
            lambda: "learner: exited with status -9; restart 1/3" in console.read_text(),
            f"the learner's restart (killed {killed} at step {resumed_from + 1})",
            proc,
            console,
            deadline,
        )
        _until(lambda: _steps(run_dir)[-1] >= resumed_from + 2, "the resumed learner's steps", proc, console, deadline)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        stop_agentrl_run(proc)
    text = console.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    restart = next(line for line in text.splitlines() if line.startswith("restart: ") and "learner:" in line)
    assert f"resumes from its checkpoint at step {resumed_from}" in restart, restart
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert acc["balanced"], acc["problems"]
    assert acc["produced_from"] == "sequence numbers and final reports"
    assert acc["actor_sessions"] == 2 and acc["actor_sessions_killed"] == 1, acc["sessions"]
    assert not [s for s in acc["sessions"] if s["killed"] and s["produced_from"] == "its final report"]
    assert acc["produced"] == acc["received"] + acc["abandoned_by_killed_actors"] + acc["unacked_at_end"]
    killed = next(s for s in acc["sessions"] if s["killed"])
    produced = summary["groups_produced"]
    assert produced["total"] == acc["produced"] and produced["of_killed_sessions"] == killed["produced"] > 0
    assert produced["groups_delivered"] >= acc["received"] - killed["produced"]
    assert summary["learner_steps"] == acc["checkpoint_step"] >= resumed_from
    versions = summary["policy_versions_seen"]
    assert any(b < a for a, b in zip(versions, versions[1:])), versions  # backwards after the resume
    steps = _steps(run_dir)
    assert steps == list(range(1, len(steps) + 1))
    balance = [line for line in text.splitlines() if line.startswith("accounting: produced")]
    assert balance and balance[-1].endswith(": balanced"), text[-3000:]
    pids = [int(line.split("pid ")[1].rstrip(")")) for line in summary["events"] if "started (pid" in line]
    assert pids and not any(_alive(p) for p in pids)


@pytest.mark.timeout(600)
def test_a_run_whose_warm_start_never_varies_ends_by_itself_with_the_reason(tiny_model: Path, tmp_path: Path) -> None:
    """A random tiny model never answers right: every group's rewards are all 0, dynamic sampling
    drops them all, no batch ever fills. With the wait bound shortened, the run ends on its own (the
    learner is not restarted), with a checkpoint, and says why on the console and in summary.json.
    Three operations on five-digit operands: answers of five digits and more, which a random model
    does not write by chance (with one small operation it did, once in CI, and one group varied)."""
    run_dir = tmp_path / "run"
    proc, console = _start_run(
        run_dir,
        tiny_model,
        "env.kwargs.min_ops=3",
        "env.kwargs.max_operand=100000",
        "learner.max_steps=10",
        "learner.dynamic_sampling=true",
        "learner.max_wait_for_data_s=15",
        "learner.wait_log_interval_s=5",
    )
    try:
        proc.wait(timeout=540)
    finally:
        stop_agentrl_run(proc)
    text = console.read_text()
    assert proc.returncode == 0, text[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    stop = summary["learner_stop"]
    assert stop["reason"] == "data_timeout" and "learner.max_wait_for_data_s = 15" in stop["message"]
    assert "GRPO learns nothing from those" in stop["message"] and "GRPO learns nothing from those" in text
    assert summary["restarts"] == {} and summary["learner_steps"] == 0
    assert summary["accounting"]["checkpoint"] and summary["accounting"]["balanced"], summary["accounting"]
    assert summary["groups_dropped"].get("zero_variance", 0) >= 2
