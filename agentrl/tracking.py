"""Experiment tracking: MLflow when enabled, a null object when not.

``open_tracker(cfg.tracking, run_dir)`` returns a :class:`Tracker` bound to one MLflow run, or a
:class:`NullTracker` with the same methods, so callers never test for ``None``. The default store is
``sqlite:///<run_dir>/mlflow.db`` (artifacts next to it); ``tracking.uri`` takes any MLflow URI.
Only :class:`mlflow.MlflowClient` with an explicit run id is used, never the global active run.
Params are flattened with dots; on a resumed run only new keys are logged and a changed value is a
warning.

Invariant: a failing store does not stop training (a warning, then return); values that are not
numbers raise ``TypeError`` naming the key. ``mlflow`` is imported inside :func:`open_tracker` only.
See docs/run.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from agentrl.config import TrackingSection

log = logging.getLogger(__name__)

_MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
_BATCH = 100  # MLflow's limit on params/tags per log_batch call (metrics: 1000)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class NullTracker:
    """Tracking switched off: every method does nothing."""

    run_id: str | None = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | Path) -> None:
        pass

    def log_json(self, data: Mapping[str, Any], artifact_file: str) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass

    def __enter__(self) -> NullTracker:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close("FAILED" if exc_type else "FINISHED")


class Tracker:
    """One MLflow run. Build it with :func:`open_tracker`."""

    def __init__(self, client: MlflowClient, run_id: str, tracking_uri: str) -> None:
        self._client = client
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self._closed = False
        self._failures = 0

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> bool:
        """Run one MLflow call; on failure warn (the first few times) and carry on."""
        try:
            fn(*args, **kwargs)
            return True
        except Exception as e:
            self._failures += 1
            if self._failures <= 5 or self._failures % 100 == 0:
                log.warning("MLflow %s failed (%d failures so far): %s", what, self._failures, e)
            return False

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log (nested) params once; keys already on the run are kept as they are."""
        from mlflow.entities import Param

        flat = {k: str(v)[:_MAX_PARAM_CHARS] for k, v in flatten(params).items()}
        try:
            existing = self._client.get_run(self.run_id).data.params
        except Exception as e:
            log.warning("MLflow get_run failed, logging params blindly: %s", e)
            existing = {}
        for key in sorted(k for k in flat if k in existing and existing[k] != flat[k]):
            log.warning("param %s is %r on this run already; not changed to %r", key, existing[key], flat[key])
        new = [Param(k, v) for k, v in flat.items() if k not in existing]
        for chunk in _chunks(new, _BATCH):
            self._call("log_params", self._client.log_batch, self.run_id, params=chunk, synchronous=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = []
        for key, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"metric {key!r} is a {type(value).__name__}, not a number") from None
            if math.isinf(number):  # MLflow stores NaN, but not infinities
                number = math.copysign(1.7976931348623157e308, number)
            batch.append(Metric(key, number, now, int(step)))
        for chunk in _chunks(batch, 1000):
            self._call("log_metrics", self._client.log_batch, self.run_id, metrics=chunk, synchronous=True)

    def log_artifact(self, path: str | Path) -> None:
        """Upload a file, or a directory's contents under its name."""
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"artifact {p} does not exist")
        if p.is_dir():
            self._call("log_artifacts", self._client.log_artifacts, self.run_id, str(p), artifact_path=p.name)
        else:
            self._call("log_artifact", self._client.log_artifact, self.run_id, str(p))

    def log_json(self, data: Mapping[str, Any], artifact_file: str) -> None:
        """Store ``data`` as the JSON artifact ``artifact_file`` (``samples/step_000010.json``),
        which MLflow's artifact view shows as a tree. Values JSON cannot hold are written as
        their ``str``."""
        if not artifact_file.endswith(".json"):
            raise ValueError(f"artifact_file must end in .json, got {artifact_file!r}")
        self._call("log_dict", self._client.log_dict, self.run_id, dict(data), artifact_file)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)) for k, v in flatten(tags).items()]
        for chunk in _chunks(items, _BATCH):
            self._call("set_tags", self._client.log_batch, self.run_id, tags=chunk, synchronous=True)

    def close(self, status: str = "FINISHED") -> None:
        """End the run with ``status`` (FINISHED, FAILED or KILLED); idempotent."""
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"status must be FINISHED, FAILED or KILLED, got {status!r}")
        if self._closed:
            return
        self._closed = True
        self._call("set_terminated", self._client.set_terminated, self.run_id, status)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close("FAILED" if exc_type else "FINISHED")


def default_uri(run_dir: Path) -> str:
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def _artifact_location(uri: str) -> str | None:
    """Next to the database for a sqlite store; the server's choice otherwise."""
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///"))
        return (db.parent.resolve() / "mlartifacts").as_uri()
    return None


def open_tracker(
    cfg: TrackingSection, run_dir: Path, run_name: str = "", resume_run_id: str | None = None
) -> Tracker | NullTracker:
    """Open (or, with ``resume_run_id``, reopen) the run that this job logs to.

    Failing to reach the store here raises: better to stop before training than to train
    unrecorded. Later calls only warn.
    """
    if not cfg.enabled:
        return NullTracker()
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    uri = cfg.uri or default_uri(run_dir)
    client = MlflowClient(tracking_uri=uri)
    if resume_run_id:
        try:
            run = client.get_run(resume_run_id)
        except MlflowException as e:
            raise ValueError(f"cannot resume MLflow run {resume_run_id!r} at {uri}: {e.message}") from None
        client.update_run(resume_run_id, status="RUNNING")
        return Tracker(client, run.info.run_id, uri)
    experiment = client.get_experiment_by_name(cfg.experiment)
    if experiment is not None:
        experiment_id = experiment.experiment_id
    else:
        try:
            experiment_id = client.create_experiment(cfg.experiment, artifact_location=_artifact_location(uri))
        except MlflowException:  # another process created it first
            experiment = client.get_experiment_by_name(cfg.experiment)
            if experiment is None:
                raise
            experiment_id = experiment.experiment_id
    run = client.create_run(experiment_id, run_name=run_name or None, tags={"agentrl.run_dir": str(run_dir.resolve())})
    return Tracker(client, run.info.run_id, uri)
