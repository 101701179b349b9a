"""How far one learner, its trajectory sink and the actors carry, by simulation: real processes, simulated GPUs.

Runs the real actor processes (``agentrl serve-actors``: the engine client, the episode loop, the calculator env
and its tool, the ZMQ sender), the real transport, and the real learner loop (``agentrl.learner.loop.Learner``:
``_poll``/``_accept``/``_drain``, the ledger, the journal, ``GroupBuffer`` with its staleness drop, batching, the
budget and progress, the status file) against simulated engines (``bench/_sim_engine.py``: SGLang's HTTP API with
a latency model, many per process). Only the GPU work is simulated: the trainer step sleeps
``--train-s-per-token`` per token (the tiny model's ``Trainer`` is built but ``rl_step`` is replaced), and a
push is the real ``WeightUpdater.push_plan`` (pause, version, begin, bucket updates, end, continue over HTTP,
membership probes every 2 s) with each bucket's broadcast replaced by a sleep of ``--push-s``.

Per point (actor processes x engines x group size [x tokens per turn]), after a warm-up, over a window: groups/s
the learner accepted; CPU seconds per unit of work from each process's CPU time (learner per group, actors per
episode); p50/p99 delivery latency (``TrajectoryGroup.created_at`` at the actor to ``Learner._accept``); the
staleness of the groups trained; each process's share of a core, a turn's latency at the actor against its time
in the engine, the push's pause. Then the learner's CPU by part (``METERED``), ``Learner._accept``'s steps in
process on a real group made longer (``--ingest-factors``), and an idle table (``--idle-engines``): what a learner
and an actor spend per engine with no work (membership and health probes). See docs/scaling.md.

    python bench/scale.py                               # the sweep of docs/scaling.md (~5 min on 2 busy cores)
    python bench/scale.py --points 4x64x8,2x16x8x256    # actors x engines x group size [x tokens per turn]
    python bench/scale.py --smoke                       # 1 actor, 2 engines, group 4, a 4 s window (~25 s)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_POINTS = "1x16x8,4x16x8,2x1x8,2x64x8,2x256x8,2x16x32,2x16x8x256"
SMOKE = {
    "points": "1x2x4",
    "warmup_s": 2.0,
    "window_s": 4.0,
    "idle_engines": "",
    "concurrency": 8,
    "ingest_factors": "1",
}
SMOKE_HELP = "1 actor, 2 engines, group 4, a 4 s window and no idle table: checks the path, not the numbers"
STOP_S = 30.0  # grace for a stopping process before SIGKILL


# ----------------------------------------------------------------------------------- learner role

# what the learner's CPU goes to, each measured around the real method: (key, what, clock). Main-thread work
# is timed with thread_time; what fans out to the updater's HTTP threads with process_time.
METERED = (
    ("get", "io.source.get", "thread"),  # ZMQ receive and msgpack decode
    ("accept", "_accept_real", "thread"),  # Learner._accept: ledger, journal, rollout statistics, GroupBuffer.add
    ("take", "buffer.take", "thread"),  # the staleness scan of every buffered group, then the batch
    ("batch", "samples", "thread"),  # samples_from_groups and batch_statistics (advantages, per step)
    ("publish", "_publish", "thread"),  # journal fsync, Progress (with the acks), learner_status.json
    ("probe", "io.weights.membership_change", "process"),  # /model_info of every engine every 2 s
    ("push", "_push", "process"),  # the push's HTTP choreography and the gathers (the broadcast sleeps)
)


class CpuMeter:
    """Cumulative CPU seconds per part of the learner (METERED), sampled with the process's CPU time."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {key: 0.0 for key, _, _ in METERED}
        self.samples: list[list] = []

    def wrap(self, owner: Any, name: str, key: str, clock: str) -> None:
        fn = getattr(owner, name)
        tick = time.thread_time if clock == "thread" else time.process_time
        totals = self.totals

        def timed(*args: Any, **kwargs: Any) -> Any:
            c0 = tick()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[key] += tick() - c0

        setattr(owner, name, timed)

    def count_gc(self) -> None:
        """Also total the garbage collector's pauses (``gc``; they fall inside the parts above, too)."""
        import gc

        self.totals["gc"] = 0.0
        began = [0.0]

        def callback(phase: str, info: dict) -> None:
            if phase == "start":
                began[0] = time.thread_time()
            else:
                self.totals["gc"] += time.thread_time() - began[0]

        gc.callbacks.append(callback)

    def sample_every(self, period_s: float, stop: Any) -> None:
        while not stop.wait(period_s):
            self.samples.append([time.time(), time.process_time(), dict(self.totals)])


