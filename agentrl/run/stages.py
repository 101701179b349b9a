"""``agentrl run CONFIG``: every process a run needs, started and supervised from one command.

The stages, in order, under one trio nursery (:class:`agentrl.run.supervisor.Supervisor`):

1. **Model**: the tiny model at ``model.path`` built when absent (``model.init_size``).
2. **Warm start** (``sft.enabled``): ``agentrl sft`` exported to ``<run_dir>/sft/model``, the policy of
   every later stage; reused when it exists, unless the folder's fingerprint changed
   (:mod:`agentrl.run.fingerprint`: the folder is set aside first).
3. **Engines**: ``engine.num_engines`` servers on free ports, or the running ones of ``engine.urls``
   (which first load this run's policy as version 0); a retrieval server per env with
   ``kwargs.search_url = "auto"``; the judge engines of ``[judge]`` (never updated by the learner).
4. **Evaluation before** RL, played by this process through the same engines; a fresh learner and the
   actors start up meanwhile (the learner pushes nothing before the actors bring data, and the actors
   start no episode before the gate file ``<run_dir>/rl_started`` exists).
5. **RL**: the gate opens once a fresh learner (its first progress; a resumed one starts now) and
   every actor are up too; a child that dies is restarted (:mod:`agentrl.run.process_plan`: restart
   policy), each restart an event with what it means for the run. The live view follows the
   learner, and an evaluation runs every ``eval.every_steps``.
6. **Evaluation after**, on the engines that report the learner's final version; then
   ``summary.json`` and the run's MLflow run (:mod:`agentrl.run.report`).

Invariants: a plan that does not fit the visible GPUs is refused before anything starts; every child
gets the resolved ``config.toml`` and its own GPUs; ``summary.json`` is written whatever happens.
Ctrl-C, SIGTERM and SIGHUP stop every child (actors first); a child that keeps failing stops the run,
named, with the end of its log. See docs/run.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import trio

from agentrl.actors.actor import waiting_at_gate_path
from agentrl.config import AgentRLConfig, EnvSection
from agentrl.engine.launch import wait_ready
from agentrl.envs.base import _import_module_or_file
from agentrl.learner.journal import count_records
from agentrl.models.builder import ensure_model
from agentrl.run.accounting import balance_line, newest_journal
from agentrl.run.evaluate import evaluate_policy, load_policy_into_engines, newest_policy_engines
from agentrl.run.fingerprint import prepare_run_dir
from agentrl.run.placement import Placement, placement_for, visible_gpus
from agentrl.run.process_plan import (
    ENGINES_START_S,
    MAX_RESTARTS,
    ChildSpec,
    actor_specs,
    agentrl_argv,
    engine_specs,
    judge_problem,
    judge_specs,
    learner_spec,
    owns_judges,
    plan_config,
    rl_gate_path,
    write_config,
)
from agentrl.run.report import (
    PLAIN_LINE_S,
    LiveView,
    RunState,
    create_mlflow_run,
    last_json_line,
    live_view,
    log_to_mlflow,
    refresh,
    summarize,
)
from agentrl.run.supervisor import ChildFailed, Supervisor
from agentrl.transport import ProgressSubscriber, security_from_config

log = logging.getLogger("agentrl.run")
START_POLL_S = 0.05  # how often the run looks whether the learner and the actors are up before RL starts


def run(
    cfg: AgentRLConfig, run_dir: Path, *, live_display: bool = True, placement: Placement | None = None
) -> dict[str, Any]:
    """Run synchronously; raises :class:`ChildFailed` (unwrapped) when a critical child fails, and
    :class:`PlacementError` before anything starts when the GPUs do not fit the config."""
    try:
        return trio.run(functools.partial(run_async, cfg, run_dir, live_display=live_display, placement=placement))
    except BaseExceptionGroup as group:
        failed = group.subgroup(ChildFailed)
        if failed is not None:
            raise _first(failed) from None
        stopped = group.subgroup(StopSignal)
        if stopped is not None:  # SIGTERM/SIGHUP: the children are already stopped
            raise _first(stopped) from None
        if group.subgroup(KeyboardInterrupt) is not None:  # Ctrl-C: the children are already stopped
            raise KeyboardInterrupt from None
        raise


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first leaf exception of a (nested) exception group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class StopSignal(Exception):
    """SIGTERM or SIGHUP (how SLURM, Kubernetes and systemd stop a job): the run stops exactly as
    on Ctrl-C -- every child stopped, ``summary.json`` written."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


