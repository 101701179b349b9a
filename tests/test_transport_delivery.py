"""Exactly-once delivery logic: sequence ranges, the learner's ledger, the actor's outbox, and a
simulated network that loses, repeats and restarts, checked against the accounting identity."""

from __future__ import annotations

import json
import logging
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.protocol import MAX_ACK_RANGES, Progress, Trajectory, TrajectoryGroup, decode, encode
from agentrl.transport.delivery import Ledger, Outbox, SeqRanges


def group(name: str = "g") -> TrajectoryGroup:
    traj = Trajectory(
        tokens=[1, 2, 3], loss_mask=[0, 1, 1], behavior_logprobs=[0, -0.5, -0.5], weight_versions=[-1, 0, 0], reward=1.0
    )
    return TrajectoryGroup(group_id=name, task_id=name, env="test", trajectories=[traj])


def stamped(actor_id: str, session: str, seq: int) -> TrajectoryGroup:
    g = group(f"{actor_id}/{session}/{seq}")
    g.actor_id, g.session, g.seq = actor_id, session, seq
    return g


# ------------------------------------------------------------------ SeqRanges


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=80))
def test_seq_ranges_behave_like_a_set(seqs: list[int]) -> None:
    ranges, seen = SeqRanges(), set()
    for s in seqs:
        assert ranges.add(s) == (s not in seen)
        seen.add(s)
        assert ranges.count == len(seen)
    assert all((s in ranges) == (s in seen) for s in range(-2, 64))
    flat = [s for lo, hi in ranges.ranges() for s in range(lo, hi + 1)]
    assert flat == sorted(seen)  # sorted, disjoint
    assert all(b[0] > a[1] + 1 for a, b in zip(ranges.ranges(), ranges.ranges()[1:]))  # never adjacent


def test_seq_ranges_stay_compact_in_order() -> None:
    ranges = SeqRanges()
    for s in range(10_000):
        ranges.add(s)
    assert ranges.ranges() == [(0, 9_999)]
    ranges.add(10_001)  # a hole at 10_000
    assert ranges.ranges() == [(0, 9_999), (10_001, 10_001)]
    ranges.add(10_000)
    assert ranges.ranges() == [(0, 10_001)]


# ------------------------------------------------------------------ Ledger


def test_ledger_drops_duplicates_and_acknowledges_the_latest_session() -> None:
    ledger = Ledger()
    assert ledger.record(stamped("actor0", "s1", 0)) and ledger.record(stamped("actor0", "s1", 1))
    assert not ledger.record(stamped("actor0", "s1", 1))  # a duplicate
    assert stamped("actor0", "s1", 1) in ledger and stamped("actor0", "s1", 2) not in ledger
    assert ledger.record(stamped("actor0", "s1", 3))  # 2 was lost on the way
    assert ledger.record(stamped("actor1", "x", 0))
    (a0, a1) = ledger.acks()
    assert (a0.actor_id, a0.groups, a0.session, a0.session_groups, a0.acked) == ("actor0", 3, "s1", 3, [(0, 1), (3, 3)])
    assert (a1.actor_id, a1.groups, a1.acked) == ("actor1", 1, [(0, 0)])
    # actor0 restarts: its new session is acknowledged; the old one's groups still count
    assert ledger.record(stamped("actor0", "s2", 0))
    assert ledger.record(stamped("actor0", "s1", 2))  # a straggler of the old session
    a0 = ledger.acks()[0]
    assert (a0.groups, a0.session, a0.session_groups, a0.acked) == (5, "s2", 1, [(0, 0)])
    assert ledger.total == 6
    # the checkpoint state is plain data and round-trips
    again = Ledger.from_state(json.loads(json.dumps(ledger.state())))
    assert again.acks() == ledger.acks() and again.total == 6
    assert stamped("actor0", "s1", 2) in again and not again.record(stamped("actor0", "s1", 3))


def test_ledger_publishes_at_most_the_newest_ranges() -> None:
    ledger = Ledger()
    for seq in range(0, 4 * MAX_ACK_RANGES, 2):  # every other one: many holes
        ledger.record(stamped("a", "s", seq))
    ack = ledger.acks()[0]
    assert len(ack.acked) == MAX_ACK_RANGES and ack.acked[-1] == (4 * MAX_ACK_RANGES - 2,) * 2
    assert ack.session_groups == 2 * MAX_ACK_RANGES
    decode(encode(Progress(policy_version=0, accept_groups=0, actors=[ack])))  # valid on the wire


# ------------------------------------------------------------------ Outbox


def progress(session: str, ledger: Ledger) -> Progress:
    return Progress(policy_version=0, accept_groups=100, learner_session=session, actors=ledger.acks())


def test_outbox_stamps_holds_and_releases() -> None:
    box = Outbox("actor3", max_unacked=10)
    sent = [box.stamp(group(str(i))) for i in range(4)]
    assert [g.key for g in sent] == [("actor3", box.session, i) for i in range(4)]
    for g in sent[:3]:
        box.sent(g)
    assert (box.produced, box.held, box.unacknowledged) == (4, 3, 4)  # sent[3] is still being sent
    ledger = Ledger()
    for g in sent[:2]:
        ledger.record(g)
    # the first learner seen may not be the one these went to: what it has not acknowledged goes again
    assert [g.seq for g in box.on_progress(progress("L1", ledger))] == [2]
    assert (box.held, box.acked, box.learner_holds, box.unacknowledged) == (1, 2, 2, 2)
    assert box.is_held(sent[2]) and not box.is_held(sent[0])
    assert box.on_progress(progress("L1", ledger)) == []


