"""``agentrl run CONFIG``: every process a run needs, started and supervised from one command.

Stages, in order, all under one trio nursery (:class:`agentrl.run.supervisor.Supervisor`):

1. **Model.** Build the tiny model at ``model.path`` when it is absent (``model.init_size``).
2. **Warm start** (``sft.enabled``): ``agentrl sft`` on the env's demonstrations, exported to
   ``<run_dir>/sft/model``, which becomes the policy for every later stage. Skipped when that
   folder already exists (a restarted run does not redo it), unless the envs (config or code),
   ``[sft]`` or the base model changed since the folder's last run (``run_fingerprint.json``):
   then the folder's contents move to ``superseded-<time>/`` and the run starts afresh.
3. **Engines.** ``engine.num_engines`` embedded (or SGLang) servers on free ports, unless
   ``engine.urls`` points at servers that already run. A retrieval server (``agentrl
   serve-search``) for each env with ``kwargs.search_url = "auto"``, restarted if it dies.
4. **Evaluation before** RL: greedy episodes on ``eval.num_tasks`` held-out tasks, played by
   this process through the same engines. Engines this run did not start (``engine.urls``)
   first load the run's policy from disk as version 0, whatever they held. A fresh learner starts meanwhile (it pushes nothing
   before the actors bring data), so its start-up is not on the way to the first update.
5. **RL.** ``agentrl learn`` and ``actors.num_processes`` × ``agentrl serve-actors``. Any
   child that dies -- an engine, the learner, an actor -- is restarted (``agentrl.run.process_plan``:
   restart policy), and the run goes on: a restarted engine gets the learner's policy before
   its answers count, the learner resumes from its checkpoint and journal, an actor continues
   its budget. Every restart is an event and counted per child (``summary.json``, the live
   table). While they run, a live table (a plain line every ``PLAIN_LINE_S`` when stdout is not
   a terminal, or with ``--no-live``) shows step, reward, staleness, throughput and the actors'
   reward errors (each new message also an event), and an evaluation runs every
   ``eval.every_steps`` policy versions.
6. **Evaluation after**: the engines now hold the learner's final weights (the learner
   pushes them after its last step); only the engines that report its final version are
   evaluated (an engine restarted after the learner ended holds the warm start). Then
   ``summary.json`` is written and the metrics are logged to the run's MLflow run, which the
   learner logs to as well.

Every child gets the resolved config as a file in the run directory (``config.toml``), with
the ports this run picked, so a child can be restarted by hand with the same command, and
its own GPUs through ``CUDA_VISIBLE_DEVICES`` (``agentrl/run/placement.py``: the learner's ranks
first, then each engine; actors and the retrieval server none). ``--dry-run`` prints the
plan and every child's command; a plan that does not fit the visible GPUs is refused before
anything starts.
Ctrl-C stops everything; a child that keeps failing (past its restarts) stops everything and
exits non-zero, naming the child and quoting the end of its log.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from agentrl.config import AgentRLConfig, EnvSection
from agentrl.run.evaluate import eval_metrics, evaluate_policy, load_policy_into_engines, newest_policy_engines
from agentrl.run.placement import Placement, placement_for, visible_gpus
from agentrl.run.process_plan import (
    MAX_RESTARTS,
    ChildSpec,
    actor_specs,
    agentrl_argv,
    engine_specs,
    learner_spec,
    plan_config,
    write_config,
)
from agentrl.run.supervisor import ChildFailed, Supervisor

log = logging.getLogger("agentrl.run.stages")


@dataclass
class RunState:
    """What the run has seen so far; becomes ``summary.json``."""

    run_dir: Path
    started: float = field(default_factory=time.monotonic)
    eval_before: dict[str, Any] | None = None
    eval_after: dict[str, Any] | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)
    versions_seen: set[int] = field(default_factory=set)
    versions_in_order: list[int] = field(default_factory=list)  # each version announced, in order (no repeats)
    events: list[str] = field(default_factory=list)
    last_metrics: dict[str, Any] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # per child
    restart_events: list[str] = field(default_factory=list)
    warm_start: dict[str, Any] = field(default_factory=dict)
    rl_started: float | None = None  # when the learner and actors were started
    rl_started_at: float | None = None  # the same, as wall-clock time (the learner's metrics rows carry "time")
    # the learner's counts as they happen (learner_status.json), and the last data warning said
    data: dict[str, Any] = field(
        default_factory=lambda: {
            "received": 0,
            "consumed": 0,
            "duplicate": 0,
            "dropped": {},
            "buffered": 0,
            "groups_per_step": 0,
            "waiting_s": 0.0,
            "warning": "",
        }
    )
    warned: str = ""
    # reward errors the actors write in their logs (agentrl.actors.metrics.RewardErrors): the last
    # line of each actor process, by its id; where each log was read up to; the kinds already said
    reward_error_lines: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    log_offsets: dict[str, int] = field(default_factory=dict)
    reward_errors_said: set[tuple[str, str]] = field(default_factory=set)
    learner_status: dict[str, Any] = field(default_factory=dict)  # learner_status.json as last read
    checkpoint_errors: list[str] = field(default_factory=list)  # the learner's failed checkpoint writes, as events

    def event(self, name: str, what: str, level: int = logging.INFO) -> str:
        line = f"{time.strftime('%H:%M:%S')} {name}: {what}"
        self.events.append(line)
        log.log(level, "%s: %s", name, what)
        return line

    def see_version(self, version: int) -> None:
        """A policy version announced by the learner, kept in order: summary.json shows one going
        backwards (a learner restarted from an older checkpoint), which a set hid."""
        self.versions_seen.add(version)
        if not self.versions_in_order or self.versions_in_order[-1] != version:
            self.versions_in_order.append(version)

    @property
    def actor_restarts(self) -> int:
        return sum(n for name, n in self.restarts.items() if name.startswith("actor"))

    def read_learner_status(self) -> None:
        """The learner's ``learner_status.json`` (its counts as they happen, see the learner loop)
        and, once, its data warning as an event."""
        try:
            status = json.loads((self.run_dir / "learner_status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return
        self.learner_status = status
        for key in self.data:
            if key in status:
                self.data[key] = status[key]
        if self.data["warning"] and self.data["warning"] != self.warned:
            self.warned = self.data["warning"]
            self.event("learner", self.data["warning"], logging.WARNING)
        for error in status.get("checkpoint_errors") or []:
            if error not in self.checkpoint_errors:
                self.checkpoint_errors.append(error)
                self.event("learner", error, logging.ERROR)

    def read_reward_errors(self) -> None:
        """New lines of the actors' logs: each actor process's reward-error totals, and an event
        for each (env, message) seen for the first time."""
        from agentrl.actors.metrics import parse_reward_errors

        for path in sorted((self.run_dir / "logs").glob("actor*.log")):
            for line in self._new_lines(path):
                found = parse_reward_errors(line)
                if found is not None:
                    self.reward_error_lines[found["id"]] = found["errors"]
        for e in self.reward_errors:
            if (e["env"], e["error"]) not in self.reward_errors_said:
                self.reward_errors_said.add((e["env"], e["error"]))
                self.event(
                    "actors",
                    f"reward error in env {e['env']}: {e['error']} (episodes scored 0; counted in "
                    "summary.json reward_errors)",
                    logging.WARNING,
                )

    def _new_lines(self, path: Path) -> list[str]:
        """The complete lines appended to ``path`` since the last call."""
        start = self.log_offsets.get(str(path), 0)
        try:
            with path.open("rb") as f:
                f.seek(start)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.log_offsets[str(path)] = start + end
        return data[:end].decode(errors="replace").splitlines()

    @property
    def reward_errors(self) -> list[dict[str, Any]]:
        """``[{env, error, count}]`` over every actor process, the most frequent first."""
        counts: dict[tuple[str, str], int] = {}
        for errors in self.reward_error_lines.values():
            for e in errors:
                counts[(e["env"], e["error"])] = counts.get((e["env"], e["error"]), 0) + e["count"]
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])
        return [{"env": env, "error": error, "count": n} for (env, error), n in ranked]

    def eval_event(self, when: str, result: dict[str, Any]) -> None:
        """The evaluation's success, and in words every problem it met (aborts, reward errors...)."""
        from agentrl.episode.rollout import describe_problems

        self.event("eval", f"{when}: success {result['success_rate']:.3f}")
        for line in describe_problems(result):
            self.event("eval", f"{when}: {line}", logging.WARNING)


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
    from agentrl.engine.launch import wait_ready

    if own_engines:
        for spec in engine_specs(cfg, run_dir, placement):
            await sup.start(nursery, spec)
    for url in cfg.engine.urls:
        await trio.to_thread.run_sync(lambda u=url: wait_ready(u, 300.0), abandon_on_cancel=True)


