"""Task sources: read an env's tasks from local JSONL, JSON, Parquet or Hugging Face datasets.

:class:`TaskSource` maps split names to local paths and turns records into :class:`Task` objects. A
path may be a ``.jsonl`` file (errors name the line), a ``.json`` list, a ``.parquet`` file, a
``datasets`` ``save_to_disk`` folder (read with ``datasets``, else with ``pyarrow``), or a folder
of ``.jsonl``/``.parquet`` files in name order; ``{split}`` in a path is replaced by the split name.

The ``train`` split is an endless stream, reshuffled every pass with ``seed``; every other split is
served once, in file order, so evaluation sets are stable. ``id_field`` becomes :attr:`Task.id`
(else ``"<split>-<row>"``) and the record is :attr:`Task.data`. See docs/envs.md.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentrl.envs.base import Task
from agentrl.jsonl import read_json, read_jsonl

Record = dict[str, Any]


class TaskSource:
    def __init__(self, path: str | Path | None = None, *, id_field: str = "id", **split_paths: str | Path):
        """``TaskSource("data/{split}.jsonl")`` or ``TaskSource(train="a.jsonl", test="b.parquet")``."""
        if path is None and not split_paths:
            raise ValueError("TaskSource needs a path or one path per split (train=..., test=...)")
        self.path = str(path) if path is not None else None
        self.split_paths = {k: str(v) for k, v in split_paths.items()}
        self.id_field = id_field
        self._cache: dict[str, list[Record]] = {}

    def records(self, split: str) -> list[Record]:
        if split not in self._cache:
            if split in self.split_paths:
                self._cache[split] = load_records(self.split_paths[split])
            elif self.path is not None:
                if "{split}" in self.path:
                    self._cache[split] = load_records(self.path.format(split=split))
                else:
                    self._cache[split] = load_records(self.path, split=split)
            else:
                raise ValueError(f"no path for split {split!r}; known splits: {', '.join(self.split_paths)}")
            if not self._cache[split]:
                raise ValueError(f"split {split!r} of the task source has no records")
        return self._cache[split]

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        records = self.records(split)
        tasks = [self._task(split, i, r) for i, r in enumerate(records)]
        if split != "train":
            yield from tasks
            return
        rng = random.Random(f"tasks-{seed}")
        while True:
            order = list(range(len(tasks)))
            rng.shuffle(order)
            for i in order:
                yield tasks[i]

    def _task(self, split: str, index: int, record: Record) -> Task:
        if not isinstance(record, dict):
            raise ValueError(f"record {index} of split {split!r} is a {type(record).__name__}, not an object")
        task_id = record.get(self.id_field)
        return Task(id=str(task_id) if task_id is not None else f"{split}-{index}", data=dict(record))


def load_records(path: str | Path, split: str | None = None) -> list[Record]:
    """All records at ``path`` (see the module docstring for the formats)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"task data not found: {p}")
    if p.is_dir():
        return _load_dir(p, split)
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        return [_object(record, f"{p}:{lineno}") for lineno, record in read_jsonl(p)]
    if suffix == ".json":
        data = read_json(p)
        if not isinstance(data, list):
            raise ValueError(f"{p} must hold a JSON list of objects (use .jsonl for one object per line)")
        return [_object(record, f"{p}: item {i}") for i, record in enumerate(data)]
    if suffix == ".parquet":
        return _pyarrow("Parquet files").parquet.read_table(p).to_pylist()
    raise ValueError(f"cannot read tasks from {p}: expected .jsonl, .json, .parquet or a datasets folder")


def _object(record: Any, where: str) -> Record:
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object (a task is an object)")
    return record


def _load_dir(p: Path, split: str | None) -> list[Record]:
    if (p / "dataset_dict.json").exists():
        splits = read_json(p / "dataset_dict.json").get("splits", [])
        if split is None or split not in splits:
            raise ValueError(f"{p} is a DatasetDict with splits {splits}; split {split!r} is not one of them")
        return _load_hf_dataset(p / split)
    if (p / "state.json").exists():
        return _load_hf_dataset(p)
    files = sorted(f for f in p.iterdir() if f.suffix.lower() in (".jsonl", ".parquet"))
    if split is not None and any(f.name.startswith(split) for f in files):
        files = [f for f in files if f.name.startswith(split)]
    if not files:
        raise ValueError(f"{p} holds no .jsonl or .parquet files and is not a datasets folder")
    return [r for f in files for r in load_records(f)]


def _load_hf_dataset(p: Path) -> list[Record]:
    """A ``save_to_disk`` folder: with ``datasets`` if present, else its Arrow stream files."""
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        pa = _pyarrow("datasets folders (or install the `datasets` package)")
        state = read_json(p / "state.json")
        rows: list[Record] = []
        for entry in state.get("_data_files", []):
            with pa.memory_map(str(p / entry["filename"])) as source:
                rows += pa.ipc.open_stream(source).read_all().to_pylist()
        return rows
    loaded = datasets.load_from_disk(str(p))
    if isinstance(loaded, datasets.DatasetDict):
        raise ValueError(f"{p} holds the splits {sorted(loaded)} (a DatasetDict): point at one split's folder")
    return loaded.to_list()


def _pyarrow(what: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ValueError(f"reading {what} needs pyarrow: pip install pyarrow") from None
    return pyarrow