async def _stop_on_signal(state: RunState) -> None:
    """Raise :class:`StopSignal` on SIGTERM or SIGHUP, which unwinds the run as Ctrl-C does."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
        async for signum in signals:
            state.event("run", f"{signal.Signals(signum).name} received: stopping every process")
            raise StopSignal(signum)


async def run_async(
    cfg: AgentRLConfig, run_dir: Path, *, live_display: bool = True, placement: Placement | None = None
) -> dict[str, Any]:
    """The whole run (the stages above); returns the summary, also written when it stops or fails."""
    placement = placement or placement_for(cfg, visible_gpus())  # refused before anything starts
    problem = judge_problem(cfg)
    if problem:
        raise ValueError(problem)  # before anything starts, too
    superseded = await trio.to_thread.run_sync(prepare_run_dir, cfg, run_dir)
    state = RunState(run_dir)
    if superseded:
        state.event("run", superseded, logging.WARNING)
    for line in placement.describe():
        state.event("placement", line)
    # actors stop first: the learner still acknowledges what they deliver, and they print their reports
    sup = Supervisor(on_event=lambda name, what: _on_event(state, name, what), stop_first=("actor",))
    if cfg.tracking.enabled and not cfg.tracking.uri:
        cfg = cfg.model_copy(
            update={
                "tracking": cfg.tracking.model_copy(update={"uri": f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"})
            }
        )
    if cfg.tracking.enabled and not cfg.tracking.run_id:
        run_id = await trio.to_thread.run_sync(create_mlflow_run, cfg, run_dir)
        cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"run_id": run_id})})
    await trio.to_thread.run_sync(lambda: ensure_model(cfg.model.path, cfg.model.init_size, seed=cfg.run.seed))
    own_engines, own_judges = not cfg.engine.urls, owns_judges(cfg)
    eval_lock = trio.Lock()
    status = "FAILED"
    try:
        async with trio.open_nursery() as outer:
            outer.start_soon(sup.wait_for_failure)
            outer.start_soon(_stop_on_signal, state)
            policy = await warm_start(sup, outer, cfg, run_dir, state, placement)
            searches = [i for i, s in enumerate(cfg.env_sections) if s.kwargs.get("search_url") == "auto"]
            cfg = plan_config(cfg, run_dir, policy, placement)  # gives each of them a URL
            write_config(cfg, run_dir / "config.toml")
            for k, i in enumerate(searches):  # "search", then "search1", ... when several envs search
                await start_search(sup, outer, cfg.env_sections[i], f"search{k or ''}", run_dir, placement)
            await start_engines(sup, outer, cfg, run_dir, own_engines, placement)
            state.event("engines", f"ready at {', '.join(cfg.engine.urls)}")
            if cfg.judge.enabled:
                await start_judges(sup, outer, cfg, run_dir, own_judges, placement)
                state.event("judges", f"{cfg.judge.model_path} ready at {', '.join(cfg.judge.urls)}")
            if not own_engines:  # weights unknown (another run's?): the evaluation before sees this run's policy
                await trio.to_thread.run_sync(load_policy_into_engines, cfg)
                state.event("engines", f"loaded this run's policy {cfg.model.path} as version 0")
            await _train(sup, outer, cfg, run_dir, state, live_display, eval_lock, placement)
            async with eval_lock:
                state.eval_after = await evaluate_on_newest_policy(cfg, state, "after RL")
            if state.eval_after is not None:
                state.eval_event("after RL", state.eval_after)
            outer.cancel_scope.cancel()
        status = "FINISHED"
    except* (StopSignal, KeyboardInterrupt):
        status = "KILLED"
        raise
    finally:
        summary = summarize(state, cfg, run_dir)
        if summary.get("accounting"):
            print(balance_line(summary["accounting"]), flush=True)
        if cfg.tracking.enabled:  # a stopped or failed run is closed in MLflow with what it saw
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(log_to_mlflow, cfg, run_dir, summary, status)
    return summary


# ------------------------------------------------------------------------------ stages


async def warm_start(
    sup: Supervisor, nursery: trio.Nursery, cfg: AgentRLConfig, run_dir: Path, state: RunState, placement: Placement
) -> str:
    """Run ``agentrl sft`` unless its exported model exists; return the policy path."""
    out = run_dir / "sft" / "model"
    sections = cfg.env_sections
    state.warm_start = {
        "enabled": cfg.sft.enabled,
        "data": cfg.sft.data or f"demonstrations of {', '.join(s.cls for s in sections)}",
        "env_kwargs": dict(sections[0].kwargs) if len(sections) == 1 else [s.kwargs for s in sections],
        "num_demonstrations": cfg.sft.num_demonstrations,
        "max_steps": cfg.sft.max_steps,
        "epochs": cfg.sft.epochs,
    }
    if not cfg.sft.enabled:
        return cfg.model.path
    if (out / "config.json").exists():
        state.event("sft", f"reusing the warm-started model at {out}")
        return str(out)
    data = cfg.model_dump()
    data["run"]["run_dir"] = str(run_dir)
    data["run"]["torch_num_threads"] = max(cfg.run.torch_num_threads, os.cpu_count() or 1)  # SFT runs alone
    data["sft"]["output_dir"] = str(out)
    sft_cfg = write_config(AgentRLConfig.model_validate(data), run_dir / "sft_config.toml")
    spec = ChildSpec(
        "sft",
        agentrl_argv("sft", "--config", str(sft_cfg)),
        run_dir / "logs" / "sft.log",
        env=placement.learner_env(),
        critical=True,
        max_restarts=0,
    )
    await sup.start(nursery, spec)
    async with trio.open_nursery() as follow:
        follow.start_soon(_follow_sft, spec.log_path)
        await sup.wait_finished("sft")
        follow.cancel_scope.cancel()
    if sup.children["sft"].returncode != 0:
        await trio.sleep_forever()  # the supervisor raises ChildFailed
    return str(out)


async def _follow_sft(log_path: Path) -> None:
    """The warm start's progress (its last ``sft step i/n`` log line) every ``PLAIN_LINE_S``, when it moved."""
    said = ""
    while True:
        await trio.sleep(PLAIN_LINE_S)
        line = _last_line_with(log_path, "sft step ")
        if line and line != said:
            said = line
            log.info("sft: %s", line[line.index("sft step ") + 4 :])


