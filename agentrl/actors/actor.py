"""One actor process: many concurrent episodes, gated by the learner's budget, sent as groups.

Scheduling: a group is the ``group_size`` samples of one task of one env, run concurrently; with
several envs each group's env is drawn by ``weight``. At most ``num_concurrent_episodes //
group_size`` groups are open (started and not yet delivered), which bounds memory when sending
blocks.

Gating: actor ``i`` of ``k`` takes the share ``accept // k + (i < accept % k)`` of
``Progress.accept_groups`` and starts a group only while what it uses is below it: the groups the
learner holds from its actor id (all sessions), those it holds unacknowledged, and those started
and not finished. Without any Progress the actor runs freely (bounded by ``max_groups``);
``wait_for_learner`` holds every start until the first one, and ``start_gate`` until that file exists
(``agentrl run`` starts its actors during the evaluation before RL and opens the gate after it and
once every actor waits at it, :func:`waiting_at_gate_path`).

Delivery: every finished group is stamped, sent and held by the
:class:`~agentrl.transport.delivery.Outbox` until acknowledged; resends and sends share one lock, so
the outbox's order is the wire's. Tasks: actor ``i`` takes every ``k``-th task of each env's
sequence, so the actors together cover it once per epoch.

Stopping: ``request_stop`` stops new starts and cancels in-flight groups; finished groups are still
sent within ``drain_timeout_s`` (inside ``agentrl run``'s stop grace); a second signal cancels
everything. Judge: the process's judge model (``[judge]``) is given to every env that declares a
``judge`` (:func:`hand_judge`); its counts go into the periodic log line and the report. See docs/actors.md.
"""

from __future__ import annotations

import json
import logging
import math
import random
import signal
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from agentrl.actors.metrics import ActorStats
from agentrl.envs.agent import AgentEnv
from agentrl.envs.base import Env, Task
from agentrl.episode.rollout import run_group
from agentrl.episode.turn import EngineClientLike, EpisodeLimits, GroupLost
from agentrl.judging import Judge, give_judge, wants_judge
from agentrl.protocol import Progress, TrajectoryGroup
from agentrl.tools.base import ToolBox
from agentrl.transport.base import GroupSink, ProgressSource
from agentrl.transport.delivery import Outbox

log = logging.getLogger(__name__)


def waiting_at_gate_path(gate: Path, actor_id: str) -> Path:
    """The file an actor creates when it is up and waits at ``gate`` (``agentrl run`` starts RL when
    every actor is)."""
    return gate.with_name(f"{gate.name}.waiting.{actor_id}")


def budget_share(accept_groups: int, index: int, num_actors: int) -> int:
    """Actor ``index``'s share of the learner's cumulative group budget."""
    return accept_groups // num_actors + (1 if index < accept_groups % num_actors else 0)


def hand_judge(envs: list[Env], judge: Judge | None) -> list[str]:
    """Give ``judge`` to every env that declares one (:func:`agentrl.judging.give_judge`); return their
    names. An AgentEnv cannot have one: its reward runs in the agent runner's own event loop, and the
    judge's connections and batches live in the actor's."""
    agents = [env.name for env in envs if isinstance(env, AgentEnv) and wants_judge(env)]
    if agents:
        raise ValueError(
            f"AgentEnv(s) {', '.join(agents)} declare a judge; a judge serves agentrl's own episode loop only"
        )
    return give_judge(envs, judge)


@dataclass
class ActorEnv:
    """One env of an actor process: its tools and limits, and its share of the groups."""

    env: Env
    toolbox: ToolBox
    limits: EpisodeLimits
    weight: float = 1.0

    @property
    def name(self) -> str:
        return self.env.name


