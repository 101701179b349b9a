"""Every algorithm learns, side by side: the quickstart's RL from one fixed warm start for each recipe of
docs/algorithms.md (GRPO, PPO with a critic, RLOO, GSPO, CISPO, Dr. GRPO, REINFORCE++, GRPO with IcePop), each a
real ``agentrl run`` measured as bench/time_to_skill.py measures one (checkpoints every ``--eval-every`` steps,
each evaluated greedily afterwards). Prints, per recipe, greedy success before and after, the RL seconds to
80/85/90%, and the train/inference mismatch the learner measured over the run: mean |log pi_prox - log mu| and the
fraction of loss tokens the corrections masked.

    python bench/algorithms.py [--only grpo,ppo] [--rounds 1] [--eval-every 2] [--warm MODEL] [-s key=value ...]

Recipes run in the order above, alternating over ``--rounds``; ``-s`` applies to every recipe.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from time_to_skill import LEVELS, ROOT, SMOKE, Result, Variant, fmt, measure, report, warm_start

RECIPES = {
    "grpo": [],
    "ppo": ["learner.algorithm=ppo", "learner.advantage=gae"],
    "rloo": ["learner.advantage=rloo"],
    "gspo": [
        "learner.ratio_level=sequence",
        "learner.loss_normalization=sequence",
        "learner.clip_eps_low=3e-4",
        "learner.clip_eps_high=4e-4",
    ],
    "cispo": ["learner.objective=cispo"],
    "dr_grpo": ["learner.loss_normalization=constant"],
    "reinforce_pp": ["learner.advantage=reinforce_pp"],
    "grpo_icepop": [
        "learner.behavior_weight_mode=mask",
        "learner.behavior_weight_floor=0.5",
        "learner.behavior_weight_cap=2.0",
    ],
}
SMOKE_HELP = (
    "every recipe's config is checked, and one recipe (ppo, the critic's path) runs on the smallest sizes "
    "(time_to_skill.py's smoke): checks the path, not the numbers"
)


def mismatch(run_dir: Path) -> tuple[float | None, float | None]:
    """Mean over the run's steps of |log pi_prox - log mu| and of the masked fraction of loss tokens."""
    path = run_dir / "learner_metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def mean(key: str) -> float | None:
        values = [float(r[key]) for r in rows if key in r]
        return sum(values) / len(values) if values else None

    return mean("policy/proximal_logprob_diff"), mean("policy/masked_frac")


def check_recipes(config: Path, common: list[str]) -> None:
    """Every recipe's keys resolve (a typo fails here, before any run)."""
    from agentrl.config import load_config

    for sets in RECIPES.values():
        load_config(config, [*common, *sets])
    print(f"recipes checked: {', '.join(RECIPES)}", flush=True)


def table(results: list[Result], mismatches: dict[tuple[str, int], tuple[float | None, float | None]]) -> None:
    print(
        "\n| recipe | round | before | after | rise | to 80% | to 85% | to 90% | mean abs(log prox - log mu) | masked |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        diff, masked = mismatches[(r.variant, r.round)]
        rise = f"{r.after - r.before:+.1%}" if r.after is not None else "-"
        levels = " | ".join(fmt(r.to_level[lvl]) for lvl in LEVELS)
        print(
            f"| {r.variant} | {r.round} | {fmt(r.before, '%')} | {fmt(r.after, '%')} | {rise} | {levels} | "
            f"{'-' if diff is None else f'{diff:.4f}'} | {'-' if masked is None else f'{masked:.2%}'} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "examples/calculator/config.toml")
    p.add_argument("--only", default="", help="comma-separated recipes (default: all)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=2, help="checkpoint and evaluate every N learner steps")
    p.add_argument("-s", "--set", dest="sets", action="append", default=[], help="override for every recipe")
    p.add_argument("--bench-dir", type=Path, default=None, help="default: runs/bench/algorithms")
    p.add_argument("--warm", type=Path, default=None, help="a model folder to start RL from (default: build the SFT)")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.smoke:  # flags given explicitly still win; -s adds to the smoke's overrides
        p.set_defaults(eval_every=SMOKE["eval_every"], sets=list(SMOKE["sets"]), only="ppo")
        args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind: the finally blocks stop what was started
    names = [n for n in args.only.split(",") if n] or list(RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise SystemExit(f"--only: unknown recipe(s) {', '.join(unknown)}; known: {', '.join(RECIPES)}")
    if args.bench_dir is None:
        args.bench_dir = (
            Path(tempfile.mkdtemp(prefix="agentrl-algos-")) if args.smoke else ROOT / "runs/bench/algorithms"
        )
    config, bench_dir = args.config.resolve(), args.bench_dir.resolve()
    check_recipes(config, args.sets)
    warm = warm_start(config, bench_dir, args.sets, args.warm)
    results, mismatches = [], {}
    for round_ in range(1, args.rounds + 1):
        for name in names:
            started = time.monotonic()
            r = measure(Variant(name, RECIPES[name]), round_, config, warm, bench_dir, args.sets, args.eval_every)
            results.append(r)
            mismatches[(name, round_)] = mismatch(bench_dir / f"{name}-{round_}")
            print(
                f"  done in {time.monotonic() - started:.0f}s: {fmt(r.before, '%')} -> {fmt(r.after, '%')}", flush=True
            )
    report(results)
    table(results, mismatches)


if __name__ == "__main__":
    main()
