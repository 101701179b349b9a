"""In-memory twins of the ZMQ channels, for unit tests of the actor and learner logic.

They implement the interfaces of :mod:`agentrl.transport.base` without sockets. The group channel
encodes and decodes every group on the way, so tests see exactly what the learner would and a group
that cannot be sent fails in ``send``.
"""

from __future__ import annotations

import trio

from agentrl.protocol import Progress, TrajectoryGroup, decode, encode
from agentrl.transport.base import GroupSink, GroupSource, ProgressSink, ProgressSource, TransportError
from agentrl.transport.mailbox import Mailbox


class InMemoryGroupChannel(GroupSink, GroupSource):
    """Both ends of a trajectory channel in one process, for unit tests.

    ``send`` (trio) and ``get`` (any thread) behave like GroupSender/GroupReceiver: bounded,
    ``send`` waits while full, ``get`` returns None on timeout. Every group is encoded and
    decoded on the way, so tests see exactly what the learner would (read-only arrays
    included) and metadata that cannot be sent fails in ``send``.
    """

    def __init__(self, max_queued_groups: int = 16) -> None:
        self._box: Mailbox[TrajectoryGroup] = Mailbox(max_queued_groups)
        self._sent = 0
        self._received = 0

    async def send(self, group: TrajectoryGroup) -> None:
        wire = decode(encode(group))
        await self._box.aput(wire)  # type: ignore[arg-type]
        self._sent += 1

    def send_nowait(self, group: TrajectoryGroup) -> None:
        """For synchronous (learner) tests: queue a group or raise TransportError when full."""
        if not self._box.put_nowait(decode(encode(group))):  # type: ignore[arg-type]
            raise TransportError("InMemoryGroupChannel is full or closed")
        self._sent += 1

    def get(self, timeout_s: float | None = None) -> TrajectoryGroup | None:
        ok, group = self._box.get(timeout_s)
        if ok:
            self._received += 1
        return group

    @property
    def stats(self) -> dict[str, int]:
        return {"sent": self._sent, "received": self._received, "malformed": 0, "queued": len(self._box)}

    def close(self) -> None:
        self._box.close()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()


class InMemoryProgressChannel(ProgressSink, ProgressSource):
    """Both ends of a progress channel in one process, for unit tests.

    ``publish`` never blocks; ``receive`` (trio) returns the next message; ``latest`` is the
    last one published. Keeps the newest ``max_buffered`` unread messages, like the subscriber.
    """

    def __init__(self, max_buffered: int = 64) -> None:
        self._box: Mailbox[Progress] = Mailbox(max_buffered, drop_oldest=True)
        self.latest: Progress | None = None

    def publish(self, progress: Progress) -> None:
        msg = decode(encode(progress))
        self.latest = msg  # type: ignore[assignment]
        self._box.put_many([msg])  # type: ignore[list-item]

    async def receive(self) -> Progress:
        return await self._box.aget()

    def close(self) -> None:
        self._box.close()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()
