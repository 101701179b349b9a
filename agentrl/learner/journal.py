"""The learner's journal: every group it receives, on disk before it is acknowledged.

A write-ahead log in segments, ``<run_dir>/journal/<lineage>/<segment>.log``; each record is
``length (u32 LE) | crc32 (u32 LE) | encoded group``.

Invariants: :meth:`Journal.sync` runs before the progress message that acknowledges the groups,
so an acknowledged group is always on disk; a checkpoint starts a new segment
(:meth:`Journal.rotate`) and a resumed learner replays the segments after it (:meth:`replay`),
then writes to a fresh segment, never to one a crash may have torn; a torn or corrupt record
ends its segment's replay. See docs/learner.md and docs/transport.md.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
MAX_RECORD_BYTES = 1 << 30  # a length beyond this is corruption, not a group


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new, renamed or deleted files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """Append-only segments of encoded groups (see the module docstring). Rank 0 only."""

    def __init__(self, root: str | Path, lineage: str) -> None:
        self.dir = Path(root) / lineage
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lineage = lineage
        self.segment = max(self.segments(), default=-1) + 1
        self._file: BinaryIO | None = None
        self._dirty = False

    def segments(self) -> list[int]:
        """Numbers of the segment files on disk, in order."""
        return sorted(int(p.stem) for p in self.dir.glob("*.log") if p.stem.isdigit())

    def _path(self, segment: int) -> Path:
        return self.dir / f"{segment:08d}.log"

    def append(self, data: bytes) -> None:
        if self._file is None:
            self._file = self._path(self.segment).open("ab")
            fsync_dir(self.dir)
        self._file.write(_HEADER.pack(len(data), zlib.crc32(data)))
        self._file.write(data)
        self._dirty = True

    def sync(self) -> None:
        """Everything appended so far is on disk when this returns."""
        if self._file is not None and self._dirty:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._dirty = False

    def rotate(self) -> int:
        """Close the current segment (synced); return the number of the next one, where the
        records appended from now on go (what a checkpoint records)."""
        self.close()
        if self._path(self.segment).exists():
            self.segment += 1
        return self.segment

    def replay(self, first_segment: int) -> Iterator[bytes]:
        """The records of every segment from ``first_segment`` on, in order."""
        for segment in [s for s in self.segments() if s >= first_segment]:
            yield from self._read(self._path(segment))

    @staticmethod
    def _read(path: Path) -> Iterator[bytes]:
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            if pos + _HEADER.size > len(data):
                break
            length, crc = _HEADER.unpack_from(data, pos)
            body = data[pos + _HEADER.size : pos + _HEADER.size + length]
            if length > MAX_RECORD_BYTES or len(body) < length or zlib.crc32(body) != crc:
                break
            yield body
            pos += _HEADER.size + length
        if pos < len(data):
            log.warning(
                "journal %s: the last %d bytes are a torn or corrupt record (a crash while writing); ignored",
                path,
                len(data) - pos,
            )

    def prune(self, first_needed: int) -> None:
        """Delete the segments before ``first_needed`` (no kept checkpoint replays them)."""
        removed = [s for s in self.segments() if s < first_needed]
        for segment in removed:
            self._path(segment).unlink(missing_ok=True)
        if removed:
            fsync_dir(self.dir)

    def close(self) -> None:
        if self._file is not None:
            self.sync()
            self._file.close()
            self._file = None


def count_records(directory: str | Path, first_segment: int = 0) -> int:
    """How many records a lineage's segments from ``first_segment`` on hold (what a resume replays)."""
    paths = [p for p in Path(directory).glob("*.log") if p.stem.isdigit() and int(p.stem) >= first_segment]
    return sum(1 for path in paths for _ in Journal._read(path))