def search_corpus(section: EnvSection) -> str:
    """The env section's ``search_corpus``, or the corpus the env's module ships (``corpus_path()``)."""
    if section.search_corpus:
        return section.search_corpus
    from agentrl.envs.base import _import_module_or_file

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
    from agentrl.engine.launch import wait_ready

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


async def watch_progress(cfg: AgentRLConfig, state: RunState, run_dir: Path, live: Any, eval_lock: trio.Lock) -> None:
    """Follow the learner's progress and metrics; evaluate every ``eval.every_steps`` versions."""
    from agentrl.transport import ProgressSubscriber, security_from_config

    sub = ProgressSubscriber(cfg.actors.progress_endpoint, bind=False, security=security_from_config(cfg.actors))
    metrics_file = run_dir / "learner_metrics.jsonl"
    next_eval = cfg.eval.every_steps
    try:
        while True:
            with trio.move_on_after(1.0):
                progress = await sub.receive()
                state.see_version(progress.policy_version)
            state.last_metrics = _last_json_line(metrics_file) or state.last_metrics
            state.read_learner_status()
            state.read_reward_errors()
            if live is not None:
                live.update(_table(state, cfg) if not isinstance(live, _PlainLines) else None)
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


def _last_json_line(path: Path) -> dict[str, Any] | None:
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode(errors="replace").strip().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (FileNotFoundError, json.JSONDecodeError, IndexError):
        return None


