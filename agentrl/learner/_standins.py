"""Minimal stand-ins for ``agentrl.transport`` and ``agentrl.tracking``.

DELETE THIS FILE when the transport branch is merged: ``loop.py`` imports these only when
``agentrl.transport`` / ``agentrl.tracking`` do not exist. They implement just the learner
side of the interfaces in ``/work/notes/interfaces.md`` (``GroupReceiver``,
``ProgressPublisher``, ``open_tracker``) with real ZMQ sockets and real MLflow, so that
``agentrl learn`` can be tested end to end on the learner branch.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

from agentrl.protocol import Progress, ProtocolError, TrajectoryGroup, decode, encode


class GroupReceiver:
    """ZMQ PULL socket drained by a background thread; malformed messages counted and dropped."""

    def __init__(self, endpoint: str, *, bind: bool = True, max_queued_groups: int = 64) -> None:
        import zmq

        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, max_queued_groups)
        self._sock.setsockopt(zmq.LINGER, 0)
        (self._sock.bind if bind else self._sock.connect)(endpoint)
        self._queue: queue.Queue[TrajectoryGroup] = queue.Queue(maxsize=max_queued_groups)
        self.stats: dict[str, int] = {"received": 0, "malformed": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="group-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            data = self._sock.recv()
            try:
                msg = decode(data)
                if not isinstance(msg, TrajectoryGroup):
                    raise ProtocolError(f"expected a group, got {type(msg).__name__}")
            except ProtocolError:
                self.stats["malformed"] += 1
                continue
            self.stats["received"] += 1
            while not self._stop.is_set():
                try:
                    self._queue.put(msg, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def get(self, timeout_s: float | None = None) -> TrajectoryGroup | None:
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(0)


class ProgressPublisher:
    """ZMQ PUB socket for :class:`Progress` messages."""

    def __init__(self, endpoint: str, *, bind: bool = True) -> None:
        import zmq

        self._sock = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        (self._sock.bind if bind else self._sock.connect)(endpoint)

    def publish(self, progress: Progress) -> None:
        self._sock.send(encode(progress))

    def close(self) -> None:
        self._sock.close(linger=1000)  # flush the last message (the final "done")


class NullTracker:
    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path) -> None: ...
    def close(self) -> None: ...


class MlflowTracker:
    def __init__(self, uri: str, experiment: str, run_name: str) -> None:
        import mlflow

        self._mlflow = mlflow
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(experiment)
        self._run = mlflow.start_run(run_name=run_name)

    def log_params(self, params: dict[str, Any]) -> None:
        self._mlflow.log_params({k: str(v)[:500] for k, v in params.items()})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def log_artifact(self, path: str | Path) -> None:
        self._mlflow.log_artifact(str(path))

    def close(self) -> None:
        self._mlflow.end_run()


def open_tracker(cfg: Any, run_dir: str | Path) -> NullTracker | MlflowTracker:
    if not cfg.enabled:
        return NullTracker()
    uri = cfg.uri or f"sqlite:///{Path(run_dir).resolve()}/mlflow.db"
    return MlflowTracker(uri, cfg.experiment, Path(run_dir).name)
