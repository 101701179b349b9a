"""The transport's interfaces: declared once, imported by the actors, the learner and tests.

Trajectory groups go from actors to the learner (an actor sends into a :class:`GroupSink` in trio,
the learner takes from a :class:`GroupSource` in plain code); progress goes from the learner
(:class:`ProgressSink`) to actors (:class:`ProgressSource`, trio). The ZMQ classes, the in-memory
twins and the test doubles all subclass these, so a change to a contract shows up everywhere at
once. See docs/transport.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from agentrl.protocol import Progress, TrajectoryGroup


class TransportError(RuntimeError):
    """A socket could not be opened, or its thread failed; the message names the endpoint."""


class GroupSink(ABC):
    """Where an actor sends its groups."""

    @abstractmethod
    async def send(self, group: TrajectoryGroup) -> None:
        """Hand one group over; waits while the channel is full (the learner is behind)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close; what is still queued may be dropped (the actor's outbox resends what counts)."""


class GroupSource(ABC):
    """Where the learner takes groups from. ``stats`` holds at least ``received`` and
    ``malformed`` (messages counted and dropped before they reached the caller)."""

    @property
    @abstractmethod
    def stats(self) -> dict[str, int]: ...

    @abstractmethod
    def get(self, timeout_s: float | None = None) -> TrajectoryGroup | None:
        """The next group, waiting up to ``timeout_s`` (None: forever); None on timeout."""

    @abstractmethod
    def close(self) -> None: ...


class ProgressSink(ABC):
    """Where the learner publishes its progress; ``publish`` never blocks."""

    @abstractmethod
    def publish(self, progress: Progress) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Close after handing what was published to the connected readers (bounded)."""


class ProgressSource(ABC):
    """Where an actor reads the learner's progress; ``latest`` is the last message seen."""

    latest: Progress | None = None

    @abstractmethod
    async def receive(self) -> Progress:
        """The next progress message, in order (callers bound the wait with trio.fail_after)."""

    @abstractmethod
    async def aclose(self) -> None: ...