def test_outbox_resends_everything_after_a_learner_restart_once() -> None:
    box = Outbox("a")
    gs = [box.stamp(group(str(i))) for i in range(5)]
    for g in gs:
        box.sent(g)
    ledger = Ledger()
    ledger.record(gs[0])
    box.learner_session = "L1"  # heard before these were sent
    assert box.on_progress(progress("L1", ledger)) == []
    assert [g.seq for g in box.on_progress(progress("L2", ledger))] == [1, 2, 3, 4]  # a new learner
    assert box.on_progress(progress("L2", ledger)) == []  # not again before they were sent again
    for g in [gs[1], gs[2]]:
        box.sent(g)
    assert box.resent == 4 and box.held == 4


def test_outbox_resends_what_a_later_acknowledgement_shows_lost() -> None:
    box = Outbox("a", learner_session="L")
    gs = [box.stamp(group(str(i))) for i in range(4)]
    for g in gs:
        box.sent(g)
    ledger = Ledger()
    for g in (gs[0], gs[2]):  # 1 was lost on the way; 3 may still be in flight
        ledger.record(g)
    assert [g.seq for g in box.on_progress(progress("L", ledger))] == [1]
    assert box.on_progress(progress("L", ledger)) == []  # being resent
    box.sent(gs[1])  # resent: now after 3 on the wire
    ledger.record(gs[3])
    assert box.on_progress(progress("L", ledger)) == []  # 1 was sent after 3: not lost yet
    ledger.record(gs[1])
    box.on_progress(progress("L", ledger))
    assert box.held == 0 and box.acked == 4 and box.resent == 1


def test_outbox_bound_forgets_the_oldest_and_says_so(caplog) -> None:
    box = Outbox("a", max_unacked=3)
    with caplog.at_level(logging.WARNING):
        for i in range(5):
            box.sent(box.stamp(group(str(i))))
    assert box.held == 3 and box.forgotten == 2 and box.unacknowledged == 3
    assert "actors.max_unacked_groups = 3" in caplog.text and "cannot be resent" in caplog.text
    assert caplog.text.count("forgetting the oldest") == 1  # once, then every 100th


def test_outbox_ignores_other_sessions_but_counts_them() -> None:
    old, new = Outbox("actor0"), Outbox("actor0")
    ledger = Ledger()
    for _ in range(5):
        g = old.stamp(group())
        old.sent(g)
        ledger.record(g)
    g = new.stamp(group())
    new.sent(g)
    new.on_progress(progress("L", ledger))
    assert new.learner_holds == 5 and new.held == 1  # continues from what the old process delivered
    ledger.record(g)
    new.on_progress(progress("L", ledger))
    assert new.learner_holds == 6 and new.held == 0


# ------------------------------------------------------------------ a simulated network


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_lossy_network_with_restarts_accounts_for_every_group_once(seed: int) -> None:
    """Two actors send through a wire that loses and repeats messages; the learner dies now
    and then (losing its queue and what it had not synced to disk), and actor1 dies once
    (losing what it held). The surviving learner records each group at most once, and
    every group produced is recorded, still held by its live actor, or died with actor1."""
    rng = random.Random(seed)
    actors = {name: Outbox(name, max_unacked=1000) for name in ("actor0", "actor1")}
    wire: list[TrajectoryGroup] = []  # in flight, in order
    ledger, recorded, unsynced = Ledger(), [], set()  # the learner: keys in its journal; those not on disk yet
    learner_session, produced, died_holding = 0, set(), set()

    def publish() -> None:  # sync the journal, then acknowledge; every actor hears it and resends
        unsynced.clear()
        p = progress(f"L{learner_session}", ledger)
        for box in actors.values():
            for g in box.on_progress(p):
                if box.is_held(g):
                    wire.append(g)
                    box.sent(g)

    def receive(g: TrajectoryGroup) -> None:
        if ledger.record(g):
            recorded.append(g.key)
            unsynced.add(g.key)

    for _ in range(300):
        event = rng.random()
        if event < 0.35:  # an actor finishes a group and sends it
            box = actors[rng.choice(sorted(actors))]
            g = box.stamp(group())
            produced.add(g.key)
            wire.append(g)
            box.sent(g)
        elif event < 0.65 and wire:  # the learner takes the next message, unless the network lost it
            g = wire.pop(0)
            if rng.random() < 0.1:
                continue
            if rng.random() < 0.05:
                wire.insert(0, g)  # and the network repeats it
            receive(g)
        elif event < 0.85:
            publish()
        elif event < 0.88:  # the learner dies; a new one resumes from what is on disk
            recorded = [k for k in recorded if k not in unsynced]
            ledger = Ledger()
            for key in recorded:
                ledger.record(stamped(*key))
            unsynced.clear()
            wire.clear()
            learner_session += 1
        elif event < 0.89 and not died_holding:  # actor1 dies holding its unacknowledged groups
            old = actors["actor1"]
            died_holding = {(old.actor_id, old.session, seq) for seq in old._held} | {("marker",)}
            wire[:] = [g for g in wire if g.session != old.session]  # its connection's queue dies too
            actors["actor1"] = Outbox("actor1", max_unacked=1000)
    for _ in range(20):  # a quiet network: everything arrives, acknowledgements flow
        while wire:
            receive(wire.pop(0))
        publish()
    assert len(recorded) == len(set(recorded))  # nothing recorded twice
    still_held = {(b.actor_id, b.session, seq) for b in actors.values() for seq in b._held}
    assert produced <= set(recorded) | still_held | died_holding
    assert not still_held & set(recorded)  # what the learner has is released
    # what stays held is a lost tail: sent after everything the learner acknowledged, so that
    # nothing reveals the loss (the actor reports it as unacknowledged when it stops)
    for box in actors.values():
        assert all(h.stamp > box._max_acked_stamp for h in box._held.values())