def _table(state: RunState, cfg: AgentRLConfig) -> Any:
    from rich.table import Table

    m = state.last_metrics
    table = Table(title=f"agentrl run · {state.run_dir}", show_header=False, expand=False)
    elapsed = time.monotonic() - state.started
    rows = [
        ("elapsed", f"{elapsed:,.0f} s"),
        ("step", f"{int(m.get('step', 0))} / {cfg.learner.max_steps}"),
        ("policy version", str(max(state.versions_seen, default=0))),
        ("reward (batch mean)", f"{m.get('reward/mean', float('nan')):.3f}"),
        ("staleness (mean)", f"{m.get('staleness/mean', float('nan')):.2f}"),
        ("train tokens/s", f"{m.get('throughput/train_tokens_per_s', 0.0):,.0f}"),
        ("episodes/s (received)", f"{_episodes_per_s(state, cfg):.1f}"),
        ("groups received / consumed", f"{state.data['received']} / {state.data['consumed']}"),
        ("groups dropped", _fmt_dropped(state.data["dropped"])),
        ("episodes (last step)", _fmt_rollout(m)),
        ("learner", _fmt_learner(state.data)),
        ("eval before", _fmt_eval(state.eval_before)),
        ("last eval", _fmt_eval(state.evals[-1] if state.evals else None)),
        ("restarts", ", ".join(f"{name} {n}" for name, n in sorted(state.restarts.items())) or "-"),
    ]
    rows += _env_rows(state)
    if state.reward_errors:
        from rich.markup import escape  # an exception's message may hold [brackets]

        rows.append(("[bold yellow]reward errors", f"[yellow]{escape(_fmt_reward_errors(state.reward_errors))}"))
    if state.data["warning"]:
        rows.append(("[bold yellow]warning", f"[yellow]{state.data['warning']}"))
    for key, value in rows:
        table.add_row(key, value)
    return table


PLAIN_LINE_S = 10.0  # seconds between progress lines when stdout is not a terminal


class _PlainLines:
    """The live table's content as one plain log line every ``PLAIN_LINE_S`` (stdout is a file or
    a pipe: a batch job's log, ``tee``), with ``update`` like rich's ``Live``."""

    def __init__(self, state: RunState, cfg: AgentRLConfig):
        self.state, self.cfg, self.last = state, cfg, 0.0

    def update(self, _table: Any = None) -> None:
        now = time.monotonic()
        if now - self.last >= PLAIN_LINE_S:
            self.last = now
            print(progress_line(self.state, self.cfg), flush=True)


def progress_line(state: RunState, cfg: AgentRLConfig) -> str:
    m, d = state.last_metrics, state.data
    line = (
        f"[{time.monotonic() - state.started:,.0f} s] step {int(m.get('step', 0))}/{cfg.learner.max_steps} "
        f"| policy v{max(state.versions_seen, default=0)} | reward {m.get('reward/mean', float('nan')):.3f} "
        f"| groups received {d['received']} consumed {d['consumed']} dropped {_fmt_dropped(d['dropped'])} "
        f"| {_episodes_per_s(state, cfg):.1f} episodes/s | learner {_fmt_learner(d)}"
    )
    errors = sum(e["count"] for e in state.reward_errors)
    line += f" | reward errors {errors}" if errors else ""
    return line + (f" | WARNING: {d['warning']}" if d["warning"] else "")


