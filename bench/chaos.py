"""Chaos: a real ``agentrl run`` of the calculator quickstart during which an actor, an engine and
the learner are each killed with SIGKILL at a random (seeded) learner step; prints the faults
injected and survived, where every trajectory group went, the restarts, and the evaluation before
and after.

    python bench/chaos.py [--seed 0] [--config examples/calculator/config.toml] [--run-dir DIR]
                          [-s section.key=value ...]

Targets: every fault survived, exact accounting (``agentrl.run.accounting``) and greedy success
still rising by at least 30 points. The run gets ``learner.checkpoint_every_steps = 5`` and
``actors.dump_trajectories = true``. ``tests/test_chaos.py`` runs a short version in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STARTED = re.compile(r"agentrl\.run: (\w+): started \(pid (\d+)\)")
CHAOS_OVERRIDES = ["learner.checkpoint_every_steps=5", "actors.dump_trajectories=true"]
VICTIMS = "actor0,engine0,learner"
SMOKE = {
    "victims": "actor0",
    "overrides": [  # no warm start, four one-group steps, a small evaluation
        "sft.enabled=false",
        "learner.max_steps=4",
        "learner.groups_per_step=1",
        "learner.dynamic_sampling=false",
        "actors.group_size=2",
        "actors.num_concurrent_episodes=4",
        "actors.max_new_tokens_per_turn=16",
        "eval.num_tasks=2",
        "tracking.enabled=false",
    ],
}
SMOKE_HELP = (
    "the same code path, smallest: one actor killed in a 4-step run without warm start; "
    "checks survival and accounting, not the rise"
)


@dataclass
class Fault:
    victim: str  # a child's name: actor0, engine0, learner
    at_step: int  # killed once the learner has reached this step
    pid: int = 0
    killed_at_s: float = 0.0  # seconds into the run
    restarted: bool = False


@dataclass
class ChaosRun:
    """One ``agentrl run`` in a child process; its children's pids followed from its log."""

    argv: list[str]
    run_dir: Path
    log_path: Path
    pids: dict[str, list[int]] = field(default_factory=dict)  # every pid each child had, in order
    started: float = field(default_factory=time.monotonic)

    def start(self) -> ChaosRun:
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._follow, daemon=True)
        self.reader.start()
        return self

    def _follow(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.write(line)
            self.log.flush()
            m = STARTED.search(line)
            if m:
                self.pids.setdefault(m.group(1), []).append(int(m.group(2)))

    def learner_step(self) -> int:
        path = self.run_dir / "learner_metrics.jsonl"
        steps = [0]
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError):
                pass  # a line a kill cut short
        return max(steps)

    def wait(self, predicate, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"agentrl run exited ({self.proc.returncode}) while waiting for {what}; see {self.log_path}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}; see {self.log_path}")
            time.sleep(0.2)

    def kill(self, fault: Fault) -> None:
        """SIGKILL the victim's process group (a child and its own children: a node dying)."""
        fault.pid = self.pids[fault.victim][-1]
        os.killpg(fault.pid, signal.SIGKILL)
        fault.killed_at_s = time.monotonic() - self.started

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.reader.join(10)
        self.log.close()


def plan_faults(seed: int, max_steps: int, victims: tuple[str, ...] = ("actor0", "engine0", "learner")) -> list[Fault]:
    """Each victim once, at distinct random steps in [2, max_steps - 2], in a random order."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(2, max(3 + len(victims), max_steps - 1)), len(victims)))
    order = list(victims)
    rng.shuffle(order)
    return [Fault(victim, step) for victim, step in zip(order, steps)]


def run_with_faults(
    config: Path, run_dir: Path, faults: list[Fault], overrides: list[str], timeout_s: float = 3600.0
) -> tuple[int, list[Fault], dict]:
    """Run ``agentrl run`` and inject ``faults`` in order: each waits for its step and for the
    previous victim to have been restarted. Returns the exit status, the faults, summary.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "agentrl", "run", str(config), "--no-live", "--run-dir", str(run_dir)]
    for item in overrides:
        argv += ["-s", item]
    run = ChaosRun(argv, run_dir, run_dir.parent / f"{run_dir.name}.chaos.log").start()
    deadline = time.monotonic() + timeout_s
    try:
        for fault in faults:
            run.wait(
                lambda f=fault: run.learner_step() >= f.at_step and bool(run.pids.get(f.victim)),
                f"step {fault.at_step} to kill {fault.victim}",
                deadline - time.monotonic(),
            )
            known = len(run.pids[fault.victim])
            run.kill(fault)
            run.wait(
                lambda f=fault, k=known: len(run.pids.get(f.victim, [])) > k,
                f"{fault.victim}'s restart",
                deadline - time.monotonic(),
            )
            fault.restarted = True
        run.proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        run.stop()
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return run.proc.returncode, faults, summary


