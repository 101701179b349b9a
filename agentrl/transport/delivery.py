"""Exactly-once delivery of trajectory groups: the actor's :class:`Outbox`, the learner's :class:`Ledger`.

Every group is stamped ``(actor_id, session, seq)``: the actor's stable name, a session new at every
start of the actor process, and a count within the session. ZMQ keeps the order of one connection,
but a group can still be lost (a dying learner, a broken connection) or arrive twice (resent).

The learner's :class:`Ledger` records every key as ranges, drops one it has seen, and acknowledges
what its journal holds on disk in each ``Progress`` (:class:`~agentrl.protocol.ActorAck`). The
actor holds what it sent until acknowledged (at most ``max_unacked``) and resends everything when
the learner's session changes, and a held group sent before one the learner acknowledged (given
the order of one connection, it is lost). So the learner trains on each group exactly once, and
``produced = consumed + dropped + held by the learner + lost with a dead process``.

An actor's use of the budget (``Progress.accept_groups``) is what the learner holds from its actor
id over all sessions, plus what it holds unacknowledged, plus groups started and not finished.
See docs/transport.md.
"""

from __future__ import annotations

import bisect
import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from agentrl.protocol import MAX_ACK_RANGES, ActorAck, Progress, TrajectoryGroup

log = logging.getLogger(__name__)


class SeqRanges:
    """A set of sequence numbers as sorted, disjoint, non-adjacent inclusive ranges."""

    def __init__(self, ranges: list[tuple[int, int]] | None = None) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.count = 0
        for lo, hi in ranges or []:
            for seq in (lo, hi):
                if seq < 0:
                    raise ValueError(f"negative sequence number {seq}")
            self.starts.append(lo)
            self.ends.append(hi)
            self.count += hi - lo + 1

    def __contains__(self, seq: int) -> bool:
        i = bisect.bisect_right(self.starts, seq) - 1
        return i >= 0 and seq <= self.ends[i]

    def add(self, seq: int) -> bool:
        """Add ``seq``; False when it was already there. O(1) for the next number in order."""
        if self.ends and seq == self.ends[-1] + 1:  # the usual case
            self.ends[-1] = seq
            self.count += 1
            return True
        i = bisect.bisect_right(self.starts, seq) - 1  # the range starting at or before seq
        if i >= 0 and seq <= self.ends[i]:
            return False
        joins_left = i >= 0 and self.ends[i] == seq - 1
        joins_right = i + 1 < len(self.starts) and self.starts[i + 1] == seq + 1
        if joins_left and joins_right:
            self.ends[i] = self.ends.pop(i + 1)
            del self.starts[i + 1]
        elif joins_left:
            self.ends[i] = seq
        elif joins_right:
            self.starts[i + 1] = seq
        else:
            self.starts.insert(i + 1, seq)
            self.ends.insert(i + 1, seq)
        self.count += 1
        return True

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.starts, self.ends))


@dataclass
class _ActorRecord:
    groups: int = 0
    latest: str = ""  # the session whose first group arrived last


