"""Time to skill: the quickstart's RL phase from one fixed warm start, its policy evaluated
greedily on the held-out tasks every few learner steps; prints the RL wall time to 80, 85 and
90% greedy success, episodes per second, the time to the first learner update and when the actors
first heard the learner (before it: their process's start-up), for one or more variants side by
side (alternating, ``--rounds`` times).

    python bench/time_to_skill.py [--config examples/calculator/config.toml] [--rounds 1]
                                  [--eval-every 2] [--variant NAME=key=value,key=value ...]
                                  [-s key=value ...]

The warm start is built once with ``agentrl sft`` and copied into every run. Each run is a real
``agentrl run`` without evaluations during RL; the learner keeps a checkpoint every
``--eval-every`` steps, and each is exported and evaluated afterwards on one engine. RL time of a
step is when the learner logged it since RL started (the actors' start gate opened), less the checkpoints' own time.
``--variant base=learner.groups_per_step=16`` runs the config with those overrides; ``-s``
applies to every variant. ``--variant before@/path/to/tree=`` runs ``agentrl run`` from another source
tree (e.g. ``git archive HEAD | tar -x -C /tmp/before``): code changes side by side, evaluated alike by this
tree. One evaluation moves by a few points between steps: repeat rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEVELS = (0.80, 0.85, 0.90)
SMOKE = {
    "eval_every": 2,
    "sets": [  # a 2-step SFT, a 2-step run of one-group steps, evaluations of 2 tasks
        "sft.num_demonstrations=32",
        "sft.max_steps=2",
        "sft.warmup_steps=0",
        "learner.max_steps=2",
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
    "the same code path on the smallest sizes (a 2-step SFT and RL run, one checkpoint evaluated, in a temp "
    "folder unless --bench-dir): checks the path, not the numbers"
)


@dataclass
class Variant:
    name: str
    overrides: list[str]
    tree: Path = ROOT  # the source tree agentrl run runs from


@dataclass
class Result:
    variant: str
    round: int
    rl_s: float  # RL time of the learner's last step (checkpoints left out)
    first_update_s: float | None
    actors_ready_s: float | None  # when the first actor heard the learner (its process started at 0)
    episodes_per_s: float
    to_level: dict[float, float | None]
    before: float
    after: float | None
    curve: list[tuple[int, float, float]]  # (learner step, RL seconds, greedy success)


def agentrl(*args: str, log: Path, tree: Path = ROOT) -> None:
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentrl", *args],
            cwd=tree,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(tree)},
        )
        try:
            code = proc.wait()
        finally:
            if proc.poll() is None:  # this bench was stopped: the run stops its children on SIGTERM
                proc.terminate()
                proc.wait(120)
    if code != 0:
        sys.exit(f"agentrl {args[0]} failed with status {code}; its log: {log}")


def warm_start(config: Path, bench_dir: Path, overrides: list[str], given: Path | None = None) -> Path:
    """The config's SFT warm start, built once (both cores, as ``agentrl run`` gives SFT), or ``given``."""
    if given is not None:
        return given
    warm = bench_dir / "warm"
    if not (warm / "config.json").exists():
        bench_dir.mkdir(parents=True, exist_ok=True)
        print(f"building the warm start in {warm} (the config's SFT) ...", flush=True)
        sets = [
            *overrides,
            f"sft.output_dir={warm}",
            f"run.run_dir={bench_dir / 'warm_run'}",
            f"run.torch_num_threads={os.cpu_count() or 1}",
        ]
        agentrl("sft", "--config", str(config), *[a for s in sets for a in ("-s", s)], log=bench_dir / "warm.log")
    return warm


def rl_seconds(summary: dict, rows: list[dict]) -> dict[int, float]:
    """Each learner step's RL time, checkpoints written so far left out."""
    times, spent = {}, 0.0
    for row in sorted(rows, key=lambda r: r["step"]):
        spent += float(row.get("time/checkpoint_s", 0.0))
        times[int(row["step"])] = row["time"] - summary["rl_started_at"] - spent
    return times


