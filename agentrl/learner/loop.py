"""``agentrl learn``: the learner's main loop.

::

    resume? -> [ wait for groups -> filter -> step -> push weights every k steps
                 -> publish progress -> log -> checkpoint every n steps ] x max_steps -> done

Rank 0 owns every connection (:class:`LearnerIO`): it receives groups, keeps them in a
:class:`GroupBuffer`, publishes :class:`Progress`, pushes weights and logs. Every rank trains:
each poll rank 0 broadcasts one control message (``batch``, ``wait`` or ``stop``), so no rank sits
in a collective longer than a poll however long the actors take.

Invariants:

* exactly once: a group the :class:`Ledger` has seen is dropped, every new one is journalled,
  and the journal is synced before the progress message that acknowledges it;
* the budget: ``accept_groups = received + (the groups of the steps that may still train a group
  started now: the rest of this version's ``k = sync_every_steps`` and ``k * max_staleness`` more)
  - buffered``, so at most ``max_staleness + 1`` versions' worth of groups are ever in flight;
* the first steps take ``first_groups_per_step`` groups, doubled each step up to ``groups_per_step``
  (:func:`groups_for_step`): the first update comes sooner, and the budget, which follows the
  steps' sizes, ramps the actors' concurrency up with it;
* an engine that does not report the learner's version gets the weights before the learner
  trains on anything it serves (checked before every push and while waiting for data).

SIGTERM/SIGINT stop at the next poll or after the current step, with a checkpoint; a second
signal aborts. See docs/learner.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import random
import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from agentrl.config import AgentRLConfig, dump_toml, resolve_run_dir
from agentrl.learner.journal import Journal
from agentrl.learner.rollout_stats import RolloutStats, sample_episodes
from agentrl.protocol import Progress, ProtocolError, TrajectoryGroup, decode, encode
from agentrl.transport.base import GroupSource, ProgressSink
from agentrl.transport.delivery import Ledger

log = logging.getLogger("agentrl.learner")

POLL_S = 2.0  # longest a non-zero rank waits in one control broadcast
# while waiting: progress this often before any group arrived, and this soon after a dropped group freed budget
FAST_PUBLISH_S = 0.1
ENGINE_CHECK_S = 2.0  # how often rank 0 re-checks the engines (membership, versions) between pushes
MAX_PUSH_ATTEMPTS = 3  # pushes that lose an engine before the learner trains on and checks again later
CHECKPOINT_ATTEMPTS = 3  # writes per checkpoint folder before the fallback folder (then: reported, training goes on)
CHECKPOINT_BACKOFF_S = 1.0  # doubled after each failed write


@dataclass
class LearnerIO:
    """Rank 0's connections. Tests pass their own; ``open_io`` builds the real ones."""

    source: GroupSource
    progress: ProgressSink | None = None
    weights: Any = None  # agentrl.learner.weight_push.WeightUpdater
    tracker: Any = None  # agentrl.tracking.Tracker

    def close(self) -> None:
        for thing in (self.source, self.progress, self.weights, self.tracker):
            if thing is None:
                continue
            try:
                thing.close()
            except Exception as e:  # closing must not mask the real outcome
                log.warning("closing %s failed: %s", type(thing).__name__, e)


def open_tracker(cfg: AgentRLConfig, run_dir: Path) -> Any:
    from agentrl.tracking import open_tracker as _open

    return _open(cfg.tracking, run_dir, resume_run_id=cfg.tracking.run_id or None)