def survived(code: int, faults: list[Fault], summary: dict, max_steps: int) -> list[str]:
    """What went wrong, if anything: a fault not followed by a restart, a run that did not finish."""
    problems = []
    if code != 0:
        problems.append(f"agentrl run exited with status {code}")
    for fault in faults:
        if not fault.restarted or summary.get("restarts", {}).get(fault.victim, 0) < 1:
            problems.append(f"{fault.victim} was not restarted after its kill")
    if summary.get("learner_steps") != max_steps:
        problems.append(f"the learner ended at step {summary.get('learner_steps')}, not {max_steps}")
    return problems


def report(code: int, faults: list[Fault], summary: dict, max_steps: int) -> list[str]:
    from agentrl.run.accounting import describe

    lines = ["faults (SIGKILL, seeded):"]
    for f in faults:
        lines.append(
            f"  {f.victim:<8} at learner step {f.at_step:>2} ({f.killed_at_s:6.1f} s into the run, pid {f.pid}): "
            f"{'restarted' if f.restarted else 'NOT restarted'}"
        )
    problems = survived(code, faults, summary, max_steps)
    lines.append(
        f"faults injected {len(faults)}, survived {sum(f.restarted for f in faults) if not problems else 0}"
        f"{'' if not problems else ': ' + '; '.join(problems)}"
    )
    lines.append(f"restarts: {summary.get('restarts', {})}")
    for event in summary.get("restart_events", []):
        lines.append(f"  {event}")
    lines += describe(summary.get("accounting", {"problems": ["no accounting in summary.json"]}))
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    for name, e in (("before", before), ("after", after)):
        if e:
            groups = ", ".join(f"{k} {v:.1%}" for k, v in sorted(e.get("success_by_group", {}).items()))
            lines.append(f"greedy success {name}: {e['success_rate']:.1%} (n={e['n']}; {groups})")
    if summary.get("success_rise") is not None:
        lines.append(
            f"rise: {100 * summary['success_rise']:+.1f} points; learner steps {summary.get('learner_steps')}, "
            f"wall {summary.get('wall_time_s')} s"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", type=Path, default=ROOT / "examples" / "calculator" / "config.toml")
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("-s", "--set", dest="overrides", action="append", default=[])
    ap.add_argument("--victims", default=VICTIMS, help="children killed, each once (comma-separated)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:  # flags given explicitly still win; -s adds to the smoke's overrides
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind: the finally blocks stop what was started

    from agentrl.config import load_config

    overrides = [*CHAOS_OVERRIDES, *args.overrides]
    cfg = load_config(args.config, overrides)
    run_dir = args.run_dir or ROOT / "runs" / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    faults = plan_faults(args.seed, cfg.learner.max_steps, tuple(args.victims.split(",")))
    print(f"chaos: seed {args.seed}, {args.config}, {overrides}; run folder {run_dir}", flush=True)
    print("planned: " + ", ".join(f"{f.victim} at step {f.at_step}" for f in faults), flush=True)
    code, faults, summary = run_with_faults(args.config, run_dir, faults, overrides)
    lines = report(code, faults, summary, cfg.learner.max_steps)
    print("\n".join(lines))
    ok = not survived(code, faults, summary, cfg.learner.max_steps) and summary.get("accounting", {}).get("balanced")
    if args.smoke:  # a 4-step run without warm start does not learn: the rise is not a target here
        print("smoke: every fault survived, exact accounting" if ok else "smoke: target NOT met")
        sys.exit(0 if ok else 1)
    ok = ok and (summary.get("success_rise") or 0) >= 0.30
    print("target met: every fault survived, exact accounting, rise >= 30 points" if ok else "target NOT met")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
