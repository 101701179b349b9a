"""The learner's journal: appended records come back in order from a segment on; a torn or
corrupt tail ends a segment's replay; a new process never appends to an old segment."""

from __future__ import annotations

import logging

from agentrl.learner.journal import Journal


def test_records_replay_in_order_from_a_segment(tmp_path) -> None:
    j = Journal(tmp_path, "lin")
    for i in range(3):
        j.append(f"a{i}".encode())
    j.sync()
    assert list(j.replay(0)) == [b"a0", b"a1", b"a2"]
    second = j.rotate()  # a checkpoint: what follows is replayed after it
    assert second == 1
    j.append(b"b0")
    j.append(b"")  # an empty record is still a record
    j.close()
    assert list(j.replay(0)) == [b"a0", b"a1", b"a2", b"b0", b""]
    assert list(j.replay(second)) == [b"b0", b""]
    assert j.rotate() == 2 and j.rotate() == 2  # nothing written to 2 yet: no empty segments pile up
    # a new process (a restart) writes to a new segment and replays the old ones
    k = Journal(tmp_path, "lin")
    assert k.segment == 2
    k.append(b"c0")
    k.close()
    assert list(k.replay(1)) == [b"b0", b"", b"c0"]
    assert list(Journal(tmp_path, "other").replay(0)) == []  # another lineage sees nothing of this one


def test_torn_and_corrupt_tails_end_the_segment(tmp_path, caplog) -> None:
    j = Journal(tmp_path, "lin")
    for i in range(4):
        j.append(bytes([i]) * 100)
    j.close()
    path = tmp_path / "lin" / "00000000.log"
    data = path.read_bytes()
    path.write_bytes(data[:-50])  # a crash while writing the last record
    with caplog.at_level(logging.WARNING):
        assert [r[0] for r in Journal(tmp_path, "lin").replay(0)] == [0, 1, 2]
    assert "torn or corrupt" in caplog.text
    corrupt = bytearray(data)
    corrupt[2 * 108 + 8 + 10] ^= 0xFF  # a flipped byte inside the third record's body
    path.write_bytes(bytes(corrupt))
    assert [r[0] for r in Journal(tmp_path, "lin").replay(0)] == [0, 1]
    path.write_bytes(data[:3])  # not even a header
    assert list(Journal(tmp_path, "lin").replay(0)) == []


def test_prune_keeps_what_kept_checkpoints_replay(tmp_path) -> None:
    j = Journal(tmp_path, "lin")
    for segment in range(4):
        j.append(f"s{segment}".encode())
        j.rotate()
    assert j.segments() == [0, 1, 2, 3]
    j.prune(2)
    assert j.segments() == [2, 3] and list(j.replay(0)) == [b"s2", b"s3"]
