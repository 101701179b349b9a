"""The run: everything one ``agentrl`` command starts and watches (docs/run.md).

* :mod:`agentrl.run.stages`: ``agentrl run``'s stages (warm start, engines, the RL stage, evaluations,
  restarts, stop on a signal).
* :mod:`agentrl.run.report`: what the run has seen, its live view, ``summary.json`` and MLflow logging.
* :mod:`agentrl.run.fingerprint`: what a run folder was made from; a changed folder set aside.
* :mod:`agentrl.run.process_plan`: which processes a run starts, with which argv and environment.
* :mod:`agentrl.run.supervisor`: starting, restarting and stopping those processes.
* :mod:`agentrl.run.placement` and :mod:`agentrl.run.cluster`: GPUs per process; launch files for clusters.
* :mod:`agentrl.run.actor_process` and :mod:`agentrl.run.engine_process`: the ``serve-actors`` and
  embedded-engine processes, put together from the roles and parts.
* :mod:`agentrl.run.preflight`: ``--dry-run``'s checks of envs, prompts and demonstrations.
* :mod:`agentrl.run.evaluate`: greedy evaluation of a policy on engines.
* :mod:`agentrl.run.accounting`: every group produced, trained or dropped, from the run's files.

Importing this package imports nothing: the CLI stays fast.
"""
