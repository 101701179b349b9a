"""What ``agentrl run`` tells its user: the run's state, the live view, ``summary.json`` and MLflow.

* :class:`RunState` is what the run has seen so far: events (each also a log line of the
  ``agentrl.run`` logger), policy versions in the order announced, restarts per child, the
  learner's counts (``learner_status.json``) and the reward errors the actors write in their logs
  (each new message said once). It only reads the run folder; the stages fill it in.
* The live view: a rich table when stdout is a terminal (:func:`progress_table`), else one plain
  progress line every ``PLAIN_LINE_S`` (:class:`PlainLines`, :func:`progress_line`).
* :func:`summarize` writes ``summary.json`` whatever happened to the run (finished, stopped or
  failed: with what it saw); :func:`summary_metrics` and :func:`log_to_mlflow` put it in the run's
  MLflow run, each evaluation at the step it describes.

Nothing here starts or stops a process. See docs/run.md.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from rich.live import Live
from rich.markup import escape
from rich.table import Table

from agentrl.actors.metrics import parse_reward_errors
from agentrl.config import AgentRLConfig
from agentrl.episode.evaluation import describe_problems
from agentrl.learner.batching import metric_name
from agentrl.run.accounting import account, final_reports
from agentrl.run.evaluate import eval_metrics
from agentrl.tracking import open_tracker

log = logging.getLogger("agentrl.run")


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
        """Record ``name: what`` with the time (``summary.json`` keeps the last 50), log it and return the line."""
        line = f"{time.strftime('%H:%M:%S')} {name}: {what}"
        self.events.append(line)
        log.log(level, "%s: %s", name, what)
        return line

    def see_version(self, version: int) -> None:
        """A policy version announced by the learner, kept in the order announced, so that summary.json
        shows one going backwards (a learner restarted from an older checkpoint)."""
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
        self.event("eval", f"{when}: success {result['success_rate']:.3f}")
        for line in describe_problems(result):
            self.event("eval", f"{when}: {line}", logging.WARNING)


def last_json_line(path: Path) -> dict[str, Any] | None:
    """The last line of a JSONL file (its last 64 KiB read), or None when there is none yet."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode(errors="replace").strip().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (FileNotFoundError, json.JSONDecodeError, IndexError):
        return None


def progress_table(state: RunState, cfg: AgentRLConfig) -> Table:
    """The live table: step, reward, staleness, throughput, data, evaluations, restarts, one row per env."""
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
    if state.reward_errors:  # escaped: an exception's message may hold [brackets]
        rows.append(("[bold yellow]reward errors", f"[yellow]{escape(_fmt_reward_errors(state.reward_errors))}"))
    if state.data["warning"]:
        rows.append(("[bold yellow]warning", f"[yellow]{state.data['warning']}"))
    for key, value in rows:
        table.add_row(key, value)
    return table


PLAIN_LINE_S = 10.0  # seconds between progress lines when stdout is not a terminal


class PlainLines:
    """The live table's content as one plain log line every ``PLAIN_LINE_S`` (stdout is a file or
    a pipe: a batch job's log, ``tee``), with ``update`` like rich's ``Live``."""

    def __init__(self, state: RunState, cfg: AgentRLConfig):
        self.state, self.cfg, self.last = state, cfg, 0.0

    def __enter__(self) -> PlainLines:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, _table: Any = None) -> None:
        now = time.monotonic()
        if now - self.last >= PLAIN_LINE_S:
            self.last = now
            print(progress_line(self.state, self.cfg), flush=True)


LiveView: TypeAlias = Live | PlainLines  # what the RL stage shows its progress in


def live_view(state: RunState, cfg: AgentRLConfig, live_display: bool) -> LiveView:
    """A terminal gets the live table; a log file or a pipe gets a plain line every ``PLAIN_LINE_S``
    (``--no-live`` too: the table is a terminal's view, the plain line is the same progress)."""
    if live_display and sys.stdout.isatty():
        return Live(progress_table(state, cfg), refresh_per_second=2, transient=False)
    return PlainLines(state, cfg)


def refresh(view: LiveView, state: RunState, cfg: AgentRLConfig) -> None:
    """Show the run's state now: a new table for ``Live``, a plain line when one is due."""
    if isinstance(view, PlainLines):
        view.update()
    else:
        view.update(progress_table(state, cfg))


def progress_line(state: RunState, cfg: AgentRLConfig) -> str:
    """The plain progress line: step, policy version, reward, groups, episodes/s, the learner, warnings."""
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
    state.last_metrics = last_json_line(run_dir / "learner_metrics.jsonl") or state.last_metrics
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
    """The summary's metrics, ``summary.json`` and ``config.toml`` into the run's MLflow run, then closed
    with ``status``."""
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
    if not cfg.tracking.enabled:
        return ""
    tracker = open_tracker(cfg.tracking, run_dir, run_name=cfg.run.name)
    tracker.log_params({"run.run_dir": str(run_dir), "env.cls": ", ".join(s.cls for s in cfg.env_sections)})
    return tracker.run_id or ""  # left RUNNING: the learner and the final summary log to it