def _last_line_with(path: Path, text: str) -> str:
    """The last line of ``path``'s last 64 KiB that contains ``text``, or ""."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line for line in reversed(lines) if text in line), "")


async def start_engines(
    sup: Supervisor, nursery: trio.Nursery, cfg: AgentRLConfig, run_dir: Path, own_engines: bool, placement: Placement
) -> None:
    """The run's own engines (unless ``engine.urls`` names running ones), then wait until each answers."""
    if own_engines:
        for spec in engine_specs(cfg, run_dir, placement):
            await sup.start(nursery, spec)
    for url in cfg.engine.urls:
        await trio.to_thread.run_sync(lambda u=url: wait_ready(u, ENGINES_START_S), abandon_on_cancel=True)


async def start_judges(
    sup: Supervisor, nursery: trio.Nursery, cfg: AgentRLConfig, run_dir: Path, own_judges: bool, placement: Placement
) -> None:
    """The judge engines (unless ``judge.urls`` names running ones), then wait until each answers.
    They are no members of the weight group: the learner pushes to ``engine.urls`` only."""
    if own_judges:
        for spec in judge_specs(cfg, run_dir, placement):
            await sup.start(nursery, spec)
    for url in cfg.judge.urls:
        await trio.to_thread.run_sync(lambda u=url: wait_ready(u, 300.0), abandon_on_cancel=True)


def search_corpus(section: EnvSection) -> str:
    """The env section's ``search_corpus``, or the corpus the env's module ships (``corpus_path()``)."""
    if section.search_corpus:
        return section.search_corpus
    module = _import_module_or_file(section.cls.rsplit(":", 1)[0])
    if not hasattr(module, "corpus_path"):
        raise ValueError(
            "kwargs.search_url = 'auto' needs the env's search_corpus (a JSONL corpus) "
            f"or a corpus_path() in the env's module {section.cls!r}"
        )
    return str(module.corpus_path())


