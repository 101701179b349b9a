"""The bridge between a socket thread and its users, plain threads or trio tasks.

:class:`Mailbox` is a bounded FIFO that plain threads (a ``threading.Condition``) and trio tasks (a
``trio.Event`` set through ``TrioToken.run_sync_soon``) can both wait on, moved in batches. Nothing
busy-waits: every change wakes all waiters, who re-check. See docs/transport.md.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

import trio

T = TypeVar("T")


class Mailbox(Generic[T]):
    """A bounded FIFO between one socket thread and its users, threads or trio tasks.

    ``drop_oldest=True`` makes puts never wait: the oldest item goes (progress messages).
    Every change wakes all waiters, who re-check; there are at most a handful.
    """

    def __init__(self, maxlen: int, *, drop_oldest: bool = False) -> None:
        if maxlen < 1:
            raise ValueError(f"queue length must be >= 1, got {maxlen}")
        self.maxlen = maxlen
        self._drop_oldest = drop_oldest
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._trio_waiters: list[tuple[trio.lowlevel.TrioToken, trio.Event]] = []
        self.closed = False

    def __len__(self) -> int:
        return len(self._items)

    def _wake(self) -> None:  # caller holds the lock
        self._cond.notify_all()
        for token, event in self._trio_waiters:
            try:
                token.run_sync_soon(event.set)
            except trio.RunFinishedError:
                pass
        self._trio_waiters.clear()

    def close(self, *, discard: bool = True) -> None:
        with self._lock:
            self.closed = True
            if discard:
                self._items.clear()
            self._wake()

    # -- non-blocking, any thread
    def _append(self, items: Iterable[T]) -> None:  # caller holds the lock
        self._items.extend(items)
        if self._drop_oldest:
            while len(self._items) > self.maxlen:
                self._items.popleft()
        self._wake()

    def put_many(self, items: Iterable[T]) -> None:
        """Append without waiting: past ``maxlen`` the oldest items go when ``drop_oldest``,
        otherwise the caller (the only producer) has checked the free space first."""
        with self._lock:
            if not self.closed:
                self._append(items)

    def put_nowait(self, item: T) -> bool:
        """Append if there is room (or drop the oldest); False when full or closed."""
        with self._lock:
            if self.closed or (len(self._items) >= self.maxlen and not self._drop_oldest):
                return False
            self._append([item])
            return True

    # -- blocking, plain threads
    def take_all(self, timeout_s: float | None = None) -> list[T]:
        """Block until there are items (or ``timeout_s``); take them all. [] when closed or timed out."""
        with self._lock:
            if not self._items and not self.closed:
                self._cond.wait_for(lambda: self._items or self.closed, timeout_s)
            if self.closed and not self._items:
                return []
            items = list(self._items)
            self._items.clear()
            self._wake()
            return items

    def get(self, timeout_s: float | None = None) -> tuple[bool, T | None]:
        """Block for one item: (True, item), or (False, None) on timeout or when closed and empty."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while not self._items:
                if self.closed:
                    return False, None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False, None
                self._cond.wait(remaining)
            item = self._items.popleft()
            self._wake()
            return True, item

    # -- trio
    async def _wait_trio(self, ready: Callable[[], bool]) -> None:
        """Wait in trio until ``ready()`` (checked under the lock) or the mailbox closes."""
        while True:
            with self._lock:
                if ready() or self.closed:
                    return
                event = trio.Event()
                waiter = (trio.lowlevel.current_trio_token(), event)
                self._trio_waiters.append(waiter)
            try:
                await event.wait()
            finally:
                with self._lock:
                    if waiter in self._trio_waiters:
                        self._trio_waiters.remove(waiter)

    async def aput(self, item: T) -> None:
        """Append, waiting in trio while full. Raises trio.ClosedResourceError once closed."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            await self._wait_trio(lambda: len(self._items) < self.maxlen or self._drop_oldest)
            with self._lock:
                if self.closed:
                    raise trio.ClosedResourceError("the channel is closed")
                if len(self._items) < self.maxlen or self._drop_oldest:
                    self._append([item])
                    break
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def aget(self) -> T:
        """Take one item, waiting in trio. Raises trio.ClosedResourceError once closed and empty."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            await self._wait_trio(lambda: bool(self._items))
            with self._lock:
                if self._items:
                    item = self._items.popleft()
                    self._wake()
                    break
                if self.closed:
                    raise trio.ClosedResourceError("the channel is closed")
        await trio.lowlevel.cancel_shielded_checkpoint()
        return item
