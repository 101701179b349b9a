"""Where every trajectory group of a run went, read back from its run folder.

The balance the exactly-once delivery promises (``agentrl.transport.delivery``) across any
kill of an actor, an engine or the learner::

    produced = received + abandoned        abandoned: produced by an actor session and never
                                           received (it died with the group, or sent it after
                                           the learner's last acknowledgement)
    received = consumed + dropped (by reason) + held (pending in the learner's last checkpoint,
                                           or in its journal after that checkpoint)
    trained twice = 0                      the last line per step of learner_batches.jsonl, up
                                           to the checkpoint's step, is what the weights saw

**What each actor session produced** needs no dumps. Every group carries ``(actor_id,
session, seq)`` with ``seq`` counting 0, 1, 2, ... in the session, so the learner's ledger
(its last checkpoint, plus the journal segments written after it) knows that a session
produced at least its highest sequence number received + 1; the numbers below it that never
arrived were abandoned. A session whose process printed its final report (one JSON line in
``logs/actor<i>.log``) ended cleanly: it says exactly how many it produced and how many the
learner acknowledged (all of those must be in the ledger). Any other session was killed; with
``actors.dump_trajectories`` (``trajectories/actor<i>.jsonl``, written before a group is sent)
its exact production is known, without them it is its highest received number + 1 (what it
stamped after its last group that arrived died with it, unseen).

**Without a checkpoint** (a run whose learner failed before its first one) the learner's
journal alone says what was received; no weights survived, so nothing counts as consumed and
every received group is held (a restart replays them). See docs/run.md.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import msgpack

from agentrl.learner.journal import Journal
from agentrl.protocol import ProtocolError, TrajectoryGroup, decode

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
    return {
        (a, s, seq) for a, s, ranges in ledger.get("sessions", []) for lo, hi in ranges for seq in range(lo, hi + 1)
    }


def trained_keys(run_dir: Path, up_to_step: int | None = None) -> Counter:
    """How often each group was trained on by the steps the surviving weights saw: the last line
    per step (a restarted learner re-does the steps after its checkpoint), steps up to
    ``up_to_step`` (the checkpoint's; the steps after it died with their learner)."""
    last: dict[int, list] = {}
    path = run_dir / "learner_batches.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
            last[int(row["step"])] = [tuple(k) for k in row["groups"]]
        except (ValueError, KeyError, TypeError):
            continue  # a line a kill cut short
    return Counter(k for step, keys in last.items() if up_to_step is None or step <= up_to_step for k in keys)


def journal_keys(journal_dir: Path, first_segment: int) -> list[Key]:
    """The keys of the groups in a journal lineage's segments from ``first_segment`` on."""
    keys: list[Key] = []
    for path in sorted(journal_dir.glob("*.log")):
        if not path.stem.isdigit() or int(path.stem) < first_segment:
            continue
        for record in Journal._read(path):
            try:
                group = decode(record)
            except ProtocolError:
                continue
            if isinstance(group, TrajectoryGroup):
                keys.append(group.key)
    return keys


def newest_journal(run_dir: Path) -> Path | None:
    """The journal lineage written last (the one a learner without a checkpoint continues)."""
    root = run_dir / "journal"
    lineages = [d for d in root.iterdir() if d.is_dir() and any(d.glob("*.log"))] if root.is_dir() else []
    return max(lineages, key=lambda d: max(p.stat().st_mtime for p in d.glob("*.log")), default=None)


def learner_view(run_dir: Path) -> dict[str, Any]:
    """What the learner holds, as a restarted learner would find it: its last checkpoint (counters,
    ledger, pending groups) plus the groups its journal received after it; or the journal alone."""
    import torch

    from agentrl.learner.checkpoint import latest_run_checkpoint

    ckpt = latest_run_checkpoint(run_dir, "learn")
    if ckpt is None:
        journal = newest_journal(run_dir)
        keys = set(journal_keys(journal, 0)) if journal is not None else set()
        return {
            "checkpoint": None,
            "step": 0,
            "counters": {"received": len(keys)},
            "ledger": set(),
            "received": keys,
            "held": len(keys),
            "source": f"journal {journal} (no checkpoint)" if journal else "nothing",
        }
    caller = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    step, caller = int(caller.get("step", 0)), caller["caller"]
    ledger = _ledger_keys(caller.get("ledger", {}))
    pending_path = ckpt / "pending_groups.bin"
    pending = (
        len(msgpack.unpackb(pending_path.read_bytes())) if pending_path.exists() and pending_path.stat().st_size else 0
    )
    after: set[Key] = set()
    if caller.get("lineage") and isinstance(caller.get("journal_segment"), int):
        after = set(journal_keys(run_dir / "journal" / str(caller["lineage"]), caller["journal_segment"])) - ledger
    return {
        "checkpoint": ckpt,
        "step": step,
        "counters": caller.get("counters", {}),
        "ledger": ledger,
        "received": ledger | after,
        "held": pending + len(after),
        "journal_after_checkpoint": len(after),
        "source": f"checkpoint {ckpt}" + (f" + {len(after)} groups of its journal" if after else ""),
    }


def _sessions(
    received: set[Key], reports: list[dict[str, Any]], produced: list[Key] | None, problems: list[str]
) -> dict[tuple[str, str], dict[str, Any]]:
    """Per actor session: produced, received, abandoned, whether it was killed (module docstring)."""
    got: dict[tuple[str, str], list[int]] = defaultdict(list)
    for a, s, seq in received:
        got[(a, s)].append(seq)
    dumped: dict[tuple[str, str], set[int]] = defaultdict(set)
    for a, s, seq in produced or []:
        dumped[(a, s)].add(seq)
    ended = {(str(r.get("actor_id", "")), str(r["session"])): r for r in reports if r.get("session")}
    out = {}
    for key in sorted(set(got) | set(dumped) | set(ended)):
        seqs, report = got.get(key, []), ended.get(key)
        if report is not None:
            count, source = int(report["groups_produced"]), "its final report"
            if int(report.get("groups_acked", 0)) > len(seqs):
                problems.append(
                    f"actor session {key[1]} ({key[0]}) reports {report['groups_acked']} groups "
                    f"acknowledged; the learner holds {len(seqs)} of its groups"
                )
        elif produced is not None:
            count, source = len(dumped.get(key, ())), "its trajectory dump"
        else:
            count, source = max(seqs, default=-1) + 1, "its highest sequence number received"
        beyond = (
            [q for q in seqs if q >= count]
            if produced is None or report is not None
            else [q for q in seqs if q not in dumped.get(key, ())]
        )
        if beyond:
            problems.append(f"{len(beyond)} received groups that no actor produced (session {key[1]} of {key[0]})")
        out[key] = {
            "actor_id": key[0],
            "session": key[1],
            "produced": count,
            "received": len(seqs),
            "abandoned": max(0, count - len(seqs) + len(beyond)),
            "killed": report is None,
            "produced_from": source,
        }
    return out


def account(run_dir: str | Path) -> dict[str, Any]:
    """The balance of a run, finished or not (see the module docstring); ``balanced`` says whether it holds."""
    run_dir = Path(run_dir)
    view = learner_view(run_dir)
    counters, received, ckpt = view["counters"], view["received"], view["checkpoint"]
    held = view["held"]
    dropped = (
        {k[len("dropped_") :]: int(v) for k, v in counters.items() if k.startswith("dropped_") and v} if ckpt else {}
    )
    consumed = int(counters.get("consumed", 0)) if ckpt else 0
    trained = trained_keys(run_dir, view["step"]) if ckpt else Counter()
    reports = final_reports(run_dir)
    problems: list[str] = []
    if view["checkpoint"] is None and not received:
        problems.append("no learner checkpoint and no journal in the run folder")
    if ckpt and int(counters.get("received", 0)) != len(view["ledger"]):
        problems.append(
            f"the learner counted {counters.get('received', 0)} groups received, its ledger holds {len(view['ledger'])}"
        )
    if len(received) != consumed + sum(dropped.values()) + held:
        problems.append(
            f"received {len(received)} != consumed {consumed} + dropped {sum(dropped.values())} + held {held}"
        )
    twice = sum(1 for n in trained.values() if n > 1)
    if twice:
        problems.append(f"{twice} groups trained more than once")
    if sum(trained.values()) != consumed:
        problems.append(f"the weights saw {sum(trained.values())} groups, the learner consumed {consumed}")
    if set(trained) - received:
        problems.append(f"{len(set(trained) - received)} trained groups are not in the ledger")
    produced = produced_keys(run_dir)
    if produced is not None and len(set(produced)) != len(produced):
        problems.append(f"{len(produced) - len(set(produced))} keys stamped twice")
    sessions = _sessions(received, reports, produced, problems)
    killed = [s for s in sessions.values() if s["killed"]]
    out: dict[str, Any] = {
        "checkpoint": str(ckpt) if ckpt else None,
        "checkpoint_step": view["step"],
        "learner_source": view["source"],
        "produced": sum(s["produced"] for s in sessions.values()),
        "produced_from": "trajectory dumps" if produced is not None else "sequence numbers and final reports",
        "received": len(received),
        "consumed": consumed,
        "dropped": dropped,
        "held": held,
        "duplicates_dropped": int(counters.get("duplicate", 0)),
        "trained": sum(trained.values()),
        "trained_twice": twice,
        "actor_sessions": len(sessions),
        "actor_sessions_killed": len(killed),
        "actor_processes_ended": len(reports),
        "abandoned_by_killed_actors": sum(s["abandoned"] for s in killed),
        "unacked_at_end": sum(s["abandoned"] for s in sessions.values() if not s["killed"]),
        "groups_lost_by_actors": sum(int(r.get("groups_lost", 0)) for r in reports),
        "sessions": list(sessions.values()),
    }
    if out["produced"] != out["received"] + out["abandoned_by_killed_actors"] + out["unacked_at_end"]:
        problems.append(
            f"produced {out['produced']} != received {out['received']} + abandoned "
            f"{out['abandoned_by_killed_actors'] + out['unacked_at_end']}"
        )
    out["problems"] = problems
    out["balanced"] = not problems
    return out


def describe(acc: dict[str, Any]) -> list[str]:
    """The balance in words, one line each (``bench/chaos.py``, the run's log)."""
    if "received" not in acc:
        return [f"accounting: {'; '.join(acc.get('problems', []))}"]
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(acc["dropped"].items())) or "none"
    return [
        f"groups produced {acc['produced']} = received {acc['received']} + abandoned "
        f"{acc['abandoned_by_killed_actors'] + acc['unacked_at_end']} (with killed actor processes "
        f"{acc['abandoned_by_killed_actors']}, sent after the learner's last acknowledgement {acc['unacked_at_end']}); "
        f"actor sessions {acc['actor_sessions']}, killed {acc['actor_sessions_killed']} (produced from "
        f"{acc.get('produced_from', 'trajectory dumps')})",
        f"groups received {acc['received']} = consumed {acc['consumed']} + dropped {sum(acc['dropped'].values())} "
        f"({dropped}) + held {acc['held']} ({acc.get('learner_source', 'the learner')})",
        f"duplicates received and dropped {acc['duplicates_dropped']}; trained twice {acc['trained_twice']}; "
        f"groups lost by the actors before stamping (failed episodes) {acc['groups_lost_by_actors']}",
        "balanced: yes" if acc["balanced"] else f"balanced: NO: {'; '.join(acc['problems'])}",
    ]


def balance_line(acc: dict[str, Any]) -> str:
    """The balance on one line (the console's last words on a run)."""
    if "received" not in acc:
        return f"accounting: NOT balanced: {'; '.join(acc.get('problems', []))}"
    abandoned = acc["abandoned_by_killed_actors"] + acc["unacked_at_end"]
    verdict = "balanced" if acc["balanced"] else f"NOT balanced: {'; '.join(acc['problems'])}"
    return (
        f"accounting: produced {acc['produced']} ({acc['actor_sessions']} actor sessions, "
        f"{acc['actor_sessions_killed']} killed) = received {acc['received']} + abandoned {abandoned}; received = "
        f"consumed {acc['consumed']} + dropped {sum(acc['dropped'].values())} + held {acc['held']}; trained twice "
        f"{acc['trained_twice']}: {verdict}"
    )
