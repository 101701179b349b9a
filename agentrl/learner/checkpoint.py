"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): all long-lived state, resumable.

Layout under a checkpoint root (``<run_dir>/checkpoints/learn`` or ``.../sft``)::

    step_00000010/
        .metadata, __*_*.distcp   DCP: policy, policy_optim (+ critic, critic_optim for PPO),
                                  saved as shards by every rank; any world size can load them
        trainer_state.pt          step, policy version, LR scheduler, data counters,
                                  skipped updates, anything else the caller adds (rank 0)
        rng/rank_<r>.pt           Python, NumPy, torch (and CUDA) RNG state of each rank
        pending_groups.bin        groups received but not trained on yet, msgpack (rank 0)
        hf/                       the model's config and tokenizer files (for ``agentrl export``)
        meta.json                 human-readable summary
    latest                        name of the newest complete checkpoint

``latest`` is written (atomically) only after every rank has finished writing, so a crash
during a save leaves the previous checkpoint in charge. ``resume = "auto"`` loads the
checkpoint ``latest`` names and continues with the next step: same weights, optimiser
moments, LR, RNG streams and policy version, and the groups that were waiting.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from agentrl.learner.trainer import Trainer

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def checkpoint_root(run_dir: str | Path, kind: str) -> Path:
    return Path(run_dir) / "checkpoints" / kind


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (None when there is none)."""
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / ".metadata").exists() else None


def _model_state(trainer: Trainer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    policy, policy_optim = get_state_dict(trainer.policy, trainer.optimizer)
    state: dict[str, Any] = {"policy": policy, "policy_optim": policy_optim}
    if trainer.critic is not None:
        critic, critic_optim = get_state_dict(trainer.critic, trainer.critic_optimizer)
        state.update(critic=critic, critic_optim=critic_optim)
    return state


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _copy_hf_files(model_path: str | Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_path).iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)


def save_checkpoint(
    root: str | Path,
    trainer: Trainer,
    *,
    state: dict[str, Any] | None = None,
    pending_groups: bytes = b"",
    keep: int = 2,
) -> Path:
    """Save everything (collective: every rank calls it). ``state`` is the caller's picklable
    state (policy version, counters...), stored with the trainer's own on rank 0."""
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    path = root / f"step_{trainer.step:08d}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        if path.exists():
            shutil.rmtree(path)
        (path / "rng").mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(_model_state(trainer), checkpoint_id=str(path))
    torch.save(_rng_state(), path / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        trainer_state = {
            "step": trainer.step,
            "skipped_updates": trainer.skipped_updates,
            "scheduler": trainer.scheduler.state_dict(),
            "world_size": trainer.dist.world_size,
            "caller": state or {},
        }
        torch.save(trainer_state, path / "trainer_state.pt")
        (path / "pending_groups.bin").write_bytes(pending_groups)
        _copy_hf_files(trainer.spec.model_path, path / "hf")
        meta = {
            "step": trainer.step,
            "world_size": trainer.dist.world_size,
            "algorithm": trainer.spec.algorithm,
            "model_path": str(trainer.spec.model_path),
            "saved_at": time.time(),
            "caller": {k: v for k, v in (state or {}).items() if isinstance(v, (int, float, str, bool))},
        }
        (path / "meta.json").write_text(json.dumps(meta, indent=2))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        tmp = root / "latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, root / "latest")
        _prune(root, keep)
    if dist.is_initialized():
        dist.barrier()
    return path


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | Path, trainer: Trainer) -> dict[str, Any]:
    """Restore ``trainer`` from ``path`` (collective) and return the caller's saved state,
    with ``pending_groups`` (bytes) added."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    if not (path / ".metadata").exists():
        raise ValueError(f"{path} is not a checkpoint (no .metadata)")
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = _model_state(trainer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        trainer.policy, trainer.optimizer, model_state_dict=state["policy"], optim_state_dict=state["policy_optim"]
    )
    if trainer.critic is not None:
        set_state_dict(
            trainer.critic,
            trainer.critic_optimizer,
            model_state_dict=state["critic"],
            optim_state_dict=state["critic_optim"],
        )
    trainer_state = torch.load(path / "trainer_state.pt", weights_only=False)
    trainer.step = int(trainer_state["step"])
    trainer.skipped_updates = int(trainer_state["skipped_updates"])
    trainer.scheduler.load_state_dict(trainer_state["scheduler"])
    rng_file = path / "rng" / f"rank_{rank}.pt"
    if rng_file.exists():  # a different world size restores the ranks it has
        _set_rng_state(torch.load(rng_file, weights_only=False))
    caller = dict(trainer_state.get("caller", {}))
    pending = path / "pending_groups.bin"
    caller["pending_groups"] = pending.read_bytes() if pending.exists() else b""
    return caller