def instrument(learner: Any, meter: CpuMeter) -> None:
    import agentrl.learner.batching as batching

    owners = {
        "io.source.get": (learner.io.source, "get"),
        "_accept_real": (learner, "_accept_real"),
        "buffer.take": (learner.buffer, "take"),
        "_publish": (learner, "_publish"),
        "io.weights.membership_change": (learner.io.weights, "membership_change"),
        "_push": (learner, "_push"),
    }
    for key, what, clock in METERED:
        if what == "samples":  # _poll imports them at each call: the module's attributes are what it gets
            meter.wrap(batching, "samples_from_groups", key, clock)
            meter.wrap(batching, "batch_statistics", key, clock)
        else:
            meter.wrap(*owners[what], key, clock)


def sim_updater_class(push_s: float) -> type:
    from agentrl.learner.weight_push import WeightUpdater

    class SimUpdater(WeightUpdater):
        """The real updater without torch.distributed: no group is formed, a broadcast is a sleep."""

        def connect(self) -> None:
            reported = self.probe()
            self.members = [u for u in self.engine_urls if reported[u] is not None]
            self.labels = {u: str(reported[u]) for u in self.members}
            self._all("/continue_generation")
            self.group = "simulated"

        def _broadcast(self, tensors: Any) -> str:
            time.sleep(push_s)
            return ""

        def _drop_group(self) -> None:
            self.group = None

    return SimUpdater


def learner_io(cfg: Any, push_s: float) -> Any:
    """The learner's connections as ``agentrl.learner.loop.open_io`` builds them, with the simulated updater."""
    from agentrl.learner.loop import LearnerIO
    from agentrl.transport import GroupReceiver, ProgressPublisher, security_from_config

    security = security_from_config(cfg.actors)
    queued = max(64, 2 * cfg.learner.groups_per_step)
    source = GroupReceiver(cfg.actors.trajectory_endpoint, bind=True, max_queued_groups=queued, security=security)
    progress = ProgressPublisher(cfg.actors.progress_endpoint, bind=True, security=security)
    weights = sim_updater_class(push_s)(list(cfg.engine.urls), bucket_bytes=int(cfg.engine.weight_bucket_mb * 2**20))
    weights.connect()
    return LearnerIO(source=source, progress=progress, weights=weights)


def run_learner(config: Path, result: Path, push_s: float, train_s_per_token: float, profile: str = "") -> None:
    """The learner process of one point: the real loop and transport, a simulated step and broadcast."""
    import threading

    from agentrl.config import load_config
    from agentrl.learner.loop import Learner
    from agentrl.protocol import encode

    accepted: list[list] = []  # per new group: accept time, created_at, actor, episodes, tokens, calls, gen s
    steps: list[dict] = []

    class ScaleLearner(Learner):
        def _accept(self, group: Any) -> None:
            if group not in self.ledger:
                meta = [t.metadata for t in group.trajectories]
                calls = sum(m.get("num_generate_calls", 0) for m in meta)
                gen_s = sum(m.get("generation_latency_s", 0.0) for m in meta)
                tokens = sum(len(t.tokens) for t in group.trajectories)
                accepted.append([time.time(), group.created_at, group.actor_id, len(meta), tokens, calls, gen_s])
                if len(accepted) == 1:  # one real group, for the ingest table (ingest_costs)
                    result.with_name("sample_group.bin").write_bytes(encode(group))
            self._accept_real(group)

        def _accept_real(self, group: Any) -> None:  # what is metered as "accept": Learner._accept alone
            super()._accept(group)

        def _checkpoint(self) -> float:  # only the final one runs (checkpoint_every_steps = 0), after the window
            return 0.0

    cfg = load_config(config)
    learner = ScaleLearner(cfg, io=learner_io(cfg, push_s))

    def rl_step(samples: list) -> dict[str, float]:
        tokens = sum(s.num_tokens for s in samples)
        stale = [learner.version - g.oldest_version() for g in learner._batch_groups]
        steps.append({"t": time.time(), "version": learner.version, "tokens": tokens, "staleness": stale})
        time.sleep(tokens * train_s_per_token)
        learner.trainer.step += 1
        return {"loss/total": 0.0}

    learner.trainer.rl_step = rl_step  # type: ignore[method-assign]
    meter, stop = CpuMeter(), threading.Event()
    instrument(learner, meter)
    meter.count_gc()
    threading.Thread(target=meter.sample_every, args=(0.25, stop), daemon=True).start()
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile(time.process_time)  # CPU time: waits cost nothing
        profiler.enable()
    try:
        learner.run()
    finally:
        stop.set()
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        counters = dict(learner.buffer.counters) if learner.buffer is not None else {}
        doc = {"accepted": accepted, "steps": steps, "counters": counters, "cpu_samples": meter.samples}
        result.write_text(json.dumps(doc))


