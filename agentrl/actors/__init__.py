"""Actors: the ``agentrl serve-actors`` process (docs/actors.md).

* :mod:`agentrl.actors.actor`: :class:`ActorService`, one actor: group scheduling under the staleness gate,
  sending, stopping.
* :mod:`agentrl.actors.metrics`: per-env counters and the reward-error lines the run reads.

The episode itself (chat, turns, groups) is :mod:`agentrl.episode`; the ``serve-actors`` process that
puts envs, engine clients and this service together is :mod:`agentrl.run.actor_process`.
"""
