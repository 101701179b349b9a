"""Starting ``learn``/``sft`` on one or more ranks, on one or several machines.

``agentrl learn --config C --nproc N`` resolves the run folder once (every rank writes to the same
one), then runs in this process (N = 1) or starts ``python -m torch.distributed.run
--standalone --nproc-per-node N -m agentrl.learner.launch ...`` and forwards SIGINT/SIGTERM to it.
Several machines: the same command on every node with ``--nnodes``/``--rdzv-endpoint`` (torchrun's
c10d rendezvous) and ``run.run_dir`` on a shared file system. c10d numbers nodes by their sorted
address, so every node needs ``--local-addr`` and the config must point at the node that sorts
first; rank 0 checks that ``learner.weight_sync_address`` and the endpoints are its own and fails
otherwise. See docs/run.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
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
    for noisy in ("httpx", "httpcore"):  # one INFO line per request: GET /model_info every ENGINE_CHECK_S
        logging.getLogger(noisy).setLevel(logging.WARNING)


@dataclass(frozen=True)
class Nodes:
    """The machines a learner spans: one (``--standalone``) or ``nnodes`` joined by c10d rendezvous."""

    nnodes: int = 1
    rdzv_endpoint: str = ""  # HOST:PORT every node reaches (several nodes)
    rdzv_id: str = "agentrl"  # the same on every node of one job
    local_addr: str = ""  # this node's address as the others reach it; orders the nodes' ranks

    def torchrun_flags(self) -> list[str]:
        if self.nnodes == 1:
            return ["--standalone"]
        if not self.rdzv_endpoint:
            raise ValueError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
        flags = [
            "--nnodes",
            str(self.nnodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            self.rdzv_endpoint,
            "--rdzv-id",
            self.rdzv_id,
        ]
        return flags + (["--local-addr", self.local_addr] if self.local_addr else [])


def _is_local_address(host: str) -> bool:
    """Whether ``host`` (a name or an address) names this machine: some address it resolves to can be bound."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((sockaddr[0], 0))
                return True
            except OSError:
                continue
    return False


def check_rank0_addresses(cfg: AgentRLConfig) -> None:
    """Rank 0 serves actors and engines: the addresses they are given must be this machine's."""
    named = [
        (f"actors.{key}", getattr(cfg.actors, key).removeprefix("tcp://").rsplit(":", 1)[0])
        for key in ("trajectory_endpoint", "progress_endpoint")
        if getattr(cfg.actors, key).startswith("tcp://")
    ]
    if cfg.engine.urls:
        named.append(("learner.weight_sync_address", cfg.learner.weight_sync_address))
    for key, host in named:
        if host in ("*", "0.0.0.0", "[::]", "::") or _is_local_address(host):
            continue
        raise ValueError(
            f"learner rank 0 runs on {socket.gethostname()}, but {key} points at {host!r}, which is not this "
            "machine: actors and engines would look for the learner there. With several learner nodes, torchrun's "
            "c10d rendezvous makes rank 0 the node whose --local-addr sorts first: point the config at that node"
        )


def run_here(command: str, cfg: AgentRLConfig) -> int:
    """Run ``command`` on this rank; returns a process exit code."""
    from agentrl.learner.distributed import shutdown_distributed

    _setup_logging()
    env = os.environ
    logging.getLogger("agentrl.learner").info(
        "%s: rank %s of %s on %s (local rank %s, CUDA_VISIBLE_DEVICES=%s)",
        command,
        env.get("RANK", "0"),
        env.get("WORLD_SIZE", "1"),
        socket.gethostname(),
        env.get("LOCAL_RANK", "0"),
        env.get("CUDA_VISIBLE_DEVICES", "unset"),
    )
    try:
        if command == "learn":
            from agentrl.learner.loop import learn

            if os.environ.get("RANK", "0") == "0":
                check_rank0_addresses(cfg)
            reason = learn(cfg)
            # data_timeout too ended cleanly, with a checkpoint: a restart would only wait again
            code = 0 if reason in ("done", "stopped", "data_timeout") else 3
        elif command == "sft":
            from agentrl.learner.sft import sft

            sft(cfg)
            code = 0
        else:
            raise ValueError(f"unknown command {command!r}")
    finally:
        shutdown_distributed()
    return code


def torchrun_command(
    command: str, config: Path | None, overrides: list[str], nproc: int, nodes: Nodes = Nodes()
) -> list[str]:
    """The torchrun argv that runs ``command`` on ``nproc`` ranks here (one node of ``nodes``)."""
    argv = [sys.executable, "-m", "torch.distributed.run", *nodes.torchrun_flags(), f"--nproc-per-node={nproc}"]
    argv += ["-m", "agentrl.learner.launch", command]
    if config is not None:
        argv += ["--config", str(config)]
    for item in overrides:
        argv += ["--set", item]
    return argv


def launch(command: str, config: Path | None, overrides: list[str], nproc: int, nodes: Nodes = Nodes()) -> int:
    """Entry point of the CLI commands: one rank here, or ``nproc`` ranks (per node) through torchrun."""
    from agentrl.config import resolve_run_dir

    cfg = load_config(config, overrides)
    if not cfg.run.run_dir:
        if nodes.nnodes > 1:
            raise ValueError(
                f"{nodes.nnodes} learner nodes must share one run folder: set run.run_dir "
                "(on a file system every node sees)"
            )
        overrides = [*overrides, f'run.run_dir="{resolve_run_dir(cfg)}"']
        cfg = load_config(config, overrides)
    if nproc <= 1 and nodes.nnodes == 1:
        return run_here(command, cfg)
    proc = subprocess.Popen(torchrun_command(command, config, overrides, nproc, nodes))

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
