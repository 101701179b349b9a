"""Checkpoints that hold: retention per lineage by step, ``latest`` falling back to the newest
complete checkpoint, everything fsynced before ``latest`` moves, and loads that read data only."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import traceback

import pytest
import torch

from tests._learner_helpers import tiny_model  # noqa: F401


@pytest.fixture(scope="module")
def trainer(tiny_model):
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.trainer import Trainer, TrainerSpec

    torch.set_num_threads(1)
    return Trainer(
        TrainerSpec(model_path=str(tiny_model), lr=1e-3, max_tokens_per_microbatch=96), init_distributed("cpu")
    )


def save(trainer, root, step: int, lineage: str | None, keep: int = 1):
    from agentrl.learner.checkpoint import save_checkpoint

    trainer.step = step
    return save_checkpoint(root, trainer, state={"policy_version": step}, keep=keep, lineage=lineage)


def steps(root) -> list[str]:
    return sorted(p.name for p in root.glob("step_*"))


def test_retention_keeps_this_runs_highest_steps_and_never_touches_another_run(trainer, tmp_path):
    from agentrl.learner.checkpoint import latest_checkpoint, load_checkpoint

    root = tmp_path / "ckpt"
    save(trainer, root, 100, "old-run")
    # a new run in the same folder: sorting names would delete its fresh step_50 and leave `latest` dangling
    save(trainer, root, 50, "new-run")
    assert steps(root) == ["step_00000050", "step_00000100"]
    assert latest_checkpoint(root).name == "step_00000050" and (root / "latest").read_text() == "step_00000050"
    save(trainer, root, 60, "new-run")
    assert steps(root) == ["step_00000060", "step_00000100"]
    # a resume continues the loaded checkpoint's lineage without being told
    state = load_checkpoint(latest_checkpoint(root), trainer)
    assert state["lineage"] == "new-run" and state["policy_version"] == 60
    save(trainer, root, 70, None, keep=2)
    assert steps(root) == ["step_00000060", "step_00000070", "step_00000100"]
    assert json.loads((root / "step_00000070" / "meta.json").read_text())["lineage"] == "new-run"


def test_latest_falls_back_to_the_newest_complete_checkpoint(trainer, tmp_path, caplog):
    from agentrl.learner.checkpoint import latest_checkpoint

    root = tmp_path / "ckpt"
    assert latest_checkpoint(root) is None
    save(trainer, root, 3, "run", keep=5)
    meta = root / "step_00000003" / "meta.json"  # saved a minute before the others (no clock resolution race)
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "saved_at": time.time() - 60}))
    save(trainer, root, 1, "run", keep=5)  # saved last: the newest, although its step is lower
    save(trainer, root, 2, "run", keep=5)
    (root / "step_00000002" / "meta.json").unlink()  # a save that died before it was complete
    assert latest_checkpoint(root).name == "step_00000001"
    assert "names 'step_00000002', which is missing or incomplete" in caplog.text
    shutil.rmtree(root / "step_00000001")  # `latest` dangles
    (root / "latest").write_text("step_00000001")
    assert latest_checkpoint(root).name == "step_00000003"
    (root / "latest").unlink()
    assert latest_checkpoint(root).name == "step_00000003"
    shutil.rmtree(root / "step_00000003")
    assert latest_checkpoint(root) is None


def test_everything_is_on_disk_before_latest_moves(trainer, tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    root = tmp_path / "ckpt"
    path = save(trainer, root, 5, "run")
    moved = events.index(("replace", str(root / "latest")))
    before = {name for kind, name in events[:moved] if kind == "fsync"}
    # (DCP writes .metadata.tmp, fsyncs and renames it; the folder's fsync below makes the rename durable)
    for name in (
        "trainer_state.pt",
        "pending_groups.bin",
        "meta.json",
        "rng/rank_0.pt",
        ".metadata.tmp",
        "__0_0.distcp",
        "hf/config.json",
    ):
        assert str(path / name) in before, name
    assert str(path) in before and str(path / "rng") in before  # the folders' entries too
    assert str(root / "latest.tmp") in before
    assert ("fsync", str(root)) in events[moved:]  # the rename itself


class _Payload:
    """Unpickling this runs code: it creates a file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_loads_read_data_not_code(trainer, tmp_path):
    from agentrl.learner.checkpoint import load_checkpoint

    root = tmp_path / "ckpt"
    path = save(trainer, root, 4, "run")
    marker = tmp_path / "pwned"
    for victim in ("trainer_state.pt", "rng/rank_0.pt"):
        good = (path / victim).read_bytes()
        torch.save({"caller": _Payload(str(marker))}, path / victim)
        with pytest.raises(Exception, match="Weights only load failed"):
            load_checkpoint(path, trainer)
        assert not marker.exists(), victim
        (path / victim).write_bytes(good)
    good = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))  # DCP's own file: pickle
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as err:  # DCP collects each rank's error
        load_checkpoint(path, trainer)
    wrapped = "".join(traceback.format_exception(err.value))
    assert "open is not allowed in a checkpoint's .metadata" in wrapped
    assert not marker.exists()
    (path / ".metadata").write_bytes(good)
    assert load_checkpoint(path, trainer)["policy_version"] == 4