def actors_ready(run_dir: Path, rl_started_at: float) -> float | None:
    """RL seconds at which an actor first heard the learner (its log's "learner seen" line): what
    comes before is the actor process's start-up, what comes after is the learner's and the data's."""
    import datetime

    seen = []
    for log in (run_dir / "logs").glob("actor*.log"):
        line = next((x for x in log.read_text(errors="replace").splitlines() if "learner seen" in x), "")
        try:
            when = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        seen.append(when - rl_started_at)
    return min(seen, default=None)


def evaluate_checkpoints(config: Path, run_dir: Path, sets: list[str]) -> dict[int, float]:
    """Greedy success of every checkpoint of the run (each exported to a model folder, then removed)."""
    from agentrl.learner.checkpoint import checkpoint_meta, checkpoint_root
    from agentrl.learner.export import export_checkpoint

    found = sorted(
        (meta["step"], p)
        for p in checkpoint_root(run_dir, "learn").glob("step_*")
        if (meta := checkpoint_meta(p)) is not None
    )

    def exported() -> Iterator[tuple[int, Path]]:
        for step, path in found:
            model = export_checkpoint(path, run_dir / "bench_export" / path.name)
            yield step, model
            shutil.rmtree(model, ignore_errors=True)

    return evaluate_models(config, run_dir / "sft" / "model", exported(), sets, run_dir / "bench_engine.log")


def evaluate_models(
    config: Path, base: Path, models: Iterable[tuple[int, Path]], sets: list[str], log: Path
) -> dict[int, float]:
    """Greedy success of each ``(step, model folder)``, by agentrl's evaluator on one embedded engine started
    from ``base`` that loads each folder in turn (``/update_weights_from_disk``)."""
    import httpx
    import transformers
    import trio

    from agentrl.config import load_config
    from agentrl.engine.launch import EngineProcess, engine_args
    from agentrl.net import free_port
    from agentrl.run.evaluate import evaluate_policy

    transformers.utils.logging.disable_progress_bar()  # one "Writing model shards" bar per export otherwise
    cfg = load_config(config, [*sets, f"model.path={base}", "tracking.enabled=false"])
    extra = engine_args(
        "embedded",
        device="cpu",
        max_running_requests=cfg.engine.max_running_requests,
        max_context_tokens=cfg.engine.max_context_tokens,
        num_threads=cfg.run.torch_num_threads,
    )
    engine = EngineProcess(cfg.model.path, free_port(), extra=extra, log_path=log).start()
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"urls": [engine.url]})})
    success = {}
    try:
        for step, model in models:
            r = httpx.post(
                f"{engine.url}/update_weights_from_disk",
                timeout=120,
                json={"model_path": str(model), "weight_version": str(step)},
            )
            r.raise_for_status()
            success[step] = float(trio.run(evaluate_policy, cfg)["success_rate"])
    finally:
        engine.stop()
    return success


