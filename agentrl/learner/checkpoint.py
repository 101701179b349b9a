"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): all long-lived state, resumable.

A checkpoint folder ``step_<n>/`` holds the DCP shards (policy and optimiser, critic for PPO; with
LoRA the adapters only), ``trainer_state.pt``, per-rank RNG state, the groups still waiting
(``pending_groups.bin``), the model's ``hf/`` files, and ``meta.json``; ``latest`` names the newest.

Invariants:

* durable before it counts: every file is fsynced, ``meta.json`` is written last (a folder without
  it is incomplete), ``latest`` is replaced atomically once every rank has finished;
* retention is by step within the saving lineage only: another run's checkpoints in the same
  folder are never deleted;
* loading reads data, never code: ``torch.load(weights_only=True)``, and :func:`dcp_reader` admits
  only DCP's own metadata classes when it unpickles ``.metadata``.

See docs/learner.md.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from agentrl.learner.journal import fsync_dir
from agentrl.learner.trainer import Trainer

log = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# The lineage each checkpoint root continues in this process: set by a load or the first save.
_LINEAGES: dict[Path, str] = {}


def checkpoint_root(run_dir: str | Path, kind: str) -> Path:
    return Path(run_dir) / "checkpoints" / kind


def fallback_root(run_dir: str | Path, kind: str) -> Path:
    """Where a learner puts a checkpoint that :func:`checkpoint_root` refused, again and again (an
    unwritable or full folder): the trained weights are kept somewhere rather than lost."""
    return Path(run_dir) / "checkpoints_fallback" / kind


def latest_run_checkpoint(run_dir: str | Path, kind: str) -> Path | None:
    """The newest complete checkpoint of a run folder, in :func:`checkpoint_root` or :func:`fallback_root`."""
    found = [
        p
        for root in (checkpoint_root(run_dir, kind), fallback_root(run_dir, kind))
        if (p := latest_checkpoint(root)) is not None
    ]
    return max(found, key=lambda p: ((checkpoint_meta(p) or {}).get("saved_at", 0.0), p.name), default=None)