def _fmt_reward_errors(errors: list[dict[str, Any]]) -> str:
    """The count, and the most frequent message (each one is an event when first seen)."""
    top = errors[0]
    kinds = f"{len(errors)} kinds; " if len(errors) > 1 else ""
    return (
        f"{sum(e['count'] for e in errors)} episodes scored 0 ({kinds}most: {top['count']} × env "
        f"{top['env']}: {top['error'][:120]})"
    )


def _fmt_dropped(dropped: dict[str, int]) -> str:
    total = sum(dropped.values())
    if not total:
        return "0"
    return f"{total} (" + ", ".join(f"{reason} {n}" for reason, n in sorted(dropped.items()) if n) + ")"


def _fmt_rollout(m: dict[str, Any]) -> str:
    """The learner's ``rollout/*`` of its last step: what the episodes received looked like."""
    if not m.get("rollout/episodes"):
        return "-"
    return (
        f"{int(m['rollout/episodes'])} received · turns {m['rollout/turns_mean']:.1f} · tool calls "
        f"{m['rollout/tool_calls_mean']:.1f} (errors {m['rollout/tool_errors_per_episode']:.2f}) · truncated "
        f"{m['rollout/truncated_frac']:.0%} · {m['rollout/response_tokens_mean']:.0f} tokens generated"
    )


def _fmt_learner(data: dict[str, Any]) -> str:
    if data["waiting_s"]:
        return f"waiting {data['waiting_s']:.0f} s for data: {data['buffered']} / {data['groups_per_step']} groups"
    return "training" if data["received"] else "starting"


def _env_rows(state: RunState) -> list[tuple[str, str]]:
    """One row per env: its recent reward and success (the learner's ``env/<name>/*``: the last
    episodes received, before dynamic sampling), its groups accepted and dropped, its evaluations."""
    from agentrl.learner.batching import metric_name

    m = state.last_metrics
    names = {k.split("/")[1] for k in m if k.startswith("env/") and k.count("/") == 2}
    evals = {metric_name(env): env for e in (state.eval_before, *state.evals[-1:]) if e for env in e.get("by_env", {})}
    rows = []
    for key in sorted(names | set(evals)):
        parts = []
        if f"env/{key}/reward_recent" in m:
            parts.append(f"reward {m[f'env/{key}/reward_recent']:.3f}")
        if f"env/{key}/success_recent" in m:
            parts.append(f"success {m[f'env/{key}/success_recent']:.1%}")
        dropped = sum(v for k, v in m.items() if k.startswith(f"env/{key}/dropped_"))
        if f"env/{key}/received" in m:
            parts.append(f"groups {int(m.get(f'env/{key}/accepted', 0))} / dropped {int(dropped)}")
        for label, result in (
            ("eval before", state.eval_before),
            ("last eval", state.evals[-1] if state.evals else None),
        ):
            sub = (result or {}).get("by_env", {}).get(evals.get(key, key))
            if sub:
                parts.append(f"{label} {sub['success_rate']:.1%}")
        rows.append((f"env {evals.get(key, key)}", " · ".join(parts) or "-"))
    return rows


def _episodes_per_s(state: RunState, cfg: AgentRLConfig) -> float:
    """Episodes the learner has received (in groups) per second of RL so far."""
    if state.rl_started is None:
        return 0.0
    received = state.data["received"] * cfg.actors.group_size
    return received / max(1e-9, time.monotonic() - state.rl_started)


def _fmt_eval(result: dict[str, Any] | None) -> str:
    if not result:
        return "-"
    return f"success {result['success_rate']:.1%}, reward {result['reward_mean']:.3f} (n={result['n']})"


