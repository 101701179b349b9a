"""Peer bench: agentrl against TRL 1.16's GRPOTrainer on the quickstart, as a user choosing between the two would.

    python bench/peer_trl.py [--config examples/calculator/config.toml] [--agentrl-steps 60]
                             [--trl 8x8:200 --trl 16x8:100] [--eval-every 2] [--trl-save-episodes 256]
                             [--venv DIR] [--warm DIR] [-s key=value ...]
    python bench/peer_trl.py --smoke [--model DIR]

TRL runs in its own venv outside the clone (default ~/.cache/agentrl/venv-trl-1.16.0), made when absent with pinned
torch (the CPU wheel), trl, accelerate and datasets, the transformers of this venv, and trio (the one light
dependency of the agentrl modules TRL's side imports); agentrl itself comes from this tree on PYTHONPATH. When the
venv is there its versions are only checked.

Both systems start from one warm start (the config's SFT, built once as bench/time_to_skill.py builds it), train on
the env's training tasks in order with the same tool, reward, chat template and hyper-parameters (beta 0, clip, lr
and its schedule over each run's own steps, temperature, max new tokens per turn; TRL: loss_type "dapo",
scale_rewards "none", no gradient checkpointing, ``max_tool_calling_iterations`` = max_turns - 1). Before TRL
trains, its prompt ids and tool-response ids must equal agentrl's TokenChat's for the same task and tool result
(bench/_peer_trl_trainer.py; it fails naming the first differing position). agentrl is ``agentrl run`` keeping a
checkpoint every ``--eval-every`` steps (time_to_skill.measure); TRL saves every ``--trl-save-episodes`` episodes.
Every checkpoint of both is evaluated afterwards by agentrl's evaluator (greedy, the config's held-out tasks) on one
engine. Clocks exclude model loading and checkpoint saving. Prints, per system: the time to 80/85/90% first reached
and to 90% held in every evaluation after, episodes generated per second, the time to the first update, and TRL's
times over agentrl's per level.

``--smoke`` makes or checks the venv and runs the token-identity check only (on ``--model``, else a fresh tiny
model), printing ``token identity: prompt N ids, tool response M ids, identical``.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from time_to_skill import LEVELS, ROOT, Variant, evaluate_models, fmt, measure, warm_start

TRL, TORCH, ACCELERATE, DATASETS = "1.16.0", "2.13.0", "1.16.0", "5.2.0"
VENV = Path.home() / ".cache" / "agentrl" / f"venv-trl-{TRL}"
TRAINER = ROOT / "bench" / "_peer_trl_trainer.py"
HELD = 0.90  # the level also reported as held in every evaluation after it


@dataclass
class Row:
    name: str
    curve: list[tuple[int, float, float]]  # (optimizer step, training seconds, greedy success)
    first_update_s: float | None
    episodes_per_s: float
    train_s: float

    def first(self, level: float) -> float | None:
        return next((t for _, t, s in self.curve if s >= level), None)

    def held(self, level: float) -> float | None:
        return next((t for i, (_, t, _) in enumerate(self.curve) if all(s >= level for *_, s in self.curve[i:])), None)


# ---------------------------------------------------------------------------------------------- the TRL venv


def pins() -> dict[str, str]:
    from importlib.metadata import version

    return {
        "torch": TORCH,
        "trl": TRL,
        "transformers": version("transformers"),
        "accelerate": ACCELERATE,
        "datasets": DATASETS,
        "trio": version("trio"),
    }


def installed(python: Path, names: list[str]) -> dict[str, str]:
    code = (
        "import json, sys, importlib.metadata as m\n"
        "def v(n):\n    try:\n        return m.version(n)\n    except m.PackageNotFoundError:\n        return ''\n"
        "print(json.dumps({n: v(n) for n in sys.argv[1:]}))"
    )
    out = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def ensure_venv(venv: Path) -> Path:
    """The TRL venv's python: checked when present, made (``python -m venv`` + pinned pip install) when not."""
    python, want = venv / "bin" / "python", pins()
    if python.exists():
        have = installed(python, list(want))
        if all(have[n].split("+")[0] == v for n, v in want.items()):
            print(f"TRL venv {venv}: {', '.join(f'{n} {have[n]}' for n in want)}", flush=True)
            return python
        print(f"TRL venv {venv}: has {have}, wants {want}; installing", flush=True)
    else:
        print(f"making the TRL venv {venv} (pinned: {want}) ...", flush=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    log = venv / "install.log"
    with log.open("w") as out:
        argv = [
            str(python),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            *(f"{n}=={v}" for n, v in want.items()),
        ]
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"pip install in {venv} failed with status {code}; its log: {log}")
    return python


