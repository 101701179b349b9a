"""Starting ``learn``/``sft`` on one or more ranks.

``agentrl learn --config C --nproc N`` resolves the run folder once (so every rank writes
to the same one), then either runs in this process (N = 1) or starts::

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m agentrl.learner.launch learn --config C --set run.run_dir="..."

and forwards SIGINT/SIGTERM to it. Across machines, run that command yourself on every
node with ``--nnodes M --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST:PORT``
instead of ``--standalone`` (and the same ``run.run_dir`` on a shared file system).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from agentrl.config import AgentRLConfig, load_config

COMMANDS = ("learn", "sft")


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [learner rank {rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )


def run_here(command: str, cfg: AgentRLConfig) -> int:
    """Run ``command`` on this rank; returns a process exit code."""
    from agentrl.learner.distributed import shutdown_distributed

    _setup_logging()
    try:
        if command == "learn":
            from agentrl.learner.loop import learn

            reason = learn(cfg)
            code = 0 if reason in ("done", "stopped") else 3
        elif command == "sft":
            from agentrl.learner.sft import sft

            sft(cfg)
            code = 0
        else:
            raise ValueError(f"unknown command {command!r}")
    finally:
        shutdown_distributed()
    return code


def launch(command: str, config: Path | None, overrides: list[str], nproc: int) -> int:
    """Entry point of the CLI commands: one rank here, or ``nproc`` ranks through torchrun."""
    from agentrl.learner.loop import resolve_run_dir

    cfg = load_config(config, overrides)
    if not cfg.run.run_dir:
        overrides = [*overrides, f'run.run_dir="{resolve_run_dir(cfg)}"']
        cfg = load_config(config, overrides)
    if nproc <= 1:
        return run_here(command, cfg)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    argv += ["-m", "agentrl.learner.launch", command]
    if config is not None:
        argv += ["--config", str(config)]
    for item in overrides:
        argv += ["--set", item]
    proc = subprocess.Popen(argv)

    def forward(signum: int, frame: object) -> None:
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> None:
    """``python -m agentrl.learner.launch {learn,sft} --config C [--set k=v ...]`` (one rank)."""
    parser = argparse.ArgumentParser(prog="agentrl.learner.launch")
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    sys.exit(run_here(args.command, cfg))


if __name__ == "__main__":
    main()