def measure(
    variant: Variant, round_: int, config: Path, warm: Path, bench_dir: Path, common: list[str], eval_every: int
) -> Result:
    run_dir = bench_dir / f"{variant.name}-{round_}"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(warm, run_dir / "sft" / "model")
    sets = [*common, *variant.overrides]
    print(f"[{variant.name} round {round_}] agentrl run {config} {' '.join(variant.overrides)}", flush=True)
    bench_sets = [
        *sets,
        "eval.every_steps=0",
        f"learner.checkpoint_every_steps={eval_every}",
        "learner.keep_checkpoints=100000",
    ]
    agentrl(
        "run",
        str(config),
        "--run-dir",
        str(run_dir),
        "--no-live",
        *[a for s in bench_sets for a in ("-s", s)],
        log=run_dir.with_suffix(".log"),
        tree=variant.tree,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    times = rl_seconds(summary, rows)
    success = evaluate_checkpoints(config, run_dir, sets)
    curve = [(step, times[step], rate) for step, rate in sorted(success.items()) if step in times]
    to_level = {lvl: next((t for _, t, s in curve if s >= lvl), None) for lvl in LEVELS}
    rl_s = max(times.values(), default=0.0)
    from agentrl.config import load_config

    group_size = load_config(config, sets).actors.group_size
    received = summary.get("groups_received") or 0
    after = summary["eval_after"]["success_rate"] if summary.get("eval_after") else None
    return Result(
        variant.name,
        round_,
        rl_s,
        min(times.values(), default=None),
        actors_ready(run_dir, summary["rl_started_at"]),
        received * group_size / max(rl_s, 1e-9),
        to_level,
        summary["eval_before"]["success_rate"],
        after,
        curve,
    )


def fmt(x: float | None, unit: str = "s") -> str:
    """Seconds (``s``: whole, ``.1f``: tenths) or a percentage (``%``); ``-`` for none."""
    if x is None:
        return "-"
    return f"{x:.0f}s" if unit == "s" else f"{x:.1f}s" if unit == ".1f" else f"{x:.1%}"


def report(results: list[Result]) -> None:
    print(
        "\n| variant | round | before | after | to 80% | to 85% | to 90% | first update | actors ready | RL s "
        "| episodes/s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        lv = [fmt(r.to_level[lvl]) for lvl in LEVELS]
        print(
            f"| {r.variant} | {r.round} | {fmt(r.before, '%')} | {fmt(r.after, '%')} | {' | '.join(lv)} | "
            f"{fmt(r.first_update_s, '.1f')} | {fmt(r.actors_ready_s, '.1f')} | {r.rl_s:.0f} | {r.episodes_per_s:.1f} |"
        )
    print("\ncurves (learner step: RL seconds, greedy success):")
    for r in results:
        print(f"  {r.variant} #{r.round}: " + ", ".join(f"{v}: {t:.0f}s {s:.1%}" for v, t, s in r.curve))
    names = list(dict.fromkeys(r.variant for r in results))
    if len(names) > 1:
        base = names[0]
        print(f"\nratios against {base} (its time / the variant's, per round; > 1 is faster):")
        for name in names[1:]:
            for lvl in LEVELS:
                pairs = [
                    (a.to_level[lvl], b.to_level[lvl])
                    for a in results
                    if a.variant == base
                    for b in results
                    if b.variant == name and b.round == a.round
                ]
                cells = [f"{a / b:.2f}x" if a and b else "-" for a, b in pairs]
                print(f"  {name} to {lvl:.0%}: {', '.join(cells)}")


def parse_variant(text: str) -> Variant:
    name, _, sets = text.partition("=")
    name, at, tree = name.partition("@")
    if not name or not _ or (at and not (Path(tree) / "agentrl").is_dir()):
        raise SystemExit(
            f"--variant {text!r}: expected NAME=key=value,key=value (or NAME= for none), or NAME@TREE=... with "
            "TREE a source tree of agentrl"
        )
    return Variant(name, [s for s in sets.split(",") if s], Path(tree).resolve() if at else ROOT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "examples/calculator/config.toml")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=2, help="checkpoint and evaluate every N learner steps")
    p.add_argument("--variant", action="append", type=parse_variant, default=[])
    p.add_argument("-s", "--set", dest="sets", action="append", default=[], help="override for every variant")
    p.add_argument("--bench-dir", type=Path, default=None, help="default: runs/bench/time_to_skill")
    p.add_argument("--warm", type=Path, default=None, help="a model folder to start RL from (default: build the SFT)")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.smoke:  # flags given explicitly still win; -s adds to the smoke's overrides
        p.set_defaults(**SMOKE)
        args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind: the finally blocks stop what was started
    if args.bench_dir is None:
        args.bench_dir = (
            Path(tempfile.mkdtemp(prefix="agentrl-tts-")) if args.smoke else ROOT / "runs/bench/time_to_skill"
        )
    variants = args.variant or [Variant("default", [])]
    warm = warm_start(args.config.resolve(), args.bench_dir.resolve(), args.sets, args.warm)
    results = []
    for round_ in range(1, args.rounds + 1):
        for v in variants:
            started = time.monotonic()
            results.append(
                measure(v, round_, args.config.resolve(), warm, args.bench_dir.resolve(), args.sets, args.eval_every)
            )
            r = results[-1]
            print(
                f"  done in {time.monotonic() - started:.0f}s: to 80/85/90% "
                f"{', '.join(fmt(r.to_level[lvl]) for lvl in LEVELS)}; first update {fmt(r.first_update_s, '.1f')} "
                f"(actors ready {fmt(r.actors_ready_s, '.1f')})",
                flush=True,
            )
    report(results)


if __name__ == "__main__":
    main()
