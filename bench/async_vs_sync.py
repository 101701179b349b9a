"""Asynchronous vs synchronous RL on the same workload, side by side in one run.

Workload: ``bench/latency_env.py`` (heavy-tailed turns and latency), the tiny model and the
processes ``agentrl run`` starts. Both runs do the same learner steps on the same groups per step;
only ``max_staleness`` differs (0: sync, the slowest episode of every batch holds everyone up; 4:
async). Prints per mode the RL wall time, trajectories/s, the learner's idle fraction and the final
reward, and the speed ratio. Target: >= 2.5x with no worse final reward. See docs/performance.md.

    python bench/async_vs_sync.py [--steps 12] [--groups-per-step 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SMOKE = {
    "steps": 2,
    "groups_per_step": 1,
    "group_size": 2,
    "concurrency": 4,
    "sets": [  # short episodes, short waits, a small evaluation
        "env.kwargs.max_turns=2",
        "env.kwargs.latency_median_s=0.05",
        "env.kwargs.max_latency_s=0.2",
        "eval.num_tasks=2",
    ],
}
SMOKE_HELP = "the same code path on the smallest sizes (two short real runs): checks the path, not the numbers"


def run_mode(name: str, staleness: int, args: argparse.Namespace, model: str, workdir: Path) -> dict:
    from agentrl.config import load_config
    from agentrl.run.stages import run

    overrides = [
        f"run.name=bench-{name}",
        "run.torch_num_threads=1",
        f"model.path={model}",
        "env.cls=latency_env:LatencyEnv",
        "env.max_turns=13",
        "env.max_total_tokens=1024",
        "engine.max_context_tokens=1024",
        "engine.max_running_requests=256",
        f"actors.group_size={args.group_size}",
        f"actors.num_concurrent_episodes={args.concurrency}",
        f"actors.max_staleness={staleness}",
        "actors.max_new_tokens_per_turn=8",
        f"learner.max_staleness={staleness}",
        f"learner.max_steps={args.steps}",
        f"learner.groups_per_step={args.groups_per_step}",
        "learner.dynamic_sampling=false",
        "learner.checkpoint_every_steps=0",
        "learner.lr=3e-4",
        "eval.num_tasks=8",
        "tracking.enabled=false",
        *args.sets,
    ]
    cfg = load_config(None, overrides)
    run_dir = workdir / name
    started = time.monotonic()
    summary = run(cfg, run_dir, live_display=False)
    rows = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    wait = sum(r.get("time/wait_data_s", 0.0) for r in rows)
    busy = sum(r.get("time/train_s", 0.0) + r.get("time/weight_push_s", 0.0) for r in rows)
    rl_time = wait + busy
    trajectories = args.steps * args.groups_per_step * args.group_size
    final = [r.get("reward/mean", 0.0) for r in rows[-3:]]
    return {
        "mode": name,
        "rl_wall_s": rl_time,
        "total_wall_s": time.monotonic() - started,
        "trajectories_per_s": trajectories / rl_time,
        "learner_idle_fraction": wait / rl_time,
        "final_reward": sum(final) / len(final),
        "steps": len(rows),
        "staleness_mean": sum(r.get("staleness/mean", 0.0) for r in rows) / len(rows),
        "policy_versions_seen": summary.get("policy_versions_seen"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--model", default="", help="model folder (default: a fresh tiny model)")
    parser.add_argument("-s", "--set", dest="sets", action="append", default=[], help="override for both modes")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke:  # flags given explicitly still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(ROOT / "bench"))
    from agentrl.models.builder import ensure_model

    with tempfile.TemporaryDirectory(prefix="agentrl-async-bench-") as tmp:
        work = Path(tmp)
        model = args.model or str(ensure_model(work / "model", "tiny"))
        results = [run_mode("sync", 0, args, model, work), run_mode("async", 4, args, model, work)]
    print(f"\n{'mode':<6} {'RL wall s':>10} {'traj/s':>8} {'idle':>6} {'final reward':>13} {'staleness':>10}")
    for r in results:
        print(
            f"{r['mode']:<6} {r['rl_wall_s']:>10.1f} {r['trajectories_per_s']:>8.2f} "
            f"{r['learner_idle_fraction']:>6.2f} {r['final_reward']:>13.3f} {r['staleness_mean']:>10.2f}"
        )
    sync, asy = results
    print(
        f"\nspeed ratio async/sync (trajectories/s): {asy['trajectories_per_s'] / sync['trajectories_per_s']:.2f}x "
        f"(target >= 2.5x); final reward async - sync: {asy['final_reward'] - sync['final_reward']:+.3f}"
    )


if __name__ == "__main__":
    main()