def write_problem(root: str | Path) -> str:
    """Why a checkpoint cannot be written under ``root`` (``""``: it can), from creating it and a
    probe file in it: a folder that cannot be written fails here, before any collective save."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return ""


def checkpoint_meta(path: str | Path) -> dict[str, Any] | None:
    """A checkpoint's ``meta.json`` when the checkpoint is complete, else None."""
    path = Path(path)
    if not ((path / ".metadata").exists() and (path / "trainer_state.pt").exists()):
        return None
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("step"), int) else None


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``latest`` names when complete, else the newest complete one (None: none)."""
    root = Path(root)
    pointer = root / "latest"
    if pointer.exists():
        path = root / pointer.read_text().strip()
        if checkpoint_meta(path) is not None:
            return path
        reason = f"{pointer} names {path.name!r}, which is missing or incomplete"
    else:
        reason = f"{pointer} does not exist"
    found = [
        (meta.get("saved_at", 0.0), meta["step"], p)
        for p in root.glob("step_*")
        if (meta := checkpoint_meta(p)) is not None
    ]
    if not found:
        return None
    newest = max(found, key=lambda x: (x[0], x[1]))[2]
    log.warning("%s; using the newest complete checkpoint, %s", reason, newest)
    return newest


def kept_checkpoints(root: str | Path, lineage: str) -> list[Path]:
    """The complete checkpoints of ``lineage`` under ``root``, lowest step first."""
    found = [
        (meta["step"], p)
        for p in Path(root).glob("step_*")
        if (meta := checkpoint_meta(p)) is not None and meta.get("lineage") == lineage
    ]
    return [p for _, p in sorted(found)]


_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata``: its own data classes and a few plain types, nothing callable."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module == "torch.distributed.checkpoint.metadata"
            or (module, name) in _METADATA_GLOBALS
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")
        return super().find_class(module, name)


def dcp_reader(path: str | Path) -> Any:
    """A DCP ``FileSystemReader`` for ``path`` whose ``.metadata`` is read by :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # FileSystemReader's, minus pickle.load
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _policy_options(trainer: Trainer) -> Any:
    """With LoRA the policy's state is its trainable parameters, the adapters (the frozen base is
    ``model.path``'s). Loading is not strict then because the state holds the adapters alone; DCP
    still fails on any adapter missing from the checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if trainer.spec.lora is None:
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _model_state(trainer: Trainer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    policy, policy_optim = get_state_dict(trainer.policy, trainer.optimizer, options=_policy_options(trainer))
    if trainer.spec.lora is not None:  # a tied head shows up as a key of its own, frozen or not
        trainable = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
        policy = {k: v for k, v in policy.items() if k in trainable}
    state: dict[str, Any] = {"policy": policy, "policy_optim": policy_optim}
    if trainer.critic is not None:
        critic, critic_optim = get_state_dict(*trainer.critic_and_optimizer())
        state.update(critic=critic, critic_optim=critic_optim)
    return state


def _rng_state() -> dict[str, Any]:
    legacy = np.random.get_state()
    assert isinstance(legacy, tuple), "numpy's global generator is an MT19937: its legacy state is a tuple"
    kind, keys, pos, has_gauss, gauss = legacy  # keys: an ndarray; weights_only refuses it
    numpy_state = [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _write_durable(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _save_durable(obj: Any, path: Path) -> None:
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _copy_hf_files(model_path: str | Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_path).iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
            _fsync_file(out / f.name)
    fsync_dir(out)


def save_checkpoint(
    root: str | Path,
    trainer: Trainer,
    *,
    state: dict[str, Any] | None = None,
    pending_groups: bytes = b"",
    keep: int = 2,
    lineage: str | None = None,
) -> Path:
    """Save everything (collective: every rank calls it). ``state`` is the caller's state (plain
    dicts, lists, strings and numbers), stored with the trainer's own on rank 0. ``lineage``:
    see the module docstring; None continues the one this process loaded or saved under
    ``root``, or starts a new one."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    root = Path(root)
    lineage = lineage or _LINEAGES.get(root.resolve()) or uuid.uuid4().hex[:16]
    _LINEAGES[root.resolve()] = lineage
    path = root / f"step_{trainer.step:08d}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        if path.exists():
            shutil.rmtree(path)
        (path / "rng").mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    save(_model_state(trainer), storage_writer=FileSystemWriter(str(path), sync_files=True))
    _save_durable(_rng_state(), path / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        trainer_state = {
            "step": trainer.step,
            "skipped_updates": trainer.skipped_updates,
            "scheduler": trainer.scheduler.state_dict(),
            "world_size": trainer.dist.world_size,
            "caller": state or {},
        }
        _save_durable(trainer_state, path / "trainer_state.pt")
        _write_durable(path / "pending_groups.bin", pending_groups)
        _copy_hf_files(trainer.spec.model_path, path / "hf")
    if dist.is_initialized():
        dist.barrier()  # every rank's files are on disk
    if rank == 0:
        fsync_dir(path / "rng")
        fsync_dir(path)
        meta = {
            "step": trainer.step,
            "lineage": lineage,
            "world_size": trainer.dist.world_size,
            "algorithm": trainer.spec.algorithm,
            "model_path": str(trainer.spec.model_path),
            # the adapters' settings (None: the whole policy is in the checkpoint); export and resume read it
            "lora": trainer.spec.lora.as_dict() if trainer.spec.lora is not None else None,
            "saved_at": time.time(),
            "caller": {k: v for k, v in (state or {}).items() if isinstance(v, (int, float, str, bool))},
        }
        _write_durable(path / "meta.json", json.dumps(meta, indent=2).encode())  # complete from here
        fsync_dir(path)
        _write_durable(root / "latest.tmp", path.name.encode())
        os.replace(root / "latest.tmp", root / "latest")
        fsync_dir(root)
        _prune(root, keep, lineage)
    if dist.is_initialized():
        dist.barrier()
    return path


def _prune(root: Path, keep: int, lineage: str) -> None:
    """Delete ``lineage``'s checkpoints below its ``keep`` highest steps."""
    for old in kept_checkpoints(root, lineage)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _check_lora(path: Path, trainer: Trainer) -> None:
    """A checkpoint holds the adapters of the LoRA it was trained with, or the whole policy: refuse
    to load it into a trainer set up otherwise, naming both (DCP would only list missing keys)."""
    meta = checkpoint_meta(path) or {}
    saved = meta.get("lora")
    wanted = trainer.spec.lora.as_dict() if trainer.spec.lora is not None else None
    if "lora" in meta and saved != wanted:
        raise ValueError(
            f"{path} was trained with learner.lora = {saved or 'off'}, but this run has "
            f"learner.lora = {wanted or 'off'}: set [learner.lora] as it was, or start a new run folder"
        )


def load_checkpoint(path: str | Path, trainer: Trainer) -> dict[str, Any]:
    """Restore ``trainer`` from ``path`` (collective) and return the caller's saved state,
    with ``pending_groups`` (bytes) added."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    path = Path(path)
    if not (path / ".metadata").exists():
        raise ValueError(f"{path} is not a checkpoint (no .metadata)")
    rank = dist.get_rank() if dist.is_initialized() else 0
    _check_lora(path, trainer)
    state = _model_state(trainer)
    load(state, storage_reader=dcp_reader(path))
    set_state_dict(
        trainer.policy,
        trainer.optimizer,
        model_state_dict=state["policy"],
        optim_state_dict=state["policy_optim"],
        options=_policy_options(trainer),
    )
    if trainer.critic is not None:
        set_state_dict(
            *trainer.critic_and_optimizer(),
            model_state_dict=state["critic"],
            optim_state_dict=state["critic_optim"],
        )
    trainer_state = torch.load(path / "trainer_state.pt", weights_only=True)
    trainer.step = int(trainer_state["step"])
    trainer.skipped_updates = int(trainer_state["skipped_updates"])
    trainer.scheduler.load_state_dict(trainer_state["scheduler"])
    rng_file = path / "rng" / f"rank_{rank}.pt"
    if rng_file.exists():  # a different world size restores the ranks it has
        _set_rng_state(torch.load(rng_file, weights_only=True))
    caller = dict(trainer_state.get("caller", {}))
    pending = path / "pending_groups.bin"
    caller["pending_groups"] = pending.read_bytes() if pending.exists() else b""
    meta = checkpoint_meta(path) or {}
    if meta.get("lineage"):
        _LINEAGES[path.parent.resolve()] = meta["lineage"]
    caller["lineage"] = meta.get("lineage", "")
    return caller