@dataclass
class ActorSettings:
    group_size: int = 8
    num_concurrent_episodes: int = 64
    actor_index: int = 0
    num_actors: int = 1
    actor_id: str = ""  # stable across restarts of this actor; "" means f"actor{actor_index}"
    max_unacked_groups: int = 256  # groups held for a resend until the learner acknowledges them
    max_groups: int | None = None  # stop after delivering this many groups
    wait_for_learner: bool = False
    start_gate: Path | None = None  # no group starts before this file exists
    split: str = "train"
    seed: int = 0
    max_staleness: int = 1  # only checked against the learner's (the learner's value governs)
    log_interval_s: float = 30.0
    # well inside the grace agentrl run gives a stopping child (agentrl.run.supervisor.STOP_GRACE_S, 10 s), so a
    # stopped actor prints its report; the learner acknowledges within a poll (2 s) or a step
    drain_timeout_s: float = 4.0
    max_consecutive_lost: int = 20

    def __post_init__(self) -> None:
        if not 0 <= self.actor_index < self.num_actors:
            raise ValueError(f"actor index {self.actor_index} is not in [0, {self.num_actors})")
        if self.max_groups is not None and self.max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {self.max_groups}")
        if not self.actor_id:
            self.actor_id = f"actor{self.actor_index}"

    @property
    def max_open_groups(self) -> int:
        return max(1, self.num_concurrent_episodes // self.group_size)


class ActorService:
    """Runs groups of episodes until stopped; see the module docstring."""

    def __init__(
        self,
        *,
        client: EngineClientLike,
        tokenizer: Any,
        envs: list[ActorEnv],
        sampling: dict[str, Any],
        settings: ActorSettings,
        agents: Any = None,
        sender: GroupSink | None = None,
        progress: ProgressSource | None = None,
        dump_path: str | Path | None = None,
        judge: Judge | None = None,
    ):
        """``agents``: the process's :class:`agentrl.agents.agent_runner.AgentRunner`, entered by the caller;
        needed when an env is an :class:`agentrl.agents.AgentEnv`. ``judge``: the process's judge model,
        entered by the caller; needed when an env declares a ``judge``."""
        if not envs:
            raise ValueError("an actor needs at least one env")
        from agentrl.envs import check_env_names

        check_env_names([(type(e.env).__name__, e.name) for e in envs])
        needs_agents = [e.name for e in envs if isinstance(e.env, AgentEnv)]
        if needs_agents and agents is None:
            raise ValueError(f"env(s) {', '.join(needs_agents)} are AgentEnvs: the actor needs an AgentRunner")
        self.judged = hand_judge([e.env for e in envs], judge)  # the names of the envs that use it
        self.judge = judge
        self.client, self.tokenizer, self.envs, self.agents = client, tokenizer, list(envs), agents
        self.sampling, self.settings = sampling, settings
        self.sender, self.progress_source = sender, progress
        self.dump_path = Path(dump_path) if dump_path else None
        self.stats = ActorStats()
        self.outbox = Outbox(settings.actor_id, max_unacked=settings.max_unacked_groups)
        self._resend: deque[TrajectoryGroup] = deque()
        self._send_lock = trio.Lock()
        self.progress: Progress | None = None
        self.stop_reason = ""
        self.failed = False  # stopped because groups kept failing
        self._changed = trio.Event()
        self._groups_scope: trio.CancelScope | None = None
        self._consecutive_lost = 0
        self._not_before = 0.0
        self._warned_staleness = False
        self._gate_closed = settings.start_gate is not None
        if settings.max_open_groups * settings.group_size < settings.num_concurrent_episodes:
            log.info(
                "num_concurrent_episodes %d is not a multiple of group_size %d: running %d episodes",
                settings.num_concurrent_episodes,
                settings.group_size,
                settings.max_open_groups * settings.group_size,
            )
        if settings.group_size > settings.num_concurrent_episodes:
            log.warning(
                "group_size %d > num_concurrent_episodes %d: one group at a time",
                settings.group_size,
                settings.num_concurrent_episodes,
            )

    # ------------------------------------------------------------------ control

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def request_stop(self, reason: str) -> None:
        """Start no more groups, abandon running ones, deliver finished ones."""
        if not self.stop_reason:
            log.info("stopping: %s", reason)
            self.stop_reason = reason
        if self._groups_scope is not None:
            self._groups_scope.cancel()
        self._notify()

    @property
    def open_groups(self) -> int:
        s = self.stats
        return s.groups_started - s.groups_lost - s.groups_abandoned - s.groups_delivered

    def may_start(self) -> bool:
        """Whether a new group may start now (capacity, max_groups, the learner's budget)."""
        s, cfg = self.stats, self.settings
        if self.stop_reason or self._gate_closed or self.open_groups >= cfg.max_open_groups:
            return False
        if cfg.max_groups is not None and s.groups_started - s.groups_lost - s.groups_abandoned >= cfg.max_groups:
            return False
        if self.progress is None:
            return not cfg.wait_for_learner
        return self.budget_used() < budget_share(self.progress.accept_groups, cfg.actor_index, cfg.num_actors)

    def budget_used(self) -> int:
        """Groups of this actor id that count against its share (module docstring, "Gating")."""
        s, box = self.stats, self.outbox
        running = s.groups_started - s.groups_lost - s.groups_abandoned - box.produced
        return box.learner_holds + box.unacknowledged + running

    # ------------------------------------------------------------------ main

    async def run(self, *, handle_signals: bool = False, task_status=trio.TASK_STATUS_IGNORED) -> dict[str, Any]:
        """Run until stopped; return the report."""
        send_in, send_out = trio.open_memory_channel[TrajectoryGroup](self.settings.max_open_groups)
        delivered_all = trio.Event()
        dump = self.dump_path.open("a", encoding="utf-8") if self.dump_path else None
        try:
            async with trio.open_nursery() as root:
                if self.progress_source is not None:
                    root.start_soon(self._listen_progress)
                if self._gate_closed:
                    root.start_soon(self._open_gate)
                if self.sender is not None:
                    root.start_soon(self._resend_lost)
                if handle_signals:
                    root.start_soon(self._watch_signals, root.cancel_scope)
                if self.settings.log_interval_s > 0:
                    root.start_soon(self._log_periodically)
                root.start_soon(self._deliver, send_out, dump, delivered_all)
                task_status.started()
                async with send_in:
                    async with trio.open_nursery() as groups:
                        self._groups_scope = groups.cancel_scope
                        if self.stop_reason:
                            groups.cancel_scope.cancel()
                        await self._schedule(groups, send_in)
                # deliver what finished; once a stop is requested, for at most drain_timeout_s, in
                # which the learner may also acknowledge what was sent (unless it is done)
                while not delivered_all.is_set() and not self.stop_reason:
                    await self._changed.wait()
                with trio.move_on_after(self.settings.drain_timeout_s):
                    await delivered_all.wait()
                    while self._awaiting_acks():
                        await self._changed.wait()
                root.cancel_scope.cancel()
        finally:
            if dump is not None:
                dump.close()
        return self.report()

    async def _open_gate(self, poll_s: float = 0.02) -> None:
        """Wait for ``settings.start_gate`` to exist (a file another process creates), then let groups
        start; meanwhile :func:`waiting_at_gate_path` says this actor is up."""
        gate = self.settings.start_gate
        assert gate is not None
        waiting_at_gate_path(gate, self.settings.actor_id).touch()
        while not gate.exists():
            await trio.sleep(poll_s)
        log.info("start gate %s open", gate)
        self._gate_closed = False
        self._notify()

    def _awaiting_acks(self) -> bool:
        return self.outbox.held > 0 and self.sender is not None and self.progress is not None and not self.progress.done

    def report(self) -> dict[str, Any]:
        s = self.stats
        return {
            "stop_reason": self.stop_reason or "done",
            "failed": self.failed,
            "groups_unsent": s.groups_completed - s.groups_delivered,
            "last_progress": None
            if self.progress is None
            else {
                "policy_version": self.progress.policy_version,
                "accept_groups": self.progress.accept_groups,
                "learner_session": self.progress.learner_session,
            },
            **self.outbox.stats(),
            **s.summary(),
            **({"judge": self.judge.stats.summary()} if self.judge is not None else {}),
        }

    async def _schedule(self, groups: trio.Nursery, send_in: trio.MemorySendChannel) -> None:
        cfg = self.settings
        tasks = {i: self._tasks(e.env) for i, e in enumerate(self.envs)}
        rng = random.Random(f"agentrl-envs-{cfg.seed}-{cfg.actor_index}")
        while not self.stop_reason:
            cfg, s = self.settings, self.stats
            if cfg.max_groups is not None and s.groups_delivered >= cfg.max_groups:
                self.request_stop(f"delivered max_groups={cfg.max_groups}")
                return
            wait_s = self._not_before - time.monotonic()
            if wait_s > 0:
                with trio.move_on_after(wait_s):
                    await self._changed.wait()
                continue
            if not self.may_start():
                await self._changed.wait()
                continue
            if not tasks:
                log.info("no more tasks in split %r; finishing the open groups", cfg.split)
                return  # the nursery waits for the open groups; then delivery drains
            index = rng.choices(list(tasks), weights=[self.envs[i].weight for i in tasks])[0]
            entry = self.envs[index]
            try:
                task = next(tasks[index], None)
            except Exception as e:  # an env bug: stop cleanly with the reason
                self.failed = True
                self.request_stop(f"{type(entry.env).__name__}.tasks() raised {type(e).__name__}: {e}")
                return
            if task is None:
                log.info("env %s has no more tasks in split %r", entry.name, cfg.split)
                del tasks[index]
                continue
            s.groups_started += 1
            s.env(entry.name).groups_started += 1
            groups.start_soon(self._group, entry, task, send_in.clone())

    def _tasks(self, env: Env) -> Iterator[Task]:
        cfg = self.settings
        epoch = 0
        while True:
            position = -1
            for position, task in enumerate(env.tasks(cfg.split, cfg.seed + epoch)):
                if position % cfg.num_actors == cfg.actor_index:
                    yield task
            if position < 0:
                raise ValueError(f"{type(env).__name__}.tasks({cfg.split!r}) yielded no tasks")
            if cfg.split != "train":
                return
            epoch += 1

    async def _play_group(self, entry: ActorEnv, task: Task, extra: dict[str, Any]) -> TrajectoryGroup:
        """The group's ``group_size`` episodes, by agentrl's own loop or, for an AgentEnv, its agent."""
        cfg = self.settings
        gid = uuid.uuid4().hex[:12]
        if isinstance(entry.env, AgentEnv):
            group = await self.agents.play_group(
                entry.env,
                task,
                cfg.group_size,
                group_id=gid,
                actor_id=cfg.actor_id,
                extra_metadata=extra,
                limits=entry.limits,
            )
        else:
            group = await run_group(
                self.client,
                self.tokenizer,
                entry.env,
                entry.toolbox,
                task,
                self.sampling,
                entry.limits,
                cfg.group_size,
                group_id=gid,
                actor_id=cfg.actor_id,
                extra_metadata=extra,
            )
        for t in group.trajectories:
            t.metadata["success"] = _is_success(entry.env, task, t.reward)
        return group

    async def _group(self, entry: ActorEnv, task: Task, send_in: trio.MemorySendChannel) -> None:
        cfg, s = self.settings, self.stats
        version = None if self.progress is None else self.progress.policy_version
        extra = {"policy_version_at_start": -1 if version is None else version}
        async with send_in:
            ended = False  # completed or lost; otherwise cancelled (Cancelled may arrive in an exception group)
            try:
                group = await self._play_group(entry, task, extra)
                ended = True
            except GroupLost as e:
                ended = True
                self._on_lost(entry, task, str(e))
                return
            finally:
                if not ended:
                    s.groups_abandoned += 1
                    s.episodes_abandoned += cfg.group_size
                self._notify()
            self._consecutive_lost = 0
            s.add_group(group)
            send_in.send_nowait(group)  # never full: the buffer holds max_open_groups

    def _on_lost(self, entry: ActorEnv, task: Task, reason: str) -> None:
        self.stats.add_lost(reason, entry.name)
        self._consecutive_lost += 1
        n = self._consecutive_lost
        log.warning("group of task %s (env %s) lost (%d in a row): %s", task.id, entry.name, n, reason)
        if n >= self.settings.max_consecutive_lost:
            self.failed = True
            self.request_stop(f"{n} groups lost in a row, last: {reason}")
        else:  # back off so a down engine is not hammered
            self._not_before = time.monotonic() + min(30.0, 0.25 * 2 ** (n - 1))

    async def _deliver(self, send_out: trio.MemoryReceiveChannel, dump: Any, done: trio.Event) -> None:
        async with send_out:
            async for group in send_out:
                self.outbox.stamp(group)
                if dump is not None:
                    dump.write(json.dumps(group_to_json(group), default=str) + "\n")
                    dump.flush()
                if self.sender is not None:
                    await self._send(group)
                self.stats.groups_delivered += 1
                self._notify()
        done.set()
        self._notify()

    async def _send(self, group: TrajectoryGroup) -> None:
        assert self.sender is not None
        async with self._send_lock:  # the outbox's record of the order is the order on the wire
            await self.sender.send(group)
            self.outbox.sent(group)

    async def _resend_lost(self) -> None:
        """Send again what the outbox says the learner lost (queued by _listen_progress)."""
        while True:
            while not self._resend:
                await self._changed.wait()
            group = self._resend.popleft()
            if self.outbox.is_held(group):  # not acknowledged meanwhile
                await self._send(group)

    async def _listen_progress(self) -> None:
        assert self.progress_source is not None
        while True:
            try:
                progress = await self.progress_source.receive()
            except Exception as e:
                self.failed = True
                self.request_stop(f"the progress channel failed: {type(e).__name__}: {e}")
                return
            if self.progress is None:
                log.info(
                    "learner seen: policy version %d, budget %d groups", progress.policy_version, progress.accept_groups
                )
            self.progress = progress
            self._resend.extend(self.outbox.on_progress(progress))
            if progress.max_staleness != self.settings.max_staleness and not self._warned_staleness:
                self._warned_staleness = True
                log.warning(
                    "actors.max_staleness=%d but the learner publishes %d; the learner's value governs",
                    self.settings.max_staleness,
                    progress.max_staleness,
                )
            if progress.done:
                self.request_stop("the learner is done")
            self._notify()

    async def _watch_signals(self, root: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if self.stop_reason:
                    log.warning("second signal: stopping now")
                    root.cancel()
                    return
                self.request_stop(f"received {signal.Signals(signum).name}")

    async def _log_periodically(self) -> None:
        while True:
            await trio.sleep(self.settings.log_interval_s)
            window = self.stats.window()
            s = self.stats.summary()
            log.info(
                "actor %s: %.1f turns/s, %.2f groups/s, open %d, delivered %d, unacked %d, lost %d, reward %.3f, "
                "turns %.2f, tool errors %.3f, finish %s",
                self.settings.actor_id,
                window["turns_per_s"],
                window["groups_per_s"],
                self.open_groups,
                s["groups_delivered"],
                self.outbox.held,
                s["groups_lost"],
                s["reward_mean"],
                s["turns_mean"],
                s["tool_error_rate"],
                s["finish_reasons"],
            )
            if self.judge is not None:
                j = self.judge.stats.summary()
                log.info(
                    "actor %s judge: %d calls, %d verdicts, %d failures %s, %.2f calls per batch, latency %.3f s "
                    "mean, %.3f s max",
                    self.settings.actor_id,
                    j["calls"],
                    j["verdicts"],
                    j["failures"],
                    j["failures_by_kind"],
                    j["batch_mean"],
                    j["latency_mean_s"],
                    j["latency_max_s"],
                )


def _is_success(env: Env, task: Task, reward: float) -> bool:
    """``env.is_success``; an env whose ``is_success`` raises says nothing about success (False, logged)."""
    try:
        return bool(env.is_success(task, reward))
    except Exception as e:
        log.warning("%s.is_success raised %s: %s", type(env).__name__, type(e).__name__, e)
        return False


def group_to_json(group: TrajectoryGroup) -> dict[str, Any]:
    """A group as one JSON object (for ``--dump-trajectories``)."""
    return {
        "group_id": group.group_id,
        "task_id": group.task_id,
        "env": group.env,
        "actor_id": group.actor_id,
        "session": group.session,
        "seq": group.seq,
        "created_at": group.created_at,
        "trajectories": [
            {
                "reward": t.reward,
                "reward_components": t.reward_components,
                "tokens": t.tokens.tolist(),
                "loss_mask": t.loss_mask.tolist(),
                "behavior_logprobs": [round(float(x), 6) if math.isfinite(x) else None for x in t.behavior_logprobs],
                "weight_versions": t.weight_versions.tolist(),
                "metadata": t.metadata,
            }
            for t in group.trajectories
        ],
    }