# ----------------------------------------------------------------------------------- the driver


@dataclass(frozen=True)
class Point:
    actors: int
    engines: int
    group_size: int
    out_tokens: int = 0  # mean tokens of a simulated turn; 0: --out-tokens

    @classmethod
    def parse(cls, text: str) -> Point:
        """``AxExG`` or ``AxExGxT``: actor processes x engines x group size [x tokens per turn]."""
        return cls(*(int(x) for x in text.lower().split("x")))

    @property
    def label(self) -> str:
        return f"{self.actors}x{self.engines}x{self.group_size}" + (f"x{self.out_tokens}" if self.out_tokens else "")


def free_port_range(count: int) -> int:
    """A base port with ``count`` consecutive ports free a moment ago."""
    first = 10000 + (os.getpid() * 7) % 10000  # below Linux's ephemeral ports (32768 and up)
    for base in [*range(first, 32768 - count, count), *range(10000, first, count)]:
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise SystemExit(f"no {count} consecutive free ports")


def turn_tokens(point: Point, args: argparse.Namespace) -> tuple[int, int]:
    """(mean tokens of a turn, tokens of an episode at most) of ``point``."""
    out = point.out_tokens or args.out_tokens
    return out, max(args.max_total_tokens, 2 * out * args.max_turns + 256)


