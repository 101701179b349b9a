"""A pool of sandboxes: one per episode, reset and reused, always cleaned up.

``acquire`` takes an idle sandbox or creates one (waiting while ``max_live`` are in use);
``release`` resets it and keeps up to ``size`` idle ones; a sandbox whose reset fails or that is
``broken`` is closed instead. ``release`` and ``aclose`` run shielded from cancellation with a time
bound, so a cancelled episode still gives its sandbox back. Used from one trio run at a time.
See docs/tools.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio

from agentrl.tools.sandbox.base import Sandbox

CLEANUP_LIMIT_S = 30.0


class SandboxPool:
    def __init__(self, factory: Callable[[int], Awaitable[Sandbox]], size: int = 4, max_live: int = 0):
        self.factory = factory
        self.size = size
        self.max_live = max_live
        self._idle: list[Sandbox] = []
        self._live = 0  # created and not yet closed
        self._slots = 0
        self.closed = False
        self.stats = {"created": 0, "reused": 0, "closed": 0, "reset_failures": 0}

    async def acquire(self) -> Sandbox:
        if self.closed:
            raise RuntimeError("the sandbox pool is closed")
        if self._idle:
            self.stats["reused"] += 1
            return self._idle.pop()
        while self.max_live and self._live >= self.max_live:
            await trio.sleep(0.05)  # a sandbox will come back; releases are bounded in time
            if self._idle:
                self.stats["reused"] += 1
                return self._idle.pop()
        self._live += 1
        self._slots += 1
        try:
            sandbox = await self.factory(self._slots)
        except BaseException:
            self._live -= 1
            raise
        self.stats["created"] += 1
        return sandbox

    async def release(self, sandbox: Sandbox) -> None:
        with trio.CancelScope(shield=True):
            kept = False
            if not self.closed and len(self._idle) < self.size and not getattr(sandbox, "broken", False):
                with trio.move_on_after(CLEANUP_LIMIT_S):
                    try:
                        await sandbox.reset()
                        kept = not getattr(sandbox, "broken", False)
                    except Exception:
                        self.stats["reset_failures"] += 1
            if kept:
                self._idle.append(sandbox)
                return
            with trio.move_on_after(CLEANUP_LIMIT_S):
                await self._close(sandbox)

    async def _close(self, sandbox: Sandbox) -> None:
        self._live -= 1
        self.stats["closed"] += 1
        try:
            await sandbox.close()
        except Exception:
            pass  # closing is best effort; backends also end their sandboxes by lifetime

    async def aclose(self) -> None:
        self.closed = True
        with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_LIMIT_S):
            while self._idle:
                await self._close(self._idle.pop())

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Sandbox]:
        sandbox = await self.acquire()
        try:
            yield sandbox
        finally:
            await self.release(sandbox)