async def start_search(
    sup: Supervisor, nursery: trio.Nursery, section: EnvSection, name: str, run_dir: Path, placement: Placement
) -> None:
    """The retrieval server of a (planned) env section's ``kwargs.search_url``: stateless, so
    restarted on failure."""
    url = section.kwargs["search_url"]
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    argv = agentrl_argv(
        "serve-search",
        "--corpus",
        search_corpus(section),
        "--host",
        host,
        "--port",
        port,
        "--token-env",
        section.search_token_env,
    )
    await sup.start(
        nursery,
        ChildSpec(name, argv, run_dir / "logs" / f"{name}.log", env=placement.cpu_env(), max_restarts=MAX_RESTARTS),
    )
    await trio.to_thread.run_sync(lambda: wait_ready(url, 120.0), abandon_on_cancel=True)


async def _train(
    sup: Supervisor,
    outer: trio.Nursery,
    cfg: AgentRLConfig,
    run_dir: Path,
    state: RunState,
    live_display: bool,
    eval_lock: trio.Lock,
    placement: Placement,
) -> None:
    """The evaluation before, then RL (learner and actors) until the learner finishes."""
    view = live_view(state, cfg, live_display)
    async with trio.open_nursery() as inner:
        # A ``fresh`` learner (never stepped in this folder) holds the warm start (version 0) and pushes
        # nothing before it has data, which only the actors bring: it starts now, and its start-up
        # (imports, model, weight group) overlaps the evaluation before. One resuming from a checkpoint
        # pushes its policy into the engines at once, so it waits until the warm start is evaluated. The
        # actors start up now too (imports, tokenizer, envs) and start no episode before the gate opens. RL
        # starts when the evaluation is done, a fresh learner is up (its first progress) and every actor
        # waits at the gate: what comes before is start-up, as a peer's model loading is.
        fresh = not (run_dir / "learner_metrics.jsonl").exists()
        gate = rl_gate_path(run_dir)
        for old in [gate, *gate.parent.glob(f"{gate.name}.waiting.*")]:
            old.unlink(missing_ok=True)
        if fresh:
            (run_dir / "learner_status.json").unlink(missing_ok=True)  # an earlier attempt's
            await sup.start(inner, learner_spec(cfg, run_dir, placement))
        actors = actor_specs(cfg, run_dir, placement)
        for spec in actors:
            await sup.start(inner, spec)
        state.eval_before = await evaluate_policy(cfg, name_adapter=False)
        state.eval_event("before RL", state.eval_before)
        waiting = [waiting_at_gate_path(gate, spec.name) for spec in actors]
        await until_up([run_dir / "learner_status.json"] * fresh + waiting)
        with view:
            state.rl_started, state.rl_started_at = time.monotonic(), time.time()
            if not fresh:
                await sup.start(inner, learner_spec(cfg, run_dir, placement))
            gate.touch()
            inner.start_soon(watch_progress, cfg, state, run_dir, view, eval_lock)
            await sup.wait_finished("learner")
            state.last_metrics = last_json_line(run_dir / "learner_metrics.jsonl") or state.last_metrics
            state.read_learner_status()
            if state.learner_status.get("stop_message"):  # ended early by itself (e.g. data that cannot fill a batch)
                print(state.event("learner", state.learner_status["stop_message"], logging.WARNING), flush=True)
            inner.cancel_scope.cancel()


async def until_up(markers: list[Path]) -> None:
    """Until every marker file exists: a fresh learner's ``learner_status.json`` (its first progress) and each
    actor's waiting file. A child that dies first is restarted or fails the run (the supervisor), which
    cancels this wait."""
    while not all(m.exists() for m in markers):
        await trio.sleep(START_POLL_S)


async def watch_progress(
    cfg: AgentRLConfig, state: RunState, run_dir: Path, view: LiveView, eval_lock: trio.Lock
) -> None:
    """Follow the learner's progress and metrics; evaluate every ``eval.every_steps`` versions."""
    sub = ProgressSubscriber(cfg.actors.progress_endpoint, bind=False, security=security_from_config(cfg.actors))
    metrics_file = run_dir / "learner_metrics.jsonl"
    next_eval = cfg.eval.every_steps
    try:
        while True:
            with trio.move_on_after(1.0):
                progress = await sub.receive()
                state.see_version(progress.policy_version)
            state.last_metrics = last_json_line(metrics_file) or state.last_metrics
            state.read_learner_status()
            state.read_reward_errors()
            refresh(view, state, cfg)
            version = max(state.versions_seen, default=0)
            if next_eval and version >= next_eval and not eval_lock.locked():
                next_eval = version + cfg.eval.every_steps
                started_at = time.time()
                async with eval_lock:
                    result = await evaluate_on_newest_policy(cfg, state, f"v{version}")
                if result is None:
                    continue
                result["policy_version"] = version
                result["started_at"] = (
                    started_at  # with "seconds": bench/time_to_skill.py leaves evaluations out of RL time
                )
                state.evals.append(result)
                state.eval_event(f"v{version}", result)
    finally:
        with trio.CancelScope(shield=True):
            await sub.aclose()


