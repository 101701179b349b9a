"""Exactly-once trajectories across crashes, with real processes: ``agentrl learn`` and
``agentrl serve-actors`` over real ZMQ, a scripted engine over real HTTP. The learner is
killed with SIGKILL mid-run and resumed while the actor keeps running; later the actor is
killed and restarted. Duplicates are injected on the wire. At the end every group the actors
produced is accounted for exactly once, and no group was trained twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import zmq

from agentrl.net import free_port
from agentrl.protocol import Progress, Trajectory, TrajectoryGroup, decode, encode
from tests._actors_helpers import ScriptedEngine, TurnScript, load_tokenizer
from tests._actors_user_env import solver
from tests._learner_helpers import PYTHON, subprocess_env, tiny_model  # noqa: F401

MAX_STEPS = 9  # the last step needs the restarted actor's groups: see step 3 of the test
GROUPS_PER_STEP = 2


class VersionFollower:
    """Plays the weight push for the scripted engine: its weight version follows the learner's."""

    def __init__(self, endpoint: str, engine: ScriptedEngine) -> None:
        self.engine, self.stop = engine, threading.Event()
        self.last: Progress | None = None
        self.thread = threading.Thread(target=self._run, args=(endpoint,), daemon=True)
        self.thread.start()

    def _run(self, endpoint: str) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        while not self.stop.is_set():
            if sub.poll(100):
                msg = decode(sub.recv())
                self.last = msg
                self.engine.version = msg.policy_version
        sub.close(0)
        ctx.term()


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with log.open("a") as out:
        return subprocess.Popen(
            cmd,
            cwd=Path(__file__).resolve().parents[1],
            env=subprocess_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for(predicate, what: str, timeout_s: float, procs: dict[str, subprocess.Popen], logs: dict[str, Path]):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} died ({proc.returncode}):\n{logs[name].read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def metrics_steps(run_dir: Path) -> list[int]:
    path = run_dir / "learner_metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass  # a line the kill cut short
    return out


def dumped_groups(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # cut short by SIGKILL: stamped but never sent (the dump comes first)
    return out


def group_from_dump(d: dict) -> TrajectoryGroup:
    trajs = [
        Trajectory(
            tokens=t["tokens"],
            loss_mask=t["loss_mask"],
            behavior_logprobs=t["behavior_logprobs"],
            weight_versions=t["weight_versions"],
            reward=t["reward"],
        )
        for t in d["trajectories"]
    ]
    return TrajectoryGroup(
        group_id=d["group_id"],
        task_id=d["task_id"],
        env=d["env"],
        trajectories=trajs,
        actor_id=d["actor_id"],
        session=d["session"],
        seq=d["seq"],
    )


def ledger_keys(state: dict) -> set[tuple]:
    return {(a, s, seq) for a, s, ranges in state["sessions"] for lo, hi in ranges for seq in range(lo, hi + 1)}


@pytest.mark.timeout(900)
def test_kill_9_of_learner_and_actor_loses_and_duplicates_nothing(tiny_model, tmp_path):
    traj, prog = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    dump = tmp_path / "produced.jsonl"
    tokenizer = load_tokenizer(tiny_model)
    logs = {name: tmp_path / f"{name}.log" for name in ("learner", "actor")}
    with ScriptedEngine(TurnScript(tokenizer, solver)) as engine:
        config = tmp_path / "run.toml"
        config.write_text(f"""
[run]
run_dir = "{run_dir}"
torch_num_threads = 1
[model]
path = "{tiny_model}"
[engine]
urls = ["{engine.url}"]
request_retries = 0
[actors]
group_size = 2
num_concurrent_episodes = 4
max_staleness = 1
max_new_tokens_per_turn = 64
trajectory_endpoint = "{traj}"
progress_endpoint = "{prog}"
[env]
cls = "tests._actors_user_env:AddEnv"
max_total_tokens = 512
[learner]
device = "cpu"
groups_per_step = {GROUPS_PER_STEP}
max_steps = {MAX_STEPS}
max_staleness = 1
max_tokens_per_microbatch = 512
checkpoint_every_steps = 2
dynamic_sampling = false
wait_log_interval_s = 2.0
[tracking]
enabled = false
""")
        # the learner pushes no weights (the scripted engine has no weight API); the follower plays that part
        learn = [PYTHON, "-m", "agentrl", "learn", "--config", str(config), "--set", "engine.urls=[]"]
        actor = [
            PYTHON,
            "-m",
            "agentrl",
            "serve-actors",
            "--config",
            str(config),
            "--wait-for-learner",
            "--dump-trajectories",
            str(dump),
            "--log-interval-s",
            "2",
        ]
        follower = VersionFollower(prog, engine)
        procs: dict[str, subprocess.Popen] = {}
        end = time.monotonic() + 840  # every wait within the test's 900 s, so a slow run fails here and is killed

        def left(cap_s: float) -> float:
            return max(1.0, min(cap_s, end - time.monotonic()))

        try:
            procs["learner"] = start(learn, logs["learner"])
            procs["actor"] = start(actor, logs["actor"])
            wait_for(lambda: max(metrics_steps(run_dir), default=0) >= 3, "step 3", left(400), procs, logs)

            # 1. SIGKILL the learner after a checkpoint (step 2) and a step past it; the actor keeps going
            kill(procs["learner"])  # the actor sends into the void while the new learner starts (seconds of imports)
            procs["learner"] = start(learn, logs["learner"])
            wait_for(lambda: "resumed from" in logs["learner"].read_text(), "the resume", left(300), procs, logs)

            # 2. duplicates on the wire: the first group ever produced, three more times
            first = group_from_dump(dumped_groups(dump)[0])
            ctx = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            push.linger = 2000
            push.connect(traj)
            for _ in range(3):
                push.send(encode(first))

            # 3. SIGKILL the actor later on; a new actor process (same index) continues its budget. At step
            # 4 the learner holds groups for steps 5 and 6 at most (the budget: max_staleness 1), so the kill
            # lands by step 6, and the dead actor's last budget reached step 8: step 9 needs the new actor
            wait_for(lambda: max(metrics_steps(run_dir), default=0) >= 4, "step 4", left(400), procs, logs)
            kill(procs["actor"])
            procs["actor"] = start(actor, logs["actor"])

            procs["learner"].wait(timeout=left(400))
            assert procs["learner"].returncode == 0, logs["learner"].read_text()[-4000:]
            procs["actor"].wait(timeout=left(60))  # the learner's `done` reaches it
            assert procs["actor"].returncode == 0, logs["actor"].read_text()[-4000:]
            push.close()
            ctx.term()
        finally:
            follower.stop.set()
            for proc in procs.values():
                kill(proc)
    learner_log, actor_log = logs["learner"].read_text(), logs["actor"].read_text()

    # the final checkpoint: what the learner holds, its counters and ledger
    from agentrl.learner.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir / "checkpoints" / "learn")
    assert ckpt.name == f"step_{MAX_STEPS:08d}"
    caller = torch.load(ckpt / "trainer_state.pt", weights_only=True)["caller"]
    counters, received = caller["counters"], ledger_keys(caller["ledger"])
    pending = len(__import__("msgpack").unpackb((ckpt / "pending_groups.bin").read_bytes()))

    # the resumed learner got back what arrived after its checkpoint from the journal, and the
    # actor resent what the dead learner had not acknowledged
    replayed = [
        int(line.split(" groups from the journal")[0].rsplit(", ", 1)[1])
        for line in learner_log.splitlines()
        if "groups from the journal" in line
    ]
    assert replayed and replayed[0] > 0, learner_log[-3000:]
    assert "the learner restarted" in actor_log

    # accounting: received = consumed + dropped (by reason) + held; duplicates are not received
    dropped = {k: v for k, v in counters.items() if k.startswith("dropped_")}
    assert counters["received"] == len(received)
    assert counters["received"] == counters["consumed"] + sum(dropped.values()) + pending, counters
    assert counters["consumed"] == GROUPS_PER_STEP * MAX_STEPS
    assert counters["duplicate"] >= 3  # the injected copies (and any needless resends)

    # produced = received + abandoned in flight; the learner invented nothing
    produced_groups = dumped_groups(dump)
    produced = [(d["actor_id"], d["session"], d["seq"]) for d in produced_groups]
    assert len(produced) == len(set(produced))
    assert received <= set(produced)
    sessions = list(dict.fromkeys(s for _, s, _ in produced))
    assert len(sessions) == 2  # the actor process before and after its SIGKILL
    # the second actor stopped cleanly: what the learner does not have is exactly what it reports unacknowledged
    report = json.loads(next(line for line in reversed(actor_log.splitlines()) if line.startswith("{")))
    assert report["session"] == sessions[1]
    second = {k for k in produced if k[1] == sessions[1]}
    assert len(second - received) == report["groups_produced"] - report["groups_acked"]
    assert report["groups_produced"] == len(second)

    # nothing trained twice: the groups of each step that the final weights saw (the last line per step)
    last_batch: dict[int, list] = {}
    for line in (run_dir / "learner_batches.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        last_batch[row["step"]] = [tuple(k) for k in row["groups"]]
    assert sorted(last_batch) == list(range(1, MAX_STEPS + 1))
    trained = Counter(k for keys in last_batch.values() for k in keys)
    assert max(trained.values()) == 1 and sum(trained.values()) == counters["consumed"]
    assert set(trained) <= received