def summarize(state: RunState, cfg: AgentRLConfig, run_dir: Path) -> dict[str, Any]:
    """``summary.json``, written whatever happened to the run (stopped, failed: with what it saw).
    ``learner_steps`` is the step of the learner's last checkpoint (the weights that survive),
    ``groups_produced`` counts every actor session, killed ones included (``agentrl.run.accounting``)."""
    state.read_learner_status()  # the learner's last counts, also when it never finished a step
    state.read_reward_errors()  # the actors' last lines (a clean stop writes one with its report)
    state.last_metrics = _last_json_line(run_dir / "learner_metrics.jsonl") or state.last_metrics
    m = state.last_metrics
    accounting = _accounting(run_dir) if state.rl_started is not None else None
    status = state.learner_status
    recent = [e["success_rate"] for e in state.evals[-3:]]
    summary = {
        "config": str(run_dir / "config.toml"),
        "warm_start": state.warm_start,
        "eval_before": state.eval_before,
        "eval_after": state.eval_after,
        "success_rise": (
            state.eval_after["success_rate"] - state.eval_before["success_rate"]
            if state.eval_after and state.eval_before
            else None
        ),
        "success_rise_by_env": _rise_by_env(state.eval_before, state.eval_after),
        "evals_during_training": state.evals,
        "eval_recent_mean_success": statistics.fmean(recent) if recent else None,
        "learner_steps": (
            accounting["checkpoint_step"] if accounting and accounting.get("checkpoint") else int(m.get("step", 0))
        ),
        "learner_stop": (
            {"reason": status.get("exit_reason"), "message": status.get("stop_message") or None}
            if status.get("exit_reason")
            else None
        ),
        "checkpoint_errors": state.checkpoint_errors,
        "groups_consumed": state.data["consumed"],
        "groups_received": state.data["received"],
        "groups_dropped": state.data["dropped"],
        "groups_duplicate": state.data["duplicate"],
        "data_warning": state.data["warning"] or None,
        "reward_errors": state.reward_errors,  # [{env, error, count}]: rewards that raised or were not finite
        "groups_produced": _groups_produced(run_dir, accounting),
        "policy_versions_seen": state.versions_in_order,  # in the order announced: a drop is a resume
        "actor_restarts": state.actor_restarts,
        "restarts": dict(sorted(state.restarts.items())),
        "restart_events": state.restart_events,
        "wall_time_s": round(time.monotonic() - state.started, 1),
        "rl_started_at": state.rl_started_at,
        "events": state.events[-50:],
    }
    if accounting is not None:
        summary["accounting"] = accounting
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _rise_by_env(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, float] | None:
    if not (before and after):
        return None
    b, a = before.get("by_env") or {}, after.get("by_env") or {}
    return {env: a[env]["success_rate"] - b[env]["success_rate"] for env in a if env in b}


def _accounting(run_dir: Path) -> dict[str, Any]:
    """Where every group went (``agentrl.run.accounting``); a run folder it cannot read says why."""
    from agentrl.run.accounting import account

    try:
        return account(run_dir)
    except Exception as e:  # the summary is written whatever happened to the run
        return {"balanced": False, "problems": [f"cannot read the run folder's accounting: {type(e).__name__}: {e}"]}


def _groups_produced(run_dir: Path, accounting: dict[str, Any] | None) -> dict[str, int]:
    """What the actors produced: the totals of the final reports of the sessions that ended cleanly,
    plus every killed session's groups (``agentrl.run.accounting``: from the sequence numbers the
    learner received, or the dumps); ``total`` counts every session."""
    totals = _actor_totals(run_dir)
    if not accounting or "sessions" not in accounting:
        return totals
    killed = [s for s in accounting["sessions"] if s["killed"]]
    totals["groups_delivered"] = totals.get("groups_delivered", 0) + sum(s["produced"] for s in killed)
    totals.update(
        {
            "total": accounting["produced"],
            "sessions": accounting["actor_sessions"],
            "sessions_killed": len(killed),
            "of_killed_sessions": sum(s["produced"] for s in killed),
        }
    )
    return totals


def _actor_totals(run_dir: Path) -> dict[str, int]:
    """Sum the final reports the actor processes print (one JSON object per line in their logs)."""
    from agentrl.run.accounting import final_reports

    totals: dict[str, int] = {}
    for report in final_reports(run_dir):
        for key in ("groups_started", "groups_delivered", "groups_lost", "groups_abandoned", "episodes"):
            if isinstance(report.get(key), int):
                totals[key] = totals.get(key, 0) + report[key]
    return totals