def config_overrides(point: Point, args: argparse.Namespace, urls: list[str], run_dir: Path) -> list[str]:
    from agentrl.net import free_port

    s = args.staleness
    open_groups = max(1, point.actors) * max(1, args.concurrency // point.group_size)
    gps = args.groups_per_step or open_groups  # the budget, (s + 1) steps' groups, never gates the actors
    out, total = turn_tokens(point, args)
    return [
        f"model.path={args.model}",
        f"run.run_dir={run_dir}",
        "run.torch_num_threads=1",
        f"engine.urls={json.dumps(urls)}",
        f"engine.max_context_tokens={total}",
        f"actors.num_processes={max(1, point.actors)}",
        f"actors.num_concurrent_episodes={args.concurrency}",
        f"actors.group_size={point.group_size}",
        f"actors.max_staleness={s}",
        f"actors.max_new_tokens_per_turn={2 * out}",
        f'actors.trajectory_endpoint="tcp://127.0.0.1:{free_port()}"',
        f'actors.progress_endpoint="tcp://127.0.0.1:{free_port()}"',
        "env.cls=agentrl.envs.calculator:CalculatorEnv",
        f"env.max_turns={args.max_turns}",
        f"env.max_total_tokens={total}",
        "learner.device=cpu",
        "learner.max_steps=1000000",
        f"learner.groups_per_step={gps}",
        f"learner.max_staleness={s}",
        f"learner.max_tokens_per_microbatch={total}",
        "learner.dynamic_sampling=false",
        "learner.checkpoint_every_steps=0",
        "tracking.enabled=false",
        *args.set,
    ]


def write_config(overrides: list[str], path: Path) -> None:
    from agentrl.config import dump_toml, load_config

    path.write_text(dump_toml(load_config(None, overrides)))


class Procs:
    """The processes of one point, stopped in reverse order of start (by pid, never by name)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
        with (self.workdir / f"{name}.out").open("w") as out, (self.workdir / f"{name}.log").open("w") as err:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=err)
        self.procs.append((name, proc))
        return proc

    def check(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text()[-3000:]
                raise SystemExit(f"{name} exited with {proc.returncode} during the run; its log ends:\n{tail}")

    def stop(self) -> None:
        """SIGTERM to every process at once (actors drain, the learner stops at its next poll), then wait."""
        chosen = [proc for _, proc in self.procs]
        for proc in chosen:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        for proc in chosen:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def main_thread_cpu(self, name: str) -> float:
        """CPU seconds of process ``name``'s main thread (rank 0 trains on it; HTTP and ZMQ threads aside)."""
        import psutil

        pid = dict(self.procs)[name].pid
        return sum(t.user_time + t.system_time for t in psutil.Process(pid).threads() if t.id == pid)

    def cpu(self) -> dict[str, float]:
        import psutil

        times = {name: psutil.Process(proc.pid).cpu_times() for name, proc in self.procs}
        return {name: t.user + t.system for name, t in times.items()}


def wait_for(ready: Any, procs: Procs, what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        procs.check()
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} not ready within {timeout_s:.0f} s (logs in {procs.workdir})")
        time.sleep(0.2)


def start_engines(point: Point, args: argparse.Namespace, procs: Procs) -> list[str]:
    """The simulated engines of ``point``, in one process; returns their URLs once they listen."""
    base = free_port_range(point.engines)
    ready = procs.workdir / "engines.ready"
    out, _ = turn_tokens(point, args)
    argv = [sys.executable, str(ROOT / "bench" / "_sim_engine.py"), "--base-port", str(base), "--model", args.model]
    argv += ["--count", str(point.engines), "--ready-file", str(ready), "--out-tokens", str(out)]
    argv += ["--decode-s-per-step", str(args.decode_s_per_step), "--max-batch", str(args.max_batch)]
    argv += ["--tool-rate", str(args.tool_rate)]
    procs.start("engines", argv)
    wait_for(ready.exists, procs, "the simulated engines")
    return [f"http://127.0.0.1:{base + i}" for i in range(point.engines)]


def start_learner(config: Path, args: argparse.Namespace, procs: Procs) -> Path:
    result = procs.workdir / "learner.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--role", "learner", "--config", str(config)]
    argv += ["--result", str(result), "--push-s", str(args.push_s), "--train-s-per-token", str(args.train_s_per_token)]
    if args.profile_learner:
        argv += ["--profile", str(procs.workdir / "learner.prof")]
    procs.start("learner", argv)
    return result


def start_actors(config: Path, count: int, procs: Procs) -> None:
    for i in range(count):
        argv = [sys.executable, "-m", "agentrl.cli", "serve-actors", "--config", str(config), "--index", str(i)]
        procs.start(f"actor{i}", [*argv, "--num-actors", str(count), "--wait-for-learner", "--log-interval-s", "0"])


def learner_received(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "learner_status.json").read_text()).get("received", 0))
    except (OSError, ValueError):
        return 0


def snapshot(procs: Procs, engine_url: str) -> dict[str, Any]:
    import httpx

    sim = httpx.get(f"{engine_url}/_sim/stats", timeout=30).json()
    return {"t": time.time(), "cpu": procs.cpu(), "sim": sim, "main": procs.main_thread_cpu("learner")}


def run_point(point: Point, args: argparse.Namespace) -> dict[str, Any]:
    procs = Procs(Path(tempfile.mkdtemp(prefix=f"scale-{point.label}-", dir=args.workdir)))
    config = procs.workdir / "config.toml"
    started = time.monotonic()
    try:
        urls = start_engines(point, args, procs)
        write_config(config_overrides(point, args, urls, procs.workdir / "run"), config)
        result = start_learner(config, args, procs)
        start_actors(config, point.actors, procs)
        wait_for(lambda: learner_received(procs.workdir / "run") > 0, procs, "the first group at the learner")
        startup_s = time.monotonic() - started
        time.sleep(args.warmup_s)
        procs.check()
        first = snapshot(procs, urls[0])
        time.sleep(args.window_s)
        procs.check()
        last = snapshot(procs, urls[0])
        load = os.getloadavg()[0]
    finally:
        stopping = time.monotonic()
        procs.stop()
    metrics = procs.workdir / "run" / "learner_metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    out = summarize(point, first, last, json.loads(result.read_text()), rows)
    out.update(load=load, startup_s=startup_s, stop_s=time.monotonic() - stopping)
    return out