def open_tracker_in_background(cfg: AgentRLConfig, run_dir: Path) -> concurrent.futures.Future:
    """``open_tracker`` in a thread: importing mlflow alone takes 1.5-3 s, which the trainer's build and
    the first step cover; the learner takes the tracker (or its error) when it first logs."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tracker")
    try:
        return pool.submit(open_tracker, cfg, run_dir)
    finally:
        pool.shutdown(wait=False)


def open_io(cfg: AgentRLConfig, run_dir: Path) -> LearnerIO:
    """The real transport (bind) and weight updater (when ``engine.urls`` is set); not the tracker."""
    from agentrl.transport import GroupReceiver, ProgressPublisher, security_from_config

    lc = cfg.learner
    security = security_from_config(cfg.actors)
    source = GroupReceiver(
        cfg.actors.trajectory_endpoint, bind=True, max_queued_groups=max(64, 2 * lc.groups_per_step), security=security
    )
    try:
        progress = ProgressPublisher(cfg.actors.progress_endpoint, bind=True, security=security)
    except BaseException:
        source.close()
        raise
    weights = None
    if cfg.engine.urls:
        from agentrl.learner.weight_push import WeightUpdater

        weights = WeightUpdater.from_config(
            cfg.engine, master_address=lc.weight_sync_address, master_port=lc.weight_sync_port
        )
        weights.wait_until_answering(lc.engines_start_timeout_s)
        weights.connect()
    else:
        log.warning("engine.urls is empty: weights are not pushed to any engine (the version still advances)")
    return LearnerIO(source=source, progress=progress, weights=weights)  # the tracker: Learner.run opens it


def seed_everything(seed: int, num_threads: int = 0) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if num_threads > 0:
        torch.set_num_threads(num_threads)


def flatten_params(cfg: AgentRLConfig, sections: tuple[str, ...]) -> dict[str, Any]:
    dumped = cfg.model_dump()
    return {f"{s}.{k}": v for s in sections for k, v in dumped[s].items()}


def groups_for_step(step: int, groups_per_step: int, first_groups_per_step: int = 0) -> int:
    """The groups step ``step`` (1-based) trains on: ``first_groups_per_step`` at step 1, doubled at
    each step after, ``groups_per_step`` at most; ``groups_per_step`` throughout when
    ``first_groups_per_step`` is 0 or not below it."""
    if not 0 < first_groups_per_step < groups_per_step or step - 1 >= groups_per_step.bit_length():
        return groups_per_step
    return min(groups_per_step, first_groups_per_step << max(0, step - 1))


def groups_ahead(step: int, steps_since_sync: int, lc: Any) -> int:
    """The groups of the steps after ``step`` that may still train a group an actor starts now (a
    ``[learner]`` section ``lc``): the rest of this version's ``sync_every_steps`` and
    ``sync_every_steps * max_staleness`` steps more."""
    steps = lc.sync_every_steps * (lc.max_staleness + 1) - steps_since_sync
    return sum(groups_for_step(step + j, lc.groups_per_step, lc.first_groups_per_step) for j in range(1, steps + 1))


class Learner:
    """The ``learn`` loop on one rank (module docstring)."""

    def __init__(self, cfg: AgentRLConfig, *, io: LearnerIO | None = None) -> None:
        from agentrl.learner.batching import GroupBuffer
        from agentrl.learner.checkpoint import checkpoint_root
        from agentrl.learner.distributed import broadcast_object, init_distributed
        from agentrl.learner.trainer import Trainer, TrainerSpec
        from agentrl.models.builder import ensure_model

        self.cfg = cfg
        self.lc = cfg.learner
        self.dist = init_distributed(self.lc.device)
        seed_everything(cfg.run.seed, cfg.run.torch_num_threads)
        self.run_dir = Path(broadcast_object(str(resolve_run_dir(cfg)) if self.dist.is_main else None))
        model_path = cfg.model.path
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ensure_model(model_path, cfg.model.init_size, seed=cfg.run.seed)
            (self.run_dir / "learner_config.toml").write_text(dump_toml(cfg))
        # rank 0 with the real io (tests pass their own): the tracker opens while the rest starts
        self._tracker_opening = (
            open_tracker_in_background(cfg, self.run_dir) if self.dist.is_main and io is None else None
        )
        broadcast_object(None)  # everyone waits until the model exists
        self.trainer = Trainer(TrainerSpec.for_learn(cfg), self.dist)
        self.ckpt_root = checkpoint_root(self.run_dir, "learn")
        self.version = 0
        self.steps_since_sync = 0
        self.exit_reason = "done"
        self._stop_requested = False
        self._wait_started: float | None = None  # when the wait for the current batch began (None: training)
        self._wait_counters: dict[str, int] = {}  # the buffer's counters when that wait began
        self._data_warning = ""  # plain words when the data cannot fill a batch (see _starved_by_zero_variance)
        self._data_since: float | None = None  # when this learner first held a group (the data-wait clock)
        self._stop_message = ""  # why the learner stopped early, in words (learner_status.json)
        self._checkpoint_errors: list[str] = []  # checkpoint writes that failed (learner_status.json)
        self._saved_step: int | None = None  # the step of the last checkpoint written or loaded
        self._finished = False  # the loop has ended (learner_status.json then says why)
        self._batch_stats: dict[str, float] = {}
        self.io: LearnerIO | None = None
        self._params_logged = False  # the config, logged to the tracker when it is first taken
        self.buffer: GroupBuffer | None = None
        self.session = uuid.uuid4().hex[:16]  # this process: actors resend what it has not acknowledged
        self.lineage = ""  # this run's chain of checkpoints and journal (set by _resume)
        self.ledger = Ledger()
        self.journal: Journal | None = None
        self._batch_keys: list[list] = []
        self._batch_groups: list[TrajectoryGroup] = []  # the current step's (rank 0), for sample episodes
        self.rollout = RolloutStats()  # what the actors did, per step (rank 0)
        self._tokenizer: Any = None  # loaded for sample episodes without messages only
        if self.dist.is_main:
            self.io = io if io is not None else open_io(cfg, self.run_dir)
            self.buffer = GroupBuffer(
                max_staleness=self.lc.max_staleness,
                dynamic_sampling=self.lc.dynamic_sampling,
                vocab_size=self.trainer.vocab_size,
                max_sequence_tokens=self.lc.max_tokens_per_microbatch,
                max_abs_reward=self.lc.max_abs_reward,
                vision=self.trainer.vision,  # images are checked against the model's processor at the border
            )
        self.push_enabled = bool(broadcast_object(self.io is not None and self.io.weights is not None))
        self._next_engine_check = 0.0
        self._published_at = 0.0  # monotonic time of the last progress message
        self._published_accept = -1  # the budget it carried
        # adapter sync: an engine at this learner's version may still hold none of its adapter (a fresh
        # run's engines serve the base model as version 0), while the actors' requests name it
        self._adapter_loaded = not cfg.learner.lora.served_adapter
        self.metrics_file = self.run_dir / "learner_metrics.jsonl"
        self.batches_file = self.run_dir / "learner_batches.jsonl"

    # ------------------------------------------------------------------ main loop

    def run(self) -> str:
        """Train until ``max_steps`` (or a stop); returns ``done``, ``stopped`` or ``data_timeout``."""
        restore = self._install_signal_handlers()
        try:
            self._resume()
            self._update_engines(self._engines_changed())
            self._publish()  # the actors' first budget
            while self.trainer.step < self.lc.max_steps:
                started = time.perf_counter()
                samples = self._next_batch()
                if samples is None:
                    break
                wait_s = time.perf_counter() - started
                step_started = time.perf_counter()
                metrics = self.trainer.rl_step(samples)
                train_s = time.perf_counter() - step_started
                self.steps_since_sync += 1
                push_s = self._sync_weights() if self.steps_since_sync >= self.lc.sync_every_steps else 0.0
                self._publish()
                checkpoint_s = 0.0
                every = self.lc.checkpoint_every_steps
                if every and self.trainer.step % every == 0:
                    checkpoint_s = self._checkpoint()
                tokens = sum(s.num_tokens for s in samples)
                metrics.update(
                    {
                        "time/wait_data_s": wait_s,
                        "time/train_s": train_s,
                        "time/weight_push_s": push_s,
                        "time/checkpoint_s": checkpoint_s,
                        "throughput/train_tokens_per_s": tokens / max(train_s, 1e-9),
                        "throughput/tokens_per_s": tokens / max(time.perf_counter() - started, 1e-9),
                        "policy_version": float(self.version),
                    }
                )
                self._log_step(metrics)
            if self.exit_reason == "done" and self.steps_since_sync > 0:
                self._sync_weights()  # the engines end with the final policy (evaluation reads it)
            if self._saved_step != self.trainer.step or self.trainer.step == 0:
                self._checkpoint()
            # done: actors stop; a stop or a data timeout: the last acknowledgements (actors draining
            # stop waiting) and counts, for the summary
            self._finished = True
            self._publish(done=self.exit_reason == "done")
            return self.exit_reason
        finally:
            if self.journal is not None:
                self.journal.close()
            if self.io is not None:
                self._take_tracker(quiet=True)  # so that closing the io closes it
                self.io.close()  # the progress publisher hands "done" to connected actors first
            restore()

    # ------------------------------------------------------------------ data

    def _next_batch(self) -> list | None:
        """Every rank: the next step's samples, or None when the loop must stop."""
        from agentrl.learner.distributed import broadcast_object

        self._wait_started = time.monotonic()
        self._last_wait_log = self._wait_started
        self._wait_counters = dict(self.buffer.counters) if self.buffer is not None else {}
        self._data_warning = ""
        while True:
            msg = self._poll() if self.dist.is_main else None
            msg = broadcast_object(msg)
            if msg[0] == "batch":
                self._wait_started = None
                return msg[1]
            if msg[0] == "engines":  # an engine left or (re)joined: re-form the group, push, tell the actors
                self._update_engines(msg[1])
                self._publish()
            if msg[0] == "stop":
                self.exit_reason = msg[1]
                return None

    def _poll(self) -> tuple:
        """Rank 0: gather groups for at most ``POLL_S``; returns a control message."""
        from agentrl.learner.batching import AdvantageSpec, batch_statistics, samples_from_groups

        assert self.buffer is not None and self.io is not None and self._wait_started is not None
        started = self._wait_started
        deadline = time.monotonic() + POLL_S
        while True:
            if self._stop_requested:
                return ("stop", "stopped")
            if self.push_enabled and time.monotonic() >= self._next_engine_check:
                self._next_engine_check = time.monotonic() + ENGINE_CHECK_S
                reason = self.io.weights.membership_change(self.version)
                if reason:
                    return ("engines", reason)
            self._drain()
            groups = self.buffer.take(self.step_groups, self.version)
            if groups is not None:
                self._batch_keys = [list(g.key) for g in groups]
                self._batch_groups = groups
                samples = samples_from_groups(groups, self.version, AdvantageSpec.from_learner(self.lc))
                self._batch_stats = batch_statistics(groups, samples)
                return ("batch", samples)
            now = time.monotonic()
            if now - self._last_wait_log >= self.lc.wait_log_interval_s:
                self._last_wait_log = now
                self._log_wait(now - started)
            since = max(started, self._data_since) if self._data_since is not None else None
            if self.lc.max_wait_for_data_s and since is not None and now - since >= self.lc.max_wait_for_data_s:
                self._data_warning = self._starved_by_zero_variance(now - started) or self._data_warning
                self._stop_message = (
                    f"no batch after {now - since:.0f} s with data arriving (learner.max_wait_for_"
                    f"data_s = {self.lc.max_wait_for_data_s:g}); stopped with a checkpoint"
                    + (f". {self._data_warning}" if self._data_warning else "")
                )
                log.error("%s", self._stop_message)
                return ("stop", "data_timeout")
            if now >= deadline:
                self._publish()
                return ("wait",)
            longest = FAST_PUBLISH_S if self._publish_if_due(now) else 0.5
            group = self.io.source.get(timeout_s=min(longest, max(0.01, deadline - now)))
            if group is not None:
                self._accept(group)

    @property
    def step_groups(self) -> int:
        """The groups the next step trains on (:func:`groups_for_step`)."""
        return groups_for_step(self.trainer.step + 1, self.lc.groups_per_step, self.lc.first_groups_per_step)

    def _publish_if_due(self, now: float) -> bool:
        """While waiting, progress sooner than every ``POLL_S``: every ``FAST_PUBLISH_S`` until the
        first group arrives (an actor hears its budget as soon as it subscribes), and when the budget
        changed (a dropped group the actors may replace at once). True while one is still due."""
        due = self._data_since is None or self._progress().accept_groups != self._published_accept
        if due and now - self._published_at >= FAST_PUBLISH_S:
            self._publish(status=False)
            return self._data_since is None
        return due

    def _accept(self, group: TrajectoryGroup) -> None:
        """A group from the transport: a duplicate is counted and dropped; a new one goes to
        the journal (acknowledged once synced, at the next publish), the ledger and the buffer."""
        assert self.buffer is not None and self.journal is not None
        if group in self.ledger:
            self.buffer.counters["duplicate"] += 1
            return
        self.journal.append(encode(group))
        self.ledger.record(group)
        if self._data_since is None:
            self._data_since = time.monotonic()
        self.rollout.add(group, self.version)
        self._add(group)

    def _add(self, group: TrajectoryGroup) -> None:
        assert self.buffer is not None
        reason = self.buffer.add(group, self.version)
        if reason is not None:
            log.debug("dropped group %s: %s", group.group_id, reason)

    def _drain(self) -> None:
        """Move the groups the transport has already received into the buffer (no waiting), up
        to a few steps' worth: beyond that they stay in the transport's bounded queue, which is
        what pushes back on the actors."""
        assert self.io is not None and self.buffer is not None
        while len(self.buffer) < 4 * self.lc.groups_per_step:
            group = self.io.source.get(timeout_s=0)
            if group is None:
                return
            self._accept(group)

    def _starved_by_zero_variance(self, waited_s: float) -> str:
        """Plain words when nearly every group received while waiting was dropped for having
        rewards that do not vary (GRPO learns nothing from them): the run cannot progress."""
        assert self.buffer is not None
        since = {k: v - self._wait_counters.get(k, 0) for k, v in self.buffer.counters.items()}
        received, flat = since.get("received", 0), since.get("dropped_zero_variance", 0)
        if waited_s < self.lc.wait_log_interval_s or received < self.lc.groups_per_step or flat < 0.9 * received:
            return ""
        return (
            f"{flat} of the {received} groups received in the last {waited_s:.0f} s had rewards that do not vary "
            "(every sample right, or every sample wrong), and GRPO learns nothing from those: dynamic sampling "
            "drops them, so no batch fills. Make the warm start stronger (more SFT), the tasks easier, "
            "actors.group_size larger, or set learner.dynamic_sampling = false."
        )

    def _log_wait(self, waited_s: float) -> None:
        assert self.buffer is not None and self.io is not None
        warning = self._starved_by_zero_variance(waited_s)
        if warning:
            log.warning("%s", warning)
        self._data_warning = warning
        self._write_status()
        counters = dict(self.buffer.counters)
        stats = dict(getattr(self.io.source, "stats", {}) or {})
        hint = "" if stats.get("received") else f" (nothing received yet on {self.cfg.actors.trajectory_endpoint})"
        log.info(
            "waiting for trajectory groups for %.0f s: have %d/%d at policy version %d; received %s, dropped %s, "
            "malformed messages %s%s",
            waited_s,
            len(self.buffer),
            self.step_groups,
            self.version,
            counters.get("received", 0),
            {k[8:]: v for k, v in counters.items() if k.startswith("dropped_")},
            stats.get("malformed", 0),
            hint,
        )

    # ------------------------------------------------------------------ progress and weights

    def _progress(self, done: bool = False) -> Progress:
        buffered = len(self.buffer) if self.buffer is not None else 0
        received = self.buffer.counters.get("received", 0) if self.buffer is not None else 0
        # cumulative (see Progress.accept_groups): everything received so far was started by an
        # actor, and at most this many more may be buffered or in flight for the current version
        ahead = groups_ahead(self.trainer.step, self.steps_since_sync, self.lc) - buffered
        return Progress(
            policy_version=self.version,
            accept_groups=0 if done else max(0, received + ahead),
            step=self.trainer.step,
            max_staleness=self.lc.max_staleness,
            done=done,
            learner_session=self.session,
            actors=self.ledger.acks(),
        )

    def _publish(self, done: bool = False, *, status: bool = True) -> None:
        if self.journal is not None:
            self.journal.sync()  # what the progress acknowledges is on disk
        progress = self._progress(done)
        self._published_at, self._published_accept = time.monotonic(), progress.accept_groups
        if self.io is not None and self.io.progress is not None:
            self.io.progress.publish(progress)
        if self.buffer is not None and status:
            self._write_status()

    def _write_status(self) -> None:
        """``learner_status.json``: what the learner holds and has dropped, by reason, as it
        happens (the per-step metrics say nothing while no step runs), and any warning about the
        data. Rewritten atomically at every publish; ``agentrl run``'s live table and summary read it."""
        assert self.buffer is not None
        counters = dict(self.buffer.counters)
        waiting = self._wait_started
        status = {
            "time": time.time(),
            "step": self.trainer.step,
            "policy_version": self.version,
            "buffered": len(self.buffer),
            "groups_per_step": self.step_groups,
            "waiting_s": round(time.monotonic() - waiting, 1) if waiting is not None else 0.0,
            "received": counters.get("received", 0),
            "consumed": counters.get("consumed", 0),
            "duplicate": counters.get("duplicate", 0),
            "dropped": {k[len("dropped_") :]: v for k, v in sorted(counters.items()) if k.startswith("dropped_")},
            "warning": self._data_warning,
            "exit_reason": self.exit_reason if self._finished else None,
            "stop_message": self._stop_message,
            "checkpoint_step": self._saved_step,
            "checkpoint_errors": self._checkpoint_errors[-10:],
        }
        tmp = self.run_dir / "learner_status.json.tmp"
        tmp.write_text(json.dumps(status))
        tmp.replace(self.run_dir / "learner_status.json")

    def _sync_weights(self) -> float:
        """Bump the policy version and push the weights (every rank takes part in the gathers)."""
        self.version += 1
        self.steps_since_sync = 0
        return self._update_engines(self._engines_changed())

    def _engines_changed(self) -> str:
        """Every rank: why the weight group must be re-formed (rank 0 asks the engines), or ``""``."""
        from agentrl.learner.distributed import broadcast_object

        reason = ""
        if self.push_enabled and self.io is not None:
            self._next_engine_check = time.monotonic() + ENGINE_CHECK_S
            reason = self.io.weights.membership_change(self.version)
        return str(broadcast_object(reason) or "") if self.push_enabled else ""

    def _update_engines(self, reason: str) -> float:
        """Every rank: bring every engine that answers to this learner's policy. With ``reason``
        (a membership change) rank 0 first re-forms the weight group; then every member that
        does not report the current version gets the weights. When the trainer has stepped since
        the last push its weights are no longer that version's, so the version is bumped first.
        A push that loses an engine is retried on a re-formed group, ``MAX_PUSH_ATTEMPTS`` times
        in all; after that the engines left behind are found again by the next check. Returns
        the seconds spent pushing."""
        from agentrl.learner.distributed import broadcast_object
        from agentrl.learner.weight_push import EngineLost

        if not self.push_enabled:
            return 0.0
        seconds = 0.0
        for _ in range(MAX_PUSH_ATTEMPTS):
            lagging = None
            if self.io is not None:
                try:
                    if reason:
                        log.warning("re-forming the weight group: %s", reason)
                        self.io.weights.connect()
                    lagging = self.io.weights.lagging(self.version)
                    if not self._adapter_loaded:
                        lagging = list(self.io.weights.members)
                except EngineLost as e:  # an engine died while the group formed: again
                    lagging = f"{e}"
            lagging = broadcast_object(lagging)
            if isinstance(lagging, str):
                reason = lagging
                continue
            if not lagging:
                return seconds
            if self.steps_since_sync:
                self.version += 1
                self.steps_since_sync = 0
            started = time.perf_counter()
            error = self._push()
            seconds += time.perf_counter() - started
            if not error:
                self._adapter_loaded = True
                return seconds
            reason = error
        log.error(
            "the engines could not all be brought to policy version %d (%s); trying again within %.0f s",
            self.version,
            reason,
            ENGINE_CHECK_S,
        )
        return seconds

    def _push(self) -> str:
        """Every rank: push the trainer's weights as the current version. Returns ``""``, or (on
        every rank) why an engine was lost; an engine's refusal raises."""
        import torch

        from agentrl.learner.distributed import broadcast_object
        from agentrl.learner.weight_push import EngineLost, push_adapter, push_weights

        started = time.perf_counter()
        error = ""
        updater = self.io.weights if self.io is not None else None
        try:
            if self.cfg.learner.lora.served_adapter:  # LoRA, adapter only: a PEFT folder through /load_lora_adapter
                push_adapter(
                    self.trainer.policy,
                    updater,
                    self.version,
                    folder_root=self.run_dir / "lora_adapters",
                    spec=self.trainer.spec.lora,
                    base_model_path=self.trainer.spec.model_path,
                )
            else:  # full weights, LoRA merged into them
                push_weights(
                    self.trainer.policy,
                    updater,
                    self.version,
                    bucket_bytes=int(self.cfg.engine.weight_bucket_mb * (1 << 20)),
                    dtype=getattr(torch, self.cfg.model.dtype),
                )
        except EngineLost as e:  # rank 0 only; the gathers of the other ranks ran to the end
            error = str(e)
        error = str(broadcast_object(error) or "")
        if self.dist.is_main:
            if error:
                log.warning("pushing policy version %d lost an engine: %s", self.version, error)
            else:
                log.info("pushed weights of policy version %d in %.2f s", self.version, time.perf_counter() - started)
        return error

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint(self) -> float:
        import msgpack

        from agentrl.learner.checkpoint import checkpoint_meta, fallback_root, kept_checkpoints

        started = time.perf_counter()
        pending = b""
        state: dict[str, Any] = {
            "policy_version": self.version,
            "steps_since_sync": self.steps_since_sync,
            "lineage": self.lineage,
        }
        if self.buffer is not None and self.journal is not None:
            self._drain()  # groups already received are saved too, not lost on a restart
            pending = cast(bytes, msgpack.packb([encode(g) for g in self.buffer.groups], use_bin_type=True))
            state["counters"] = dict(self.buffer.counters)
            state["env_counters"] = {env: dict(c) for env, c in self.buffer.env_counters.items()}
            state["ledger"] = self.ledger.state()
            state["journal_segment"] = self.journal.rotate()  # groups from now on: replayed after this checkpoint
        path = self._save_retrying(state, pending)
        if path is None:
            return time.perf_counter() - started
        self._saved_step = self.trainer.step
        if self.journal is not None:
            roots = (self.ckpt_root, fallback_root(self.run_dir, "learn"))
            kept = [checkpoint_meta(p) or {} for root in roots for p in kept_checkpoints(root, self.lineage)]
            segments = [m.get("caller", {}).get("journal_segment") for m in kept]
            self.journal.prune(min((s for s in segments if isinstance(s, int)), default=0))
        if self.dist.is_main:
            log.info("checkpoint %s (policy version %d)", path, self.version)
        return time.perf_counter() - started

    def _save_retrying(self, state: dict[str, Any], pending: bytes) -> Path | None:
        """Every rank: write the checkpoint, ``CHECKPOINT_ATTEMPTS`` times with back-off under the
        checkpoint folder, then as often under the fallback folder; None (logged, and in
        learner_status.json) when every write failed: training goes on, the next checkpoint tries
        again. Rank 0 tests the folder first, so a folder that refuses writes fails on every rank
        alike; a write failing inside the collective save is retried on a single rank only."""
        from agentrl.learner.checkpoint import fallback_root, save_checkpoint, write_problem
        from agentrl.learner.distributed import broadcast_object

        errors: list[str] = []
        for root in (self.ckpt_root, fallback_root(self.run_dir, "learn")):
            for attempt in range(CHECKPOINT_ATTEMPTS):
                if attempt:
                    time.sleep(CHECKPOINT_BACKOFF_S * 2 ** (attempt - 1))
                problem = str(broadcast_object(write_problem(root) if self.dist.is_main else None) or "")
                if not problem:
                    try:
                        path = save_checkpoint(
                            root,
                            self.trainer,
                            state=state,
                            pending_groups=pending,
                            keep=self.lc.keep_checkpoints,
                            lineage=self.lineage,
                        )
                    except OSError as e:
                        if self.dist.world_size > 1:
                            raise
                        problem = f"{type(e).__name__}: {e}"
                    else:
                        if errors and self.dist.is_main:
                            self._report_checkpoint_error(
                                f"checkpoint of step {self.trainer.step} written to "
                                f"{path} after {len(errors)} failed writes: {errors[-1]}"
                            )
                        return path
                errors.append(problem)
                if self.dist.is_main:
                    log.warning(
                        "checkpoint of step %d under %s failed (attempt %d/%d): %s",
                        self.trainer.step,
                        root,
                        attempt + 1,
                        CHECKPOINT_ATTEMPTS,
                        problem,
                    )
        if self.dist.is_main:
            self._report_checkpoint_error(
                f"checkpoint of step {self.trainer.step} failed {len(errors)} times, also "
                f"in the fallback folder: {errors[-1]}; training goes on (the engines hold "
                "the policy; the next checkpoint tries again)"
            )
        return None

    def _report_checkpoint_error(self, message: str) -> None:
        log.error("%s", message)
        self._checkpoint_errors.append(message)
        if self.buffer is not None:
            self._write_status()

    def _resume(self) -> None:
        """Every rank: restore the latest checkpoint (``resume = "auto"``); rank 0: the ledger,
        the counters, the waiting groups, then the journal's groups received after it."""
        import msgpack

        from agentrl.learner.checkpoint import latest_run_checkpoint, load_checkpoint
        from agentrl.learner.distributed import broadcast_object

        path = None
        if self.lc.resume == "auto":
            path = broadcast_object(latest_run_checkpoint(self.run_dir, "learn") if self.dist.is_main else None)
        state = load_checkpoint(path, self.trainer) if path is not None else {}
        if path is not None:
            self._saved_step = self.trainer.step
        if self.lc.resume == "auto" and self.dist.is_main:
            drop_rows_after(self.metrics_file, self.trainer.step)  # the steps after it are redone
        if path is None and self.lc.resume == "auto" and self.dist.is_main:
            state = self._journal_without_checkpoint()
        self.version = int(state.get("policy_version", 0))
        self.steps_since_sync = int(state.get("steps_since_sync", 0))
        self.lineage = str(broadcast_object(state.get("lineage") or uuid.uuid4().hex[:16]))
        if self.buffer is not None:
            self.buffer.counters.update(state.get("counters", {}))
            for env, counters in (state.get("env_counters") or {}).items():
                self.buffer.env_counters.setdefault(env, Counter()).update(counters)
            self.ledger = Ledger.from_state(state.get("ledger", {}))
            raw = state.get("pending_groups") or b""
            for item in msgpack.unpackb(raw, raw=False) if raw else []:
                group = self._decode_saved(item, "the checkpoint's pending groups")
                if group is not None:
                    self.buffer.restore(group)
            pending = len(self.buffer)
            self.journal = Journal(self.run_dir / "journal", self.lineage)
            replayed = 0
            if isinstance(state.get("journal_segment"), int):
                for item in self.journal.replay(state["journal_segment"]):
                    group = self._decode_saved(item, "the journal")
                    if group is not None and self.ledger.record(group):
                        self._add(group)
                        replayed += 1
            if len(self.buffer) or self.buffer.counters.get("received", 0):
                self._data_since = time.monotonic()  # data flows already (see _poll's data-wait clock)
            if path is not None or replayed:
                log.info(
                    "resumed from %s: next step %d, policy version %d, %d pending groups, %d groups from the "
                    "journal since the checkpoint",
                    path or "the initial weights (no checkpoint)",
                    self.trainer.step + 1,
                    self.version,
                    pending,
                    replayed,
                )

    def _journal_without_checkpoint(self) -> dict[str, Any]:
        """Rank 0, no checkpoint to resume: a learner of this run that died before its first
        checkpoint still left its journal, whose groups it acknowledged (actors no longer hold
        them). Continue that lineage and replay it from the start, so they are trained (again,
        from the initial weights: the dead learner's steps died with it). ``{}`` when there is none."""
        root = self.run_dir / "journal"
        lineages = [d for d in root.iterdir() if d.is_dir() and any(d.glob("*.log"))] if root.is_dir() else []
        if not lineages:
            return {}
        newest = max(lineages, key=lambda d: max(p.stat().st_mtime for p in d.glob("*.log")))
        log.warning(
            "no checkpoint, but the journal of an earlier learner of this run (%s): replaying it from the start", newest
        )
        return {"lineage": newest.name, "journal_segment": 0}

    @staticmethod
    def _decode_saved(item: bytes, where: str) -> TrajectoryGroup | None:
        try:
            group = decode(item)
        except ProtocolError as e:
            log.warning("dropping an unreadable group from %s: %s", where, e)
            return None
        return group if isinstance(group, TrajectoryGroup) else None

    # ------------------------------------------------------------------ logging and signals

    def _take_tracker(self, quiet: bool = False) -> Any:
        """Rank 0's tracker, the config logged to it once; the background opening's error raises here
        (the first step has trained, nothing of it is logged), or with ``quiet`` is only logged."""
        assert self.io is not None
        opening, self._tracker_opening = self._tracker_opening, None
        if opening is not None:
            try:
                self.io.tracker = opening.result()
            except Exception as e:
                if not quiet:
                    raise
                log.warning("the tracker did not open: %s", e)
        if self.io.tracker is not None and not self._params_logged:
            self._params_logged = True
            params = flatten_params(self.cfg, ("learner", "model", "run"))
            params["world_size"] = self.dist.world_size
            self.io.tracker.log_params(params)
        return self.io.tracker

    def _log_step(self, metrics: dict[str, float]) -> None:
        if not self.dist.is_main:
            return
        assert self.buffer is not None and self.io is not None
        row = dict(metrics)
        row.update(self._batch_stats)
        for key, value in self.buffer.counters.items():
            row[f"data/{key}"] = float(value)
        row.update(self.buffer.env_metrics())
        for key, value in (getattr(self.io.source, "stats", {}) or {}).items():
            row[f"transport/{key}"] = float(value)
        row["data/buffered"] = float(len(self.buffer))
        row.update(self.rollout.metrics())
        tracker = self._take_tracker()
        if tracker is not None:
            tracker.log_metrics(row, step=self.trainer.step)
            self._log_samples(tracker)
        with self.metrics_file.open("a") as f:
            f.write(json.dumps({"step": self.trainer.step, "time": time.time(), **row}) + "\n")
        with self.batches_file.open("a") as f:
            f.write(json.dumps({"step": self.trainer.step, "groups": self._batch_keys}) + "\n")
        log.info(
            "step %d | loss %.4f | reward %.3f | policy v%d | %.0f tok/s | wait %.1fs | dropped %d",
            self.trainer.step,
            row.get("loss/total", float("nan")),
            row.get("reward/mean", float("nan")),
            self.version,
            row.get("throughput/train_tokens_per_s", 0.0),
            row.get("time/wait_data_s", 0.0),
            sum(v for k, v in self.buffer.counters.items() if k.startswith("dropped_")),
        )

    def _log_samples(self, tracker: Any) -> None:
        """Every ``tracking.sample_episodes_every`` steps: the step's best and worst episodes
        (``agentrl.learner.rollout_stats.sample_episodes``) as ``samples/step_<step>.json``."""
        every, step = self.cfg.tracking.sample_episodes_every, self.trainer.step
        if not every or step % every or not self._batch_groups:
            return
        try:
            doc = sample_episodes(
                self._batch_groups,
                step=step,
                policy_version=self.version,
                groups_to_show=self.cfg.tracking.sample_episodes_groups,
                decode=self._decode,
            )
        except Exception as e:
            log.warning("sample episodes of step %d not logged: %s: %s", step, type(e).__name__, e)
            return
        tracker.log_json(doc, f"samples/step_{step:06d}.json")

    def _decode(self, ids: list[int]) -> str:
        """Token ids as text, with the model's tokenizer (loaded at the first call)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def _install_signal_handlers(self) -> Any:
        """SIGTERM/SIGINT request a clean stop; returns a function that restores the old handlers."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum: int, frame: Any) -> None:
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            log.warning("signal %d: stopping after the current step (again to abort)", signum)

        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        return lambda: [signal.signal(s, h) for s, h in old.items()]


def drop_rows_after(path: Path, step: int) -> int:
    """Rewrite a JSONL file of per-step rows without the rows after ``step`` (and a torn last line):
    a resumed learner redoes those steps, and their old rows belong to weights that died. Returns
    how many rows were dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            row_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            dropped += 1
            continue
        if row_step <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(path)
        log.info("%s: dropped %d rows after step %d (redone from the checkpoint)", path.name, dropped, step)
    return dropped


def learn(cfg: AgentRLConfig, *, io: LearnerIO | None = None) -> str:
    """Run the learner on this rank; returns the exit reason (see :meth:`Learner.run`)."""
    return Learner(cfg, io=io).run()
