"""Where every trajectory group of a run went, read back from its run folder.

The balance the exactly-once delivery promises (``agentrl.transport.delivery``) across any
kill of an actor, an engine or the learner::

    produced = received + abandoned        abandoned: held by an actor process that died, or
                                           sent after the learner's last acknowledgement
    received = consumed + dropped (by reason) + held (pending in the learner's final checkpoint)
    trained twice = 0                      the last line per step of learner_batches.jsonl is
                                           what the final weights saw

Sources, all in the run folder: the learner's final checkpoint (its counters, the ledger of
received keys, the pending groups), ``learner_batches.jsonl``, the actors' final reports (the
JSON line each actor process prints when it stops, in ``logs/actor<i>.log``; a killed process
prints none) and, with ``actors.dump_trajectories``, every group each actor process stamped
(``trajectories/actor<i>.jsonl``, written before the group is sent). Without the dumps what a
killed actor produced is unknown, and ``produced`` is ``None``.

Sessions: each actor process is one session of its actor id. A session whose process printed
a final report ended cleanly: what the learner lacks from it must be exactly what it reports
unacknowledged (``groups_produced - groups_acked``). Any other session died: what the learner
lacks from it was abandoned with it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

Key = tuple[str, str, int]  # (actor_id, session, seq)


def final_reports(run_dir: Path) -> list[dict[str, Any]]:
    """The report every actor process that stopped cleanly printed (one JSON line), all logs."""
    reports = []
    for log_path in sorted((run_dir / "logs").glob("actor*.log")):
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"groups_produced"' in line:
                try:
                    reports.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return reports


def produced_keys(run_dir: Path) -> list[Key] | None:
    """Every group the actors stamped, from their dumps; ``None`` without dumps. A line a kill cut
    short was never sent (the dump is written first) and is not counted."""
    paths = sorted((run_dir / "trajectories").glob("actor*.jsonl"))
    if not paths:
        return None
    keys: list[Key] = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            try:
                d = json.loads(line)
                keys.append((str(d["actor_id"]), str(d["session"]), int(d["seq"])))
            except (ValueError, KeyError, TypeError):
                continue
    return keys


def _ledger_keys(ledger: dict[str, Any]) -> set[Key]:
    return {(a, s, seq) for a, s, ranges in ledger.get("sessions", []) for lo, hi in ranges
            for seq in range(lo, hi + 1)}


def trained_keys(run_dir: Path) -> Counter:
    """How often each group was trained on by the steps the final weights saw (the last line
    per step: a restarted learner re-does the steps after its checkpoint)."""
    last: dict[int, list] = {}
    path = run_dir / "learner_batches.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
            last[int(row["step"])] = [tuple(k) for k in row["groups"]]
        except (ValueError, KeyError, TypeError):
            continue  # a line a kill cut short
    return Counter(k for keys in last.values() for k in keys)


def account(run_dir: str | Path) -> dict[str, Any]:
    """The balance of a finished run (see the module docstring); ``balanced`` says whether it holds."""
    import msgpack
    import torch

    from agentrl.learner.checkpoint import latest_checkpoint

    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir / "checkpoints" / "learn")
    if ckpt is None:
        return {"balanced": False, "problems": ["no learner checkpoint in the run folder"]}
    caller = torch.load(ckpt / "trainer_state.pt", weights_only=True)["caller"]
    counters = caller.get("counters", {})
    received = _ledger_keys(caller.get("ledger", {}))
    pending_path = ckpt / "pending_groups.bin"
    held = len(msgpack.unpackb(pending_path.read_bytes())) if pending_path.exists() and pending_path.stat().st_size else 0
    dropped = {k[len("dropped_"):]: int(v) for k, v in counters.items() if k.startswith("dropped_") and v}
    trained = trained_keys(run_dir)
    reports = final_reports(run_dir)
    ended = {r["session"]: r for r in reports if r.get("session")}

    problems = []
    consumed = int(counters.get("consumed", 0))
    if int(counters.get("received", 0)) != len(received):
        problems.append(f"the learner counted {counters.get('received', 0)} groups received, its ledger holds "
                        f"{len(received)}")
    if len(received) != consumed + sum(dropped.values()) + held:
        problems.append(f"received {len(received)} != consumed {consumed} + dropped {sum(dropped.values())} + "
                        f"held {held}")
    twice = sum(1 for n in trained.values() if n > 1)
    if twice:
        problems.append(f"{twice} groups trained more than once")
    if sum(trained.values()) != consumed:
        problems.append(f"the final weights saw {sum(trained.values())} groups, the learner consumed {consumed}")
    if set(trained) - received:
        problems.append(f"{len(set(trained) - received)} trained groups are not in the ledger")

    out: dict[str, Any] = {
        "checkpoint": str(ckpt), "received": len(received), "consumed": consumed, "dropped": dropped, "held": held,
        "duplicates_dropped": int(counters.get("duplicate", 0)), "trained": sum(trained.values()),
        "trained_twice": twice, "actor_processes_ended": len(reports),
        "groups_lost_by_actors": sum(int(r.get("groups_lost", 0)) for r in reports),
    }
    produced = produced_keys(run_dir)
    if produced is None:
        out["produced"] = None
        out["unacked_at_end"] = sum(int(r["groups_produced"]) - int(r["groups_acked"]) for r in reports)
    else:
        produced_set = set(produced)
        if len(produced_set) != len(produced):
            problems.append(f"{len(produced) - len(produced_set)} keys stamped twice")
        if received - produced_set:
            problems.append(f"{len(received - produced_set)} received groups that no actor produced")
        missing = produced_set - received
        by_session = Counter(s for _, s, _ in missing)
        unacked_at_end = sum(n for s, n in by_session.items() if s in ended)
        for session, report in ended.items():
            expected = int(report["groups_produced"]) - int(report["groups_acked"])
            if by_session.get(session, 0) != expected:
                problems.append(f"actor session {session} reports {expected} groups unacknowledged; the learner "
                                f"lacks {by_session.get(session, 0)} of its groups")
        sessions = {s for _, s, _ in produced_set}
        out.update({
            "produced": len(produced_set), "actor_sessions": len(sessions),
            "actor_sessions_killed": len(sessions - set(ended)),
            "abandoned_by_killed_actors": sum(n for s, n in by_session.items() if s not in ended),
            "unacked_at_end": unacked_at_end,
        })
        if len(produced_set) != len(received) + len(missing):
            problems.append("produced != received + abandoned")  # cannot happen once the two above hold
    out["problems"] = problems
    out["balanced"] = not problems
    return out


def describe(acc: dict[str, Any]) -> list[str]:
    """The balance in words, one line each (``bench/chaos.py``, the run's log)."""
    if acc.get("produced") is None and "received" not in acc:
        return [f"accounting: {'; '.join(acc.get('problems', []))}"]
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(acc["dropped"].items())) or "none"
    lines = []
    if acc.get("produced") is not None:
        lines.append(f"groups produced {acc['produced']} = received {acc['received']} + abandoned "
                     f"{acc['abandoned_by_killed_actors'] + acc['unacked_at_end']} (with killed actor processes "
                     f"{acc['abandoned_by_killed_actors']}, sent after the learner's last acknowledgement "
                     f"{acc['unacked_at_end']}); actor sessions {acc['actor_sessions']}, killed "
                     f"{acc['actor_sessions_killed']}")
    lines.append(f"groups received {acc['received']} = consumed {acc['consumed']} + dropped "
                 f"{sum(acc['dropped'].values())} ({dropped}) + held {acc['held']}")
    lines.append(f"duplicates received and dropped {acc['duplicates_dropped']}; trained twice {acc['trained_twice']}; "
                 f"groups lost by the actors before stamping (failed episodes) {acc['groups_lost_by_actors']}")
    lines.append("balanced: yes" if acc["balanced"] else f"balanced: NO: {'; '.join(acc['problems'])}")
    return lines