def window_cpu(samples: list[list], t0: float, t1: float) -> dict[str, float]:
    """The learner's CPU seconds per part (METERED, and ``total``) between the samples nearest t0 and t1."""
    if not samples:
        return {}
    a = min(samples, key=lambda x: abs(x[0] - t0))
    b = min(samples, key=lambda x: abs(x[0] - t1))
    parts = {k: b[2][k] - a[2].get(k, 0.0) for k in b[2]}
    parts["total"] = b[1] - a[1]
    parts["other"] = parts["total"] - sum(v for k, v in parts.items() if k not in ("total", "gc"))
    parts["seconds"] = b[0] - a[0]
    return parts


def summarize(point: Point, first: dict, last: dict, data: dict, rows: list[dict]) -> dict[str, Any]:
    t0, t1 = first["t"], last["t"]
    wall = t1 - t0
    cpu = {n: last["cpu"][n] - first["cpu"].get(n, 0.0) for n in last["cpu"]}
    inside = [a for a in data["accepted"] if t0 <= a[0] <= t1]
    groups, episodes = len(inside), sum(a[3] for a in inside)
    latencies = sorted(a[0] - a[1] for a in inside)
    steps = [st for st in data["steps"] if t0 <= st["t"] <= t1]
    stale = [s for st in steps for s in st["staleness"]]
    actor_cpu = [v for n, v in cpu.items() if n.startswith("actor")]
    sim0, sim1 = first["sim"], last["sim"]
    requests = sum(e["requests"] for e in sim1["engines"]) - sum(e["requests"] for e in sim0["engines"])
    slot_s = sum(e["busy_slot_s"] for e in sim1["engines"]) - sum(e["busy_slot_s"] for e in sim0["engines"])
    parts = window_cpu(data.get("cpu_samples", []), t0, t1)
    per_group = {k: 1000 * v / max(1, groups) for k, v in parts.items() if k in ("get", "accept", "take")}
    return {
        "point": point.label,
        "window_s": wall,
        "groups": groups,
        "steps": len(steps),
        "groups_per_s": groups / wall,
        "episodes_per_s": episodes / wall,
        "tokens_per_group": sum(a[4] for a in inside) / max(1, groups),
        "learner_ms_per_group": 1000 * cpu.get("learner", 0.0) / max(1, groups),
        "learner_parts_ms_per_group": per_group,
        "learner_parts_cpu_s": parts,
        "actor_ms_per_episode": 1000 * sum(actor_cpu) / max(1, episodes),
        "engine_ms_per_request": 1000 * (sim1["cpu_s"] - sim0["cpu_s"]) / max(1, requests),
        "core_use": {n: v / wall for n, v in cpu.items()},
        "delivery_p50_s": percentile(latencies, 0.5),
        "delivery_p99_s": percentile(latencies, 0.99),
        "staleness": {str(k): stale.count(k) / max(1, len(stale)) for k in sorted(set(stale))},
        "dropped_stale": data["counters"].get("dropped_stale", 0),
        "turn_s_actor": sum(a[6] for a in inside) / max(1, sum(a[5] for a in inside)),
        "turn_s_engine": slot_s / max(1, requests),
        "engine_max_waiting": max(e["max_waiting"] for e in sim1["engines"]),
        "push_s": [r.get("time/weight_push_s", 0.0) for r in rows],  # the pause of every push, whole run
        "learner_main_thread_core": (last["main"] - first["main"]) / wall,
        "requests_per_engine_cv": spread([e["requests"] for e in sim1["engines"]]),
    }


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def spread(values: list[int]) -> float:
    """Coefficient of variation (load balance across engines; 0 is perfect)."""
    if len(values) < 2 or not sum(values):
        return 0.0
    return statistics.pstdev(values) / statistics.mean(values)


# ----------------------------------------------------------------------------------- idle costs