# ----------------------------------------------------------------------------------- agentrl's side of the check


def agentrl_reference(cfg: Any, model: Path) -> dict[str, Any]:
    """agentrl's prompt ids and tool-response ids (TokenChat, as an episode builds them) for the first training task
    and a model turn that sends its whole expression to the calculator, with the tool message the ToolBox gives."""
    import trio
    from transformers import AutoTokenizer

    from agentrl.envs import make_env
    from agentrl.episode.chat import TokenChat, codec_for
    from agentrl.episode.rollout import toolbox_for
    from agentrl.tools.base import ToolCall
    from agentrl.tools.parsing import HermesToolCallParser

    env = make_env(cfg)
    toolbox, task = toolbox_for(env, cfg), next(iter(env.tasks("train", cfg.run.seed)))
    codec, tools = codec_for(AutoTokenizer.from_pretrained(model)), toolbox.schemas()
    messages = env.initial_messages(task)
    chat = TokenChat.start(codec, messages, tools)
    prompt_ids = list(chat.tokens)
    call = {"name": "calculator", "arguments": {"expression": task.data["expression"]}}
    turn = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
    turn_ids = codec.encode(codec.assistant_text(turn, tools))
    chat.append_model(turn_ids, [0.0] * len(turn_ids), [0] * len(turn_ids))
    parsed = HermesToolCallParser().parse(chat.turn_content())
    assert [(c.name, c.arguments) for c in parsed.calls] == [(call["name"], call["arguments"])], parsed
    result = trio.run(toolbox.execute, ToolCall(call["name"], call["arguments"]))
    tool_message = {"role": "tool", "name": result.name, "content": result.content}
    start = len(chat.tokens)
    chat.close_turn_and_add([tool_message])
    return {
        "prompt_messages": messages,
        "prompt_ids": prompt_ids,
        "tool_schemas": tools,
        "tool_call": call,
        "turn_ids": turn_ids,
        "tool_message": tool_message,
        "tool_ids": chat.tokens[start:],
    }


def trl_spec(cfg: Any, model: Path, out_dir: Path, reference: dict[str, Any], **run: Any) -> dict[str, Any]:
    """What the TRL side needs from agentrl's config; refuses settings it does not mirror."""
    from agentrl.learner.trainer import lr_factor

    lrn, act = cfg.learner, cfg.actors
    mirrored = {
        "learner.algorithm": (lrn.algorithm, "grpo"),
        "learner.warmup_steps": (lrn.warmup_steps, 0),
        "learner.kl_coef": (lrn.kl_coef, 0.0),
        "learner.normalize_advantage_std": (lrn.normalize_advantage_std, False),
        "learner.loss_normalization": (lrn.loss_normalization, "token"),
        "learner.lora.rank": (lrn.lora.rank, 0),
    }
    if bad := {k: v for k, (v, want) in mirrored.items() if v != want}:
        sys.exit(
            f"the TRL side mirrors GRPO with { ({k: w for k, (_, w) in mirrored.items()}) }; this config has {bad}"
        )
    return {
        "model": str(model),
        "out_dir": str(out_dir),
        "env_cls": cfg.env.cls,
        "env_kwargs": dict(cfg.env.kwargs),
        "seed": cfg.run.seed,
        "max_turns": cfg.env.max_turns,
        "max_total_tokens": cfg.env.max_total_tokens,
        "max_new_tokens_per_turn": act.max_new_tokens_per_turn,
        "group_size": act.group_size,
        "temperature": act.temperature,
        "top_p": act.top_p,
        "top_k": act.top_k,
        "lr": lrn.lr,
        # agentrl's schedule over this run's own steps, one factor a step (TRL's "constant" scheduler follows them)
        "lr_factors": [
            lr_factor(
                step,
                warmup_steps=0,
                total_steps=lrn.lr_decay_steps or run["max_steps"],
                schedule=lrn.lr_schedule,
                min_ratio=lrn.min_lr_ratio,
            )
            for step in range(run["max_steps"])
        ],
        "weight_decay": lrn.weight_decay,
        "grad_clip": lrn.grad_clip,
        "clip_low": lrn.clip_eps_low,
        "clip_high": lrn.clip_eps_high,
        "reference": reference,
        **run,
    }


