"""Process group setup and the few collectives the learner uses outside FSDP.

The learner always runs inside a process group, one rank included (a single-rank gloo or nccl
group on a free loopback port), so there is one code path. Under ``torchrun`` the group is made
from the usual variables. CPU ranks use gloo; GPU ranks use nccl for tensors and gloo for CPU
objects (``cuda:nccl,cpu:gloo``). See docs/learner.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agentrl.net import free_port


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(preference: str, local_rank: int = 0) -> torch.device:
    """``auto`` picks the local GPU when there is one, else the CPU."""
    if preference == "auto":
        preference = "cuda" if torch.cuda.is_available() else "cpu"
    if preference == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("learner.device = 'cuda' but torch sees no GPU")
        return torch.device("cuda", local_rank)
    if preference == "cpu":
        return torch.device("cpu")
    raise ValueError(f"learner.device must be auto, cpu or cuda, got {preference!r}")


def init_distributed(device_preference: str = "auto", timeout_s: float = 1800.0) -> DistInfo:
    """Join (or create) the default process group; idempotent within a process."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if under_torchrun else 0
    device = resolve_device(device_preference, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if under_torchrun:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timeout
            )
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device)


def shutdown_distributed() -> None:
    """Barrier, then destroy the group (a missing barrier can hang gloo peers on exit)."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Send a picklable object from ``src`` to every rank (the value on other ranks is ignored)."""
    if dist.get_world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, device=torch.device("cpu"))  # gloo, also on GPU ranks
    return box[0]