def run_idle(engines: int, args: argparse.Namespace) -> dict[str, Any]:
    """A learner and one actor with no work against ``engines`` engines: what watching them costs. The actor
    listens for a learner that never publishes (it starts no episode; its engine client probes)."""
    from agentrl.net import free_port

    procs = Procs(Path(tempfile.mkdtemp(prefix=f"scale-idle-{engines}-", dir=args.workdir)))
    point = Point(1, engines, 8)
    try:
        urls = start_engines(point, args, procs)
        overrides = config_overrides(point, args, urls, procs.workdir / "run")
        config, lonely = procs.workdir / "config.toml", procs.workdir / "actor.toml"
        write_config(overrides, config)
        write_config([*overrides, f'actors.progress_endpoint="tcp://127.0.0.1:{free_port()}"'], lonely)
        start_learner(config, args, procs)
        start_actors(lonely, 1, procs)
        wait_for(lambda: (procs.workdir / "run" / "learner_status.json").exists(), procs, "the learner")
        time.sleep(args.warmup_s)
        first, t0 = procs.cpu(), time.monotonic()
        time.sleep(args.window_s)
        procs.check()
        last, wall = procs.cpu(), time.monotonic() - t0
    finally:
        procs.stop()
    used = {n: (last[n] - first[n]) / wall for n in last}
    return {
        "engines": engines,
        "learner_core": used["learner"],
        "actor_core": used["actor0"],
        "load": os.getloadavg()[0],
    }


# ----------------------------------------------------------------------------------- ingest, in process


def scaled(group: Any, factor: int) -> Any:
    """``group`` with every trajectory's tokens (and its chat's messages) repeated ``factor`` times."""
    import copy

    import numpy as np

    out = copy.deepcopy(group)
    for t in out.trajectories:
        for name in ("tokens", "loss_mask", "behavior_logprobs", "weight_versions"):
            setattr(t, name, np.tile(getattr(t, name), factor))
        t.metadata["messages"] = list(t.metadata.get("messages", [])) * factor
    return out


def cpu_per_call(fn: Any, min_s: float = 0.3) -> float:
    """Thread CPU seconds of one call of ``fn`` (repeated for at least ``min_s``)."""
    calls, c0 = 0, time.thread_time()
    while True:
        fn()
        calls += 1
        spent = time.thread_time() - c0
        if spent >= min_s:
            return spent / calls


def ingest_costs(sample: Path, factors: tuple[int, ...], buffered: int = 256) -> list[dict[str, float]]:
    """CPU of each step of ``Learner._accept`` and of ``GroupBuffer.take``'s scan, per group, in this process,
    on a real group (``sample``) with its episodes made ``factor`` times longer."""
    from agentrl.learner.journal import Journal
    from agentrl.learner.rollout_stats import RolloutStats
    from agentrl.protocol import decode
    from agentrl.transport.delivery import Ledger

    with tempfile.TemporaryDirectory() as tmp:
        journal = Journal(Path(tmp), "bench")
        parts = (journal, Ledger(), RolloutStats())
        rows = [ingest_row(scaled(decode(sample.read_bytes()), f), parts, buffered) for f in factors]
        journal.close()
    return rows


def ingest_row(group: Any, parts: tuple, buffered: int) -> dict[str, float]:
    """One row of :func:`ingest_costs`: what ``Learner._accept`` does, step by step, then the take scan."""
    import itertools

    from agentrl.learner.batching import GroupBuffer
    from agentrl.protocol import decode, encode

    journal, ledger, stats = parts
    data, seq = encode(group), itertools.count()
    longest = max(len(t.tokens) for t in group.trajectories)

    def new_buffer() -> GroupBuffer:
        return GroupBuffer(max_staleness=1, dynamic_sampling=False, vocab_size=1 << 20, max_sequence_tokens=longest)

    def record() -> None:
        group.seq = next(seq)
        ledger.record(group)

    full = new_buffer()
    for _ in range(buffered):
        full.add(decode(data), 0)
    return {
        "tokens_per_group": sum(len(t.tokens) for t in group.trajectories),
        "bytes": len(data),
        "decode": cpu_per_call(lambda: decode(data)),
        "journal": cpu_per_call(lambda: journal.append(encode(group))),
        "ledger": cpu_per_call(record),
        "rollout_stats": cpu_per_call(lambda: stats.add(group, 0)),
        "buffer_add": cpu_per_call(lambda: new_buffer().add(group, 0)),
        "take_scan": cpu_per_call(lambda: full.take(buffered + 1, 0)) / buffered,
    }