def summary_metrics(summary: dict[str, Any]) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) of what the summary adds to MLflow, each at the step it describes:
    ``eval_before/*`` at 0 (the warm start), every evaluation during training as ``eval/*`` at the
    policy version it evaluated, ``eval_after/*``, the rise and the reward errors at the last step."""
    from agentrl.learner.batching import metric_name

    out: list[tuple[int, dict[str, float]]] = []
    if summary.get("eval_before"):
        out.append((0, eval_metrics(summary["eval_before"], "eval_before")))
    for result in summary.get("evals_during_training") or []:
        if isinstance(result.get("policy_version"), int):
            out.append((result["policy_version"], eval_metrics(result, "eval")))
    last: dict[str, float] = eval_metrics(summary["eval_after"], "eval_after") if summary.get("eval_after") else {}
    if summary.get("success_rise") is not None:
        last["eval/success_rise"] = summary["success_rise"]
    for env, rise in (summary.get("success_rise_by_env") or {}).items():
        last[f"eval/env/{metric_name(env)}/success_rise"] = rise
    last["actors/reward_errors"] = sum(e["count"] for e in summary.get("reward_errors") or [])
    out.append((int(summary.get("learner_steps") or 0), last))
    return out


def log_to_mlflow(cfg: AgentRLConfig, run_dir: Path, summary: dict[str, Any], status: str = "FINISHED") -> None:
    from agentrl.tracking import open_tracker

    tracker = open_tracker(cfg.tracking, run_dir, run_name=cfg.run.name, resume_run_id=cfg.tracking.run_id or None)
    try:
        for step, metrics in summary_metrics(summary):
            tracker.log_metrics(metrics, step=step)
        tracker.log_artifact(run_dir / "summary.json")
        if (run_dir / "config.toml").exists():
            tracker.log_artifact(run_dir / "config.toml")
    finally:
        tracker.close(status)


def create_mlflow_run(cfg: AgentRLConfig, run_dir: Path) -> str:
    """Open the run's MLflow run up front so that every process logs to the same one."""
    from agentrl.tracking import open_tracker

    if not cfg.tracking.enabled:
        return ""
    tracker = open_tracker(cfg.tracking, run_dir, run_name=cfg.run.name)
    tracker.log_params({"run.run_dir": str(run_dir), "env.cls": ", ".join(s.cls for s in cfg.env_sections)})
    return tracker.run_id or ""  # left RUNNING: the learner and the final summary log to it


# ------------------------------------------------------------------------------ main


FINGERPRINT_FILE = "run_fingerprint.json"  # what the folder's warm start and learner state come from


def run_fingerprint(cfg: AgentRLConfig) -> dict[str, str]:
    """A hash of each thing a run folder's warm start and learner state were made from: every env
    section, the source file of its class's module (an edited env counts), the ``[sft]`` section
    and the base model."""
    import hashlib

    def digest(value: Any) -> str:
        data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True, default=str).encode()
        return hashlib.sha256(data).hexdigest()[:16]

    parts = {}
    for key, section in cfg._env_keys():
        parts[key] = digest(section.model_dump())
        parts[f"{key} code"] = digest(_module_source(section.cls.rsplit(":", 1)[0]))
    parts["sft"] = digest(cfg.sft.model_dump())
    parts["model"] = digest({"path": cfg.model.path, "init_size": cfg.model.init_size})
    return parts


def _module_source(module: str) -> bytes:
    """The bytes of an env module's file (``path/to/file.py``, or found by import), b"" if none."""
    import importlib.util

    try:
        if module.endswith(".py"):
            return Path(module).read_bytes()
        spec = importlib.util.find_spec(module)
        return Path(spec.origin).read_bytes() if spec is not None and spec.origin else b""
    except (OSError, ImportError, ValueError):
        return b""


def supersede_changed_run(cfg: AgentRLConfig, run_dir: Path) -> str:
    """A run folder whose last run had other envs (config or code), ``[sft]`` or base model: its
    warm start and the learner's state are another policy's, so its contents move to
    ``<run_dir>/superseded-<time>/`` and this run starts afresh, warm start included. Returns
    what happened, in words ("" when nothing changed, or the folder is new or predates
    fingerprints)."""
    try:
        old = json.loads((run_dir / FINGERPRINT_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return ""
    new = run_fingerprint(cfg)
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if not changed:
        return ""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    names = (f"superseded-{stamp}" + (f"-{i}" if i > 1 else "") for i in itertools.count(1))
    archive = next(run_dir / name for name in names if not (run_dir / name).exists())
    archive.mkdir()
    for entry in list(run_dir.iterdir()):
        if not entry.name.startswith("superseded-"):
            entry.rename(archive / entry.name)
    return (
        f"{', '.join(changed)} changed since this folder's last run: its warm start, checkpoints, journal, "
        f"logs and metrics moved to {archive}; this run starts afresh, with a new warm start"
    )


async def run_async(
    cfg: AgentRLConfig, run_dir: Path, *, live_display: bool = True, placement: Placement | None = None
) -> dict[str, Any]:
    from agentrl.models.builder import ensure_model

    placement = placement or placement_for(cfg, visible_gpus())  # refused before anything starts
    superseded = supersede_changed_run(cfg, run_dir)  # before anything is written into the folder
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / FINGERPRINT_FILE).write_text(json.dumps(run_fingerprint(cfg), indent=2))
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
    own_engines = not cfg.engine.urls
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
            from agentrl.run.accounting import balance_line

            print(balance_line(summary["accounting"]), flush=True)
        if cfg.tracking.enabled:  # a stopped or failed run is closed in MLflow with what it saw
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(log_to_mlflow, cfg, run_dir, summary, status)
    return summary


class StopSignal(Exception):
    """SIGTERM or SIGHUP (how SLURM, Kubernetes and systemd stop a job): the run stops exactly as
    on Ctrl-C -- every child stopped, ``summary.json`` written."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


async def _stop_on_signal(state: RunState) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
        async for signum in signals:
            state.event("run", f"{signal.Signals(signum).name} received: stopping every process")
            raise StopSignal(signum)


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
    from contextlib import nullcontext

    from rich.live import Live

    # a terminal gets the live table; a log file or a pipe gets a plain line every PLAIN_LINE_S
    # (--no-live too: the table is a terminal's view, the plain line is the same progress)
    live = (
        Live(_table(state, cfg), refresh_per_second=2, transient=False)
        if live_display and sys.stdout.isatty()
        else _PlainLines(state, cfg)
    )
    async with trio.open_nursery() as inner:
        # A learner that has never stepped in this folder holds the warm start (version 0) and pushes
        # nothing before it has data, which only the actors bring: it starts now, and its start-up
        # (imports, model, weight group) overlaps the evaluation before. One resuming from a checkpoint
        # pushes its policy into the engines at once, so it waits until the warm start is evaluated.
        fresh = not (run_dir / "learner_metrics.jsonl").exists()
        if fresh:
            await sup.start(inner, learner_spec(cfg, run_dir, placement))
        state.eval_before = await evaluate_policy(cfg, name_adapter=False)
        state.eval_event("before RL", state.eval_before)
        with live if isinstance(live, Live) else nullcontext():
            state.rl_started, state.rl_started_at = time.monotonic(), time.time()
            if not fresh:
                await sup.start(inner, learner_spec(cfg, run_dir, placement))
            for spec in actor_specs(cfg, run_dir, placement):
                await sup.start(inner, spec)
            inner.start_soon(watch_progress, cfg, state, run_dir, live, eval_lock)
            await sup.wait_finished("learner")
            state.last_metrics = _last_json_line(run_dir / "learner_metrics.jsonl") or state.last_metrics
            state.read_learner_status()
            if state.learner_status.get("stop_message"):  # ended early by itself (e.g. data that cannot fill a batch)
                print(state.event("learner", state.learner_status["stop_message"], logging.WARNING), flush=True)
            inner.cancel_scope.cancel()


RESTART_NOTES = {  # what a restart of each kind of child means for the run
    "actor": "its unacknowledged and running groups are abandoned; the same id continues its budget",
    "engine": "back without a weight version: actors wait on it until the learner pushes its policy",
    "learner": "restarting (its checkpoint and journal could not be read)",  # see learner_restart_note
}


def learner_restart_note(run_dir: Path) -> str:
    """What a restarted learner will really do, from the run folder: resume from its newest
    checkpoint (which step) or start from the initial weights, how many journal groups it
    replays, and why it died (the last error line of its log)."""
    from agentrl.learner.checkpoint import checkpoint_meta, latest_run_checkpoint
    from agentrl.learner.journal import count_records
    from agentrl.run.accounting import newest_journal

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
    import re

    try:
        lines = log_path.read_text(errors="replace").splitlines()[-scan_lines:]
    except OSError:
        return ""
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line) or " ERROR " in line:
            return line.strip()[:300]
    return ""


def _on_event(state: RunState, name: str, what: str) -> None:
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
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