class Ledger:
    """The learner's record of every group key it holds (see the module docstring)."""

    def __init__(self) -> None:
        self.sessions: dict[tuple[str, str], SeqRanges] = {}
        self.actors: dict[str, _ActorRecord] = {}

    def __contains__(self, group: TrajectoryGroup) -> bool:
        seqs = self.sessions.get((group.actor_id, group.session))
        return seqs is not None and group.seq in seqs

    def record(self, group: TrajectoryGroup) -> bool:
        """Record ``group``'s key; False when it was already recorded (a duplicate)."""
        key = (group.actor_id, group.session)
        seqs = self.sessions.get(key)
        actor = self.actors.setdefault(group.actor_id, _ActorRecord())
        if seqs is None:
            seqs = self.sessions[key] = SeqRanges()
            if actor.latest:
                log.info("actor %s: new session %s (was %s)", group.actor_id, group.session, actor.latest)
            actor.latest = group.session
        if not seqs.add(group.seq):
            return False
        actor.groups += 1
        return True

    @property
    def total(self) -> int:
        """Distinct groups recorded, from every actor."""
        return sum(a.groups for a in self.actors.values())

    def acks(self) -> list[ActorAck]:
        """One entry per actor id: its latest session's newest ranges and the counts."""
        out = []
        for actor_id, record in sorted(self.actors.items()):
            seqs = self.sessions[(actor_id, record.latest)]
            out.append(
                ActorAck(
                    actor_id=actor_id,
                    groups=record.groups,
                    session=record.latest,
                    session_groups=seqs.count,
                    acked=seqs.ranges()[-MAX_ACK_RANGES:],
                )
            )
        return out

    # -- checkpoint state: plain lists, strings and ints (torch.load(weights_only=True) reads them)

    def state(self) -> dict[str, Any]:
        return {
            "sessions": [[a, s, [list(r) for r in seqs.ranges()]] for (a, s), seqs in self.sessions.items()],
            "latest": {a: r.latest for a, r in self.actors.items()},
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Ledger:
        ledger = cls()
        for actor_id, session, ranges in state.get("sessions", []):
            seqs = SeqRanges([(int(lo), int(hi)) for lo, hi in ranges])
            ledger.sessions[(actor_id, session)] = seqs
            ledger.actors.setdefault(actor_id, _ActorRecord()).groups += seqs.count
        for actor_id, latest in state.get("latest", {}).items():
            ledger.actors.setdefault(actor_id, _ActorRecord()).latest = latest
        return ledger


@dataclass
class _Held:
    group: TrajectoryGroup
    stamp: int  # the send counter when it was last handed to the transport
    resending: bool = False  # returned by on_progress, not sent again yet


@dataclass
class Outbox:
    """The actor's side: stamps groups, holds them until acknowledged, says what to resend.

    Single-threaded (the actor's trio thread). ``stamp`` before handing a group over (and
    before dumping it), ``sent`` right after the transport took it, ``on_progress`` for every
    progress message: it returns the groups to send again, oldest first.
    """

    actor_id: str
    max_unacked: int = 256
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    produced: int = 0  # groups stamped (sequence numbers handed out)
    acked: int = 0  # groups released because the learner acknowledged them
    resent: int = 0
    forgotten: int = 0  # released unacknowledged because more than max_unacked were held
    learner_session: str | None = None
    learner_holds: int = 0  # what the learner holds from this actor id, all sessions (the budget's base)
    _held: OrderedDict[int, _Held] = field(default_factory=OrderedDict)
    _sends: int = 0
    _max_acked_stamp: int = -1

    def __post_init__(self) -> None:
        if not self.actor_id:
            raise ValueError("an Outbox needs a non-empty actor_id")
        if self.max_unacked < 1:
            raise ValueError(f"max_unacked must be >= 1, got {self.max_unacked}")

    @property
    def held(self) -> int:
        """Groups sent and held for a resend."""
        return len(self._held)

    @property
    def unacknowledged(self) -> int:
        """Groups stamped and not acknowledged: being sent, or held (forgotten ones excluded)."""
        return self.produced - self.acked - self.forgotten

    def stamp(self, group: TrajectoryGroup) -> TrajectoryGroup:
        group.actor_id, group.session, group.seq = self.actor_id, self.session, self.produced
        self.produced += 1
        return group

    def is_held(self, group: TrajectoryGroup) -> bool:
        return group.session == self.session and group.seq in self._held

    def sent(self, group: TrajectoryGroup) -> None:
        """The transport took ``group`` (first send or resend): hold it until acknowledged."""
        self._held[group.seq] = _Held(group, self._sends)
        self._held.move_to_end(group.seq)
        self._sends += 1
        while len(self._held) > self.max_unacked:
            seq, _ = self._held.popitem(last=False)
            self.forgotten += 1
            if self.forgotten == 1 or self.forgotten % 100 == 0:
                log.warning(
                    "actor %s: %d groups sent and not acknowledged by the learner (actors.max_unacked_groups = %d); "
                    "forgetting the oldest (seq %d; %d so far): it cannot be resent if the learner restarts now",
                    self.actor_id,
                    len(self._held) + 1,
                    self.max_unacked,
                    seq,
                    self.forgotten,
                )

    def on_progress(self, progress: Progress) -> list[TrajectoryGroup]:
        """Release what the learner acknowledged; return what to send again, oldest first."""
        restarted = progress.learner_session != self.learner_session
        if restarted and self.learner_session is not None:
            log.info(
                "actor %s: the learner restarted (session %s); resending the groups it has not acknowledged",
                self.actor_id,
                progress.learner_session,
            )
        self.learner_session = progress.learner_session
        ack = next((a for a in progress.actors if a.actor_id == self.actor_id), None)
        self.learner_holds = 0 if ack is None else ack.groups
        if ack is not None and ack.session == self.session:
            self._release(ack.acked)
        # everything after a learner restart; otherwise what was sent before something acknowledged
        resend = [h for h in self._held.values() if not h.resending and (restarted or h.stamp < self._max_acked_stamp)]
        for h in resend:
            h.resending = True
        self.resent += len(resend)
        return [h.group for h in sorted(resend, key=lambda h: h.group.seq)]

    def _release(self, ranges: list[tuple[int, int]]) -> None:
        for lo, hi in ranges:
            if hi - lo < len(self._held):
                seqs = [s for s in range(lo, hi + 1) if s in self._held]
            else:
                seqs = [s for s in self._held if lo <= s <= hi]
            for seq in seqs:
                held = self._held.pop(seq)
                self._max_acked_stamp = max(self._max_acked_stamp, held.stamp)
                self.acked += 1

    def stats(self) -> dict[str, Any]:
        return {
            "actor_id": self.actor_id,
            "session": self.session,
            "groups_produced": self.produced,
            "groups_acked": self.acked,
            "groups_unacked": len(self._held),
            "groups_resent": self.resent,
            "groups_forgotten_unacked": self.forgotten,
        }