def print_ingest(rows: list[dict[str, float]], buffered: int) -> None:
    print(
        "\nlearner ingest per group, in process (thread CPU ms; a real group, episodes repeated to length; the take "
        f"scan is per buffered group, {buffered} buffered, and runs at every poll)"
    )
    print(
        "| tokens/group | KiB | decode | journal (encode + append) | ledger | rollout stats | buffer add | sum | "
        "take scan per buffered group |"
    )
    print("| ---: |" + " ---: |" * 8)
    for r in rows:
        total = sum(r[k] for k in ("decode", "journal", "ledger", "rollout_stats", "buffer_add"))
        cells = " | ".join(f"{1000 * r[k]:.3f}" for k in ("decode", "journal", "ledger", "rollout_stats", "buffer_add"))
        print(
            f"| {r['tokens_per_group']:.0f} | {r['bytes'] / 1024:.0f} | {cells} | {1000 * total:.3f} | "
            f"{1000 * r['take_scan']:.4f} |"
        )


# ----------------------------------------------------------------------------------- printing


def print_points(results: list[dict]) -> None:
    print(
        "\n| actors x engines x group | groups/s | episodes/s | tokens/group | learner CPU ms/group "
        "(get+accept+take) | actor CPU ms/episode | cores: learner (main thread) / actors / engines | "
        "delivery p50 / p99 s | staleness 0/1/2+ | turn s at actor / engine | push pause s | load |"
    )
    print("| --- |" + " ---: |" * 11)
    for r in results:
        st, use, parts = r["staleness"], r["core_use"], r["learner_parts_ms_per_group"]
        two = sum(v for k, v in st.items() if int(k) >= 2)
        actors = sum(v for n, v in use.items() if n.startswith("actor"))
        push = statistics.median(r["push_s"]) if r["push_s"] else float("nan")
        print(
            f"| {r['point']} | {r['groups_per_s']:.1f} | {r['episodes_per_s']:.0f} | {r['tokens_per_group']:.0f} | "
            f"{r['learner_ms_per_group']:.2f} ({sum(parts.values()):.2f}) | {r['actor_ms_per_episode']:.2f} | "
            f"{use.get('learner', 0):.2f} ({r['learner_main_thread_core']:.2f}) / {actors:.2f} / "
            f"{use.get('engines', 0):.2f} | {r['delivery_p50_s']:.3f} / {r['delivery_p99_s']:.3f} | "
            f"{st.get('0', 0):.2f}/{st.get('1', 0):.2f}/{two:.2f} | "
            f"{r['turn_s_actor']:.3f} / {r['turn_s_engine']:.3f} | {push:.2f} | {r['load']:.1f} |"
        )


def print_learner_parts(results: list[dict]) -> None:
    keys = [key for key, _, _ in METERED] + ["other", "gc"]
    print(
        "\nlearner CPU by part, ms per second of the window (per group: get, accept, take; per step: batch, push; "
        "gc: the collector's pauses, inside the other parts)"
    )
    print("| point | groups/s | steps/s | " + " | ".join(keys) + " | total |")
    print("| --- |" + " ---: |" * (len(keys) + 3))
    for r in results:
        parts = r["learner_parts_cpu_s"]
        if not parts:
            continue
        per_s = {k: 1000 * v / parts["seconds"] for k, v in parts.items()}
        cells = " | ".join(f"{per_s.get(k, 0.0):.1f}" for k in keys)
        print(
            f"| {r['point']} | {r['groups_per_s']:.1f} | {r['steps'] / r['window_s']:.2f} | {cells} | {per_s['total']:.1f} |"
        )


def print_idle(results: list[dict]) -> None:
    print("\n| engines | learner, idle (% of a core) | one actor, idle (% of a core) | load |")
    print("| ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['engines']} | {100 * r['learner_core']:.1f} | {100 * r['actor_core']:.1f} | {r['load']:.1f} |")
    if len(results) >= 2:
        lo, hi = results[0], results[-1]
        n = hi["engines"] - lo["engines"]
        per_l = 1000 * (hi["learner_core"] - lo["learner_core"]) / n
        per_a = 1000 * (hi["actor_core"] - lo["actor_core"]) / n
        print(f"per engine (slope): learner {per_l:.3f} ms CPU/s, each actor process {per_a:.3f} ms CPU/s")


