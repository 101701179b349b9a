"""Actors: the ``agentrl serve-actors`` process.

:mod:`agentrl.actors.actor` is :class:`ActorService`, one actor (group scheduling under the
staleness gate, sending, stopping); :mod:`agentrl.actors.metrics` holds per-env counters and the
reward-error lines the run reads. The episode itself is :mod:`agentrl.episode`; the process that
puts envs, engine clients and this service together is :mod:`agentrl.run.actor_process`.
See docs/actors.md.
"""