async def evaluate_on_newest_policy(cfg: AgentRLConfig, state: RunState, when: str) -> dict[str, Any] | None:
    """:func:`evaluate_policy` on the engines that hold the newest policy (all of them behind a
    router, which cannot be asked); ``None``, with an event, when no engine holds one."""
    urls = list(cfg.engine.urls)
    if not cfg.engine.router_url:
        version, urls = await newest_policy_engines(cfg)
        left_out = sorted(set(cfg.engine.urls) - set(urls))
        if version is None:
            state.event("eval", f"{when}: skipped, no engine reports a policy version", logging.ERROR)
            return None
        if left_out:
            state.event(
                "eval",
                f"{when}: on the engines at policy version {version} only; left out "
                f"{', '.join(left_out)} (restarted, or not answering)",
                logging.WARNING,
            )
    return await evaluate_policy(cfg, urls=urls)


# ------------------------------------------------------------------------------ restarts


RESTART_NOTES = {  # what a restart of each kind of child means for the run
    "actor": "its unacknowledged and running groups are abandoned; the same id continues its budget",
    "engine": "back without a weight version: actors wait on it until the learner pushes its policy",
    "judge": "back as it started (never updated); judge calls wait for it, those past judge.timeout_s are reward errors",
    "learner": "restarting (its checkpoint and journal could not be read)",  # see learner_restart_note
}


def learner_restart_note(run_dir: Path) -> str:
    """What a restarted learner will really do, from the run folder: resume from its newest
    checkpoint (which step) or start from the initial weights, how many journal groups it
    replays, and why it died (the last error line of its log)."""
    from agentrl.learner.checkpoint import checkpoint_meta, latest_run_checkpoint

    ckpt = latest_run_checkpoint(run_dir, "learn")
    meta = (checkpoint_meta(ckpt) or {}) if ckpt is not None else {}
    caller = meta.get("caller", {})
    if ckpt is not None:
        lineage, segment = str(caller.get("lineage", "")), caller.get("journal_segment")
        replayed = count_records(run_dir / "journal" / lineage, segment) if lineage and isinstance(segment, int) else 0
        what = (
            f"resumes from its checkpoint at step {meta['step']} ({ckpt}), replays {replayed} journal groups "
            f"received after it and redoes the steps after {meta['step']}"
        )
    else:
        journal = newest_journal(run_dir)
        replayed = count_records(journal) if journal is not None else 0
        what = (
            f"no checkpoint: starts again from the initial weights, redoing every step, and replays "
            f"{replayed} journal groups"
        )
    why = last_error_line(run_dir / "logs" / "learner.log")
    return f"{what}; live actors resend what it had not acknowledged{f'; its last error: {why}' if why else ''}"


def last_error_line(log_path: Path, scan_lines: int = 400) -> str:
    """The last line of a log that names an exception (a traceback's last line) or an ERROR."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()[-scan_lines:]
    except OSError:
        return ""
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line) or " ERROR " in line:
            return line.strip()[:300]
    return ""


def _on_event(state: RunState, name: str, what: str) -> None:
    """The supervisor's events into the run's: a restart is counted per child and said, with what it means."""
    if "; restart " in what:  # the supervisor's "exited with status N; restart i/n"
        state.restarts[name] = state.restarts.get(name, 0) + 1
        note = next((v for k, v in RESTART_NOTES.items() if name.startswith(k)), "")
        if name == "learner":
            with contextlib.suppress(Exception):  # the restart goes on; the fallback note says it could not look
                note = learner_restart_note(state.run_dir)
        line = state.event(name, f"{what}{f' ({note})' if note else ''}", logging.WARNING)
        state.restart_events.append(line)
        print(f"restart: {line}", flush=True)  # the console says so as it happens (above a live table)
        return
    state.event(name, what)