def run_trainer(python: Path, spec: dict[str, Any], log: Path | None) -> dict[str, Any]:
    """bench/_peer_trl_trainer.py in the TRL venv (output to ``log``, else here); its trl_result.json."""
    out = Path(spec["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    sink = log.open("w") if log is not None else None
    proc = subprocess.Popen(
        [str(python), str(TRAINER), str(out / "spec.json")],
        cwd=ROOT,
        stdout=sink,
        stderr=subprocess.STDOUT if sink else None,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"},
    )
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:  # this bench was stopped
            proc.terminate()
            proc.wait(60)
        if sink is not None:
            sink.close()
    result = json.loads(r.read_text()) if (r := out / "trl_result.json").exists() else {}
    if problems := result.get("check", {}).get("problems"):
        sys.exit("token identity: FAILED, TRL's tokens are not agentrl's:\n  " + "\n  ".join(problems))
    if code != 0:
        sys.exit(f"the TRL trainer failed with status {code}" + (f"; its log: {log}" if log else ""))
    return result


# -------------------------------------------------------------------------------------------------- evaluation


def trl_row(name: str, result: dict[str, Any], success: dict[int, float]) -> Row:
    times = {int(s["step"]): float(s["t"]) for s in result["steps"]}
    curve = [(step, times[step], rate) for step, rate in sorted(success.items())]
    train_s = max(times.values(), default=0.0)
    return Row(name, curve, times.get(1), result["episodes"] / max(train_s, 1e-9), train_s)


def trl_system(python: Path, spec: dict[str, Any], config: Path, sets: list[str]) -> Row:
    """One TRL run from scratch, then its checkpoints evaluated."""
    out = Path(spec["out_dir"])
    name = f"TRL {spec['prompts']}x{spec['group_size']}"
    shutil.rmtree(out, ignore_errors=True)
    print(f"[{name}] {spec['max_steps']} steps, a checkpoint every {spec['save_every']} (log: {out}.log)", flush=True)
    result = run_trainer(python, spec, out.with_suffix(".log"))
    models = [(s, out / f"checkpoint-{s}") for s in result["saves"]]
    row = trl_row(name, result, evaluate_models(config, Path(spec["model"]), models, sets, out / "bench_engine.log"))
    print(f"  {name}: to 80/85/90% {', '.join(fmt(row.first(lvl)) for lvl in LEVELS)}; {load()}", flush=True)
    return row


# ----------------------------------------------------------------------------------------------------- report


def report(rows: list[Row], before: float) -> None:
    lines: list[tuple[str, list[str]]] = [
        *((f"{lvl:.0%} greedy success first reached", [fmt(r.first(lvl), ".1f") for r in rows]) for lvl in LEVELS),
        (f"{HELD:.0%}, held in the evaluations after", [fmt(r.held(HELD), ".1f") for r in rows]),
        ("episodes generated per second", [f"{r.episodes_per_s:.0f}" for r in rows]),
        ("first update after training starts", [fmt(r.first_update_s, ".1f") for r in rows]),
        ("training wall time (checkpoints left out)", [fmt(r.train_s) for r in rows]),
        ("greedy success at the last checkpoint", [fmt(r.curve[-1][2] if r.curve else None, "%") for r in rows]),
    ]
    print(f"\ngreedy success of the warm start: {before:.1%}")
    print("\n| level | " + " | ".join(r.name for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for label, cells in lines:
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\ncurves (step: seconds, greedy success):")
    for r in rows:
        print(f"  {r.name}: " + ", ".join(f"{v}: {t:.0f}s {s:.1%}" for v, t, s in r.curve))
    base = rows[0]
    print(f"\n{' / '.join(r.name for r in rows[1:])} over {base.name}, time to each level (> 1: {base.name} sooner):")
    measures = [
        *((f"{lvl:.0%}", lambda r, lvl=lvl: r.first(lvl)) for lvl in LEVELS),
        ("90% held", lambda r: r.held(HELD)),
    ]
    for label, at in measures:
        cells = [f"{b / a:.2f}x" if (a := at(base)) and (b := at(r)) else "-" for r in rows[1:]]
        print(f"  {label}: {', '.join(cells)}")


# ------------------------------------------------------------------------------------------------------- main


def load() -> str:
    """The machine's load averages: a shared machine slows both systems, TRL's two-thread steps the most."""
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"


def parse_trl(text: str) -> tuple[int, int, int]:
    """``PROMPTSxGROUP:STEPS``; the group must be the config's ``actors.group_size`` (main checks)."""
    shape, _, steps = text.partition(":")
    prompts, _, group = shape.partition("x")
    if not (prompts.isdigit() and group.isdigit() and steps.isdigit()):
        raise argparse.ArgumentTypeError(f"--trl {text!r}: expected PROMPTSxGROUP:STEPS, e.g. 8x8:200")
    return int(prompts), int(group), int(steps)


def smoke(args: argparse.Namespace, python: Path, cfg: Any) -> None:
    with tempfile.TemporaryDirectory(prefix="agentrl-peer-trl-") as tmp:
        work, model = Path(tmp), args.model
        if model is None:
            from agentrl.models.builder import init_model

            model = init_model(work / "tiny", "tiny", seed=0)
        reference = agentrl_reference(cfg, model)
        spec = trl_spec(cfg, model, work / "check", reference, prompts=1, max_steps=1, save_every=1, check_only=True)
        run_trainer(python, spec, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "examples/calculator/config.toml")
    p.add_argument("--agentrl-steps", type=int, default=60, help="learner steps of agentrl's run")
    p.add_argument("--eval-every", type=int, default=2, help="agentrl: checkpoint and evaluate every N learner steps")
    p.add_argument("--trl", type=parse_trl, action="append", default=None, help="PROMPTSxGROUP:STEPS, repeatable")
    p.add_argument("--trl-save-episodes", type=int, default=256, help="TRL: save and evaluate every N episodes")
    p.add_argument("-s", "--set", dest="sets", action="append", default=[], help="config override for both")
    p.add_argument("--bench-dir", type=Path, default=ROOT / "runs/bench/peer_trl")
    p.add_argument("--warm", type=Path, default=None, help="a model folder to start RL from (default: build the SFT)")
    p.add_argument("--venv", type=Path, default=VENV, help="the TRL venv (made when absent)")
    p.add_argument("--model", type=Path, default=None, help="--smoke: the model whose tokenizer is checked")
    p.add_argument("--smoke", action="store_true", help="make/check the venv and check the token identity only")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind: the finally blocks stop what was started
    started = time.monotonic()
    from agentrl.config import load_config

    config = args.config.resolve()
    cfg = load_config(config, args.sets)
    python = ensure_venv(args.venv)
    print(load(), flush=True)
    if args.smoke:
        smoke(args, python, cfg)
        return
    group = cfg.actors.group_size
    runs = args.trl or [(8, group, 200), (16, group, 100)]
    if bad := [f"{p}x{g}" for p, g, _ in runs if g != group]:
        sys.exit(f"--trl {', '.join(bad)}: the group must be the config's actors.group_size = {group}")
    bench_dir = args.bench_dir.resolve()
    warm = warm_start(config, bench_dir, args.sets, args.warm)
    reference = agentrl_reference(cfg, warm)
    run_trainer(python, trl_spec(cfg, warm, bench_dir / "check", reference, prompts=1, max_steps=1, save_every=1,
                                 check_only=True), None)  # fmt: skip
    agentrl = measure(
        Variant("agentrl", [f"learner.max_steps={args.agentrl_steps}"]), 1, config, warm, bench_dir, args.sets,
        args.eval_every,
    )  # fmt: skip
    rows = [Row("agentrl", agentrl.curve, agentrl.first_update_s, agentrl.episodes_per_s, agentrl.rl_s)]
    print(f"  agentrl: to 80/85/90% {', '.join(fmt(agentrl.to_level[lvl]) for lvl in LEVELS)}; {load()}", flush=True)
    for prompts, _, steps in runs:
        save_every = max(1, args.trl_save_episodes // (prompts * group))
        spec = trl_spec(cfg, warm, bench_dir / f"trl-{prompts}x{group}", reference, prompts=prompts, max_steps=steps,
                        save_every=save_every, check_only=False)  # fmt: skip
        rows.append(trl_system(python, spec, config, args.sets))
    report(rows, agentrl.before)
    print(f"\nbench wall time {time.monotonic() - started:.0f}s; {load()}")


if __name__ == "__main__":
    main()