def summary_line(r: dict) -> str:
    return (
        f"[{r['startup_s']:.0f} s to the first group, {r['stop_s']:.0f} s to stop] scale {r['point']}: {r['groups_per_s']:.2f} groups/s, learner {r['learner_ms_per_group']:.2f} ms CPU/group, "
        f"actors {r['actor_ms_per_episode']:.2f} ms CPU/episode, delivery p50 {r['delivery_p50_s']:.3f} s "
        f"p99 {r['delivery_p99_s']:.3f} s"
    )


# ----------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("driver", "learner"), default="driver", help=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--profile", default="", help=argparse.SUPPRESS)
    p.add_argument("--points", default=DEFAULT_POINTS, help="actors x engines x group [x tokens/turn], comma-separated")
    p.add_argument("--idle-engines", default="1,256", help="engine counts of the idle table ('' skips it)")
    p.add_argument("--ingest-factors", default="1,8,32", help="episode lengths (x the sample's) of the ingest table")
    p.add_argument("--concurrency", type=int, default=128, help="actors.num_concurrent_episodes per actor")
    p.add_argument("--warmup-s", type=float, default=4.0)
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--staleness", type=int, default=1, help="actors/learner.max_staleness")
    p.add_argument("--groups-per-step", type=int, default=0, help="0: the open groups of all actors (no gating)")
    p.add_argument("--out-tokens", type=int, default=32, help="mean tokens of a simulated turn")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=1024)
    p.add_argument("--decode-s-per-step", type=float, default=0.004)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--tool-rate", type=float, default=0.6)
    p.add_argument("--train-s-per-token", type=float, default=1e-6)
    p.add_argument("--push-s", type=float, default=0.2, help="simulated broadcast time of a push")
    p.add_argument("--model", default="", help="tokenizer folder (default: runs/models/tiny, built when absent)")
    p.add_argument("--workdir", default=None, help="where each point's folder goes (default: a temp folder)")
    p.add_argument("--json", type=Path, default=None, help="also write every result here")
    p.add_argument("-s", "--set", action="append", default=[], help="extra config override (repeatable)")
    p.add_argument("--profile-learner", action="store_true", help="cProfile (CPU time) the learner: learner.prof")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args(argv)
    if args.smoke:
        given = {a.split("=")[0][2:].replace("-", "_") for a in (argv or sys.argv[1:]) if a.startswith("--")}
        for key, value in SMOKE.items():
            if key not in given:
                setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.role == "learner":
        run_learner(args.config, args.result, args.push_s, args.train_s_per_token, args.profile)
        return
    if not args.model:
        from agentrl.models.builder import ensure_model

        args.model = str(ensure_model(ROOT / "runs" / "models" / "tiny", "tiny"))
    print("load average (1/5/15 min): {:.2f} {:.2f} {:.2f} on {} cores".format(*os.getloadavg(), os.cpu_count()))
    if args.workdir:
        sweep(args)
        return
    with tempfile.TemporaryDirectory(prefix="agentrl-scale-") as tmp:  # every point's processes, logs and run folder
        args.workdir = tmp
        sweep(args)


def sweep(args: argparse.Namespace) -> None:
    """Every point, the learner's parts, the ingest table and the idle table, printed as they come."""
    results = []
    for text in args.points.split(","):
        results.append(run_point(Point.parse(text), args))
        print(summary_line(results[-1]), flush=True)
    print_points(results)
    print_learner_parts(results)
    samples = sorted(Path(args.workdir).glob("scale-*/sample_group.bin"), key=os.path.getmtime)
    if samples and args.ingest_factors:
        factors = tuple(int(f) for f in args.ingest_factors.split(","))
        print_ingest(ingest_costs(samples[-1], factors), 256)
    idle = [run_idle(int(n), args) for n in args.idle_engines.split(",") if n]
    if idle:
        print_idle(idle)
    if args.json:
        args.json.write_text(json.dumps({"points": results, "idle": idle}, indent=1))


if __name__ == "__main__":
    main()
