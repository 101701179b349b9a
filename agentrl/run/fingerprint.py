"""What a run folder's warm start and learner state were made from, and setting a changed folder aside.

``agentrl run`` writes :func:`run_fingerprint` to ``<run_dir>/run_fingerprint.json`` at start: a hash of
every env section, the source file of each env's module (an edited env counts), the ``[sft]`` section
and the base model. A restarted run reuses the folder's warm start, checkpoints and journal only while
those hashes match; :func:`supersede_changed_run` moves a folder whose fingerprint changed to
``<run_dir>/superseded-<time>/`` before anything is written into it, so nothing of another policy is
reused or replayed. A folder without a fingerprint (new) is left as it is. See docs/run.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import time
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig

FINGERPRINT_FILE = "run_fingerprint.json"  # what the folder's warm start and learner state come from


def run_fingerprint(cfg: AgentRLConfig) -> dict[str, str]:
    """A hash of each thing a run folder's warm start and learner state were made from: every env
    section, the source file of its class's module (an edited env counts), the ``[sft]`` section
    and the base model."""
    parts = {}
    for key, section in cfg._env_keys():
        parts[key] = _digest(section.model_dump())
        parts[f"{key} code"] = _digest(_module_source(section.cls.rsplit(":", 1)[0]))
    parts["sft"] = _digest(cfg.sft.model_dump())
    parts["model"] = _digest({"path": cfg.model.path, "init_size": cfg.model.init_size})
    return parts


def _digest(value: Any) -> str:
    data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True, default=str).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _module_source(module: str) -> bytes:
    """The bytes of an env module's file (``path/to/file.py``, or found by import), b"" if none."""
    try:
        if module.endswith(".py"):
            return Path(module).read_bytes()
        spec = importlib.util.find_spec(module)
        return Path(spec.origin).read_bytes() if spec is not None and spec.origin else b""
    except (OSError, ImportError, ValueError):
        return b""


def supersede_changed_run(cfg: AgentRLConfig, run_dir: Path) -> str:
    """A run folder whose last run had other envs (config or code), ``[sft]`` or base model: its
    warm start and the learner's state are another policy's, so its contents move to
    ``<run_dir>/superseded-<time>/`` and this run starts afresh, warm start included. Returns
    what happened, in words ("" when nothing changed, or the folder is new or predates
    fingerprints)."""
    try:
        old = json.loads((run_dir / FINGERPRINT_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return ""
    new = run_fingerprint(cfg)
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if not changed:
        return ""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    names = (f"superseded-{stamp}" + (f"-{i}" if i > 1 else "") for i in itertools.count(1))
    archive = next(run_dir / name for name in names if not (run_dir / name).exists())
    archive.mkdir()
    for entry in list(run_dir.iterdir()):
        if not entry.name.startswith("superseded-"):
            entry.rename(archive / entry.name)
    return (
        f"{', '.join(changed)} changed since this folder's last run: its warm start, checkpoints, journal, "
        f"logs and metrics moved to {archive}; this run starts afresh, with a new warm start"
    )


def prepare_run_dir(cfg: AgentRLConfig, run_dir: Path) -> str:
    """The run folder made ready for this run: a changed one set aside (:func:`supersede_changed_run`,
    whose words it returns), the folder created and this run's fingerprint written into it."""
    superseded = supersede_changed_run(cfg, run_dir)  # before anything is written into the folder
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / FINGERPRINT_FILE).write_text(json.dumps(run_fingerprint(cfg), indent=2))
    return superseded
