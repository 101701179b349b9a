"""One group of episodes played concurrently, lost as a whole when one episode fails.

:func:`play_episodes` is the one group player: the actors' loop (:func:`agentrl.episode.rollout.run_group`)
and the agent runner (:meth:`agentrl.agents.agent_runner.AgentRunner.play_group`) both use it, under trio.

Invariants: the ``n`` episodes run concurrently; the first :class:`~agentrl.episode.turn.EpisodeFailed`
cancels the others (their work is useless to GRPO) and the group raises
:class:`~agentrl.episode.turn.GroupLost` with that failure's message, never silently; any other error
propagates as trio's nursery raises it. Results come back in episode order.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

import trio

from agentrl.episode.turn import EpisodeFailed, GroupLost

T = TypeVar("T")


async def play_episodes(n: int, episode: Callable[[int], Awaitable[T]]) -> list[T]:
    """Run ``episode(0)`` ... ``episode(n - 1)`` concurrently; their results in that order, or
    :class:`GroupLost` naming the first :class:`EpisodeFailed`."""
    results: list[T | None] = [None] * n
    failures: list[str] = []

    async def one(i: int, cancel: trio.CancelScope) -> None:
        try:
            results[i] = await episode(i)
        except EpisodeFailed as e:
            failures.append(str(e))
            cancel.cancel()

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i, nursery.cancel_scope)
    if failures:
        raise GroupLost(failures[0])
    return cast(list[T], results)
