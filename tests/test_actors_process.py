"""`agentrl serve-actors` as a real process: groups over ZMQ to a receiver in the test, gating
on published progress (max_staleness = 0 is synchronous), a JSONL dump, and SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agentrl.net import free_port
from agentrl.protocol import Progress, TrajectoryGroup
from agentrl.transport import GroupReceiver, ProgressPublisher
from tests._actors_helpers import ScriptedEngine, TurnScript, load_tokenizer, tiny_tokenizer_dir
from tests._actors_user_env import solver

ROOT = Path(__file__).resolve().parents[1]


class Learner:
    """The learner's end of the wire: a PULL for groups and a PUB for progress."""

    def __init__(self) -> None:
        self.groups_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.progress_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.receiver = GroupReceiver(self.groups_endpoint, bind=True)
        self.publisher = ProgressPublisher(self.progress_endpoint, bind=True)
        self.groups: list[TrajectoryGroup] = []

    def publish(self, progress: Progress) -> None:
        self.publisher.publish(progress)

    def poll(self, timeout_s: float) -> TrajectoryGroup | None:
        group = self.receiver.get(timeout_s=timeout_s)
        if group is not None:
            assert isinstance(group, TrajectoryGroup)
            self.groups.append(group)
        return group

    def serve_until(self, progress: Progress, n_groups: int, timeout_s: float) -> None:
        """Publish ``progress`` (again and again: PUB/SUB drops messages before the subscription)
        until ``n_groups`` groups have arrived."""
        deadline = time.monotonic() + timeout_s
        while len(self.groups) < n_groups:
            assert time.monotonic() < deadline, f"only {len(self.groups)} of {n_groups} groups arrived"
            self.publish(progress)
            self.poll(0.1)

    def close(self) -> None:
        self.receiver.close()
        self.publisher.close()


def test_serve_actors_process(tmp_path_factory, tmp_path):
    tok_dir = tiny_tokenizer_dir(tmp_path_factory)
    tokenizer = load_tokenizer(tok_dir)
    learner = Learner()
    dump = tmp_path / "groups.jsonl"
    with ScriptedEngine(TurnScript(tokenizer, solver), version=0) as engine:
        config = tmp_path / "run.toml"
        config.write_text(f"""
[model]
path = "{tok_dir}"
[engine]
urls = ["{engine.url}"]
request_retries = 0
[actors]
group_size = 2
num_concurrent_episodes = 4
max_staleness = 0
max_new_tokens_per_turn = 64
trajectory_endpoint = "{learner.groups_endpoint}"
progress_endpoint = "{learner.progress_endpoint}"
[learner]
max_staleness = 0
[env]
cls = "tests._actors_user_env:AddEnv"
kwargs = {{ num_tasks = 50 }}
max_total_tokens = 1024
""")
        cmd = [
            sys.executable,
            "-m",
            "agentrl",
            "serve-actors",
            "--config",
            str(config),
            "--wait-for-learner",
            "--dump-trajectories",
            str(dump),
            "--log-interval-s",
            "1",
        ]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        stderr_path = tmp_path / "actor.stderr"
        with stderr_path.open("w") as stderr:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            # step 0: a budget of 3 groups at version 0; the actor starts exactly those
            learner.serve_until(Progress(policy_version=0, accept_groups=3, max_staleness=0), 3, timeout_s=60)
            assert learner.poll(1.0) is None  # nothing beyond the budget
            engine.version = 1  # weights pushed
            learner.serve_until(Progress(policy_version=1, accept_groups=6, step=1, max_staleness=0), 6, timeout_s=30)
            assert [g.oldest_version() for g in learner.groups] == [0, 0, 0, 1, 1, 1]
            # a slow engine and a large budget: episodes are in flight when SIGTERM arrives
            engine.delay_s = 1.0
            asked = len(engine.requests)
            deadline = time.monotonic() + 20
            while len(engine.requests) < asked + 2:  # the first slow turns have been answered
                assert time.monotonic() < deadline
                learner.publish(Progress(policy_version=1, accept_groups=1000, step=2, max_staleness=0))
                learner.poll(0.1)
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
            while learner.poll(0.5) is not None:  # what the actor flushed on its way out
                pass
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            learner.close()
    log = stderr_path.read_text()
    assert proc.returncode == 0, log[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["stop_reason"] == "received SIGTERM"
    assert report["groups_abandoned"] >= 1 and report["episodes_abandoned"] == 2 * report["groups_abandoned"]
    assert report["groups_delivered"] == len(learner.groups) and report["groups_unsent"] == 0
    assert report["groups_lost"] == 0 and report["reward_mean"] == 1.0
    assert f"abandoned {report['groups_abandoned']} groups" in log
    assert "turns/s" in log  # periodic metrics
    dumped = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [d["group_id"] for d in dumped] == [g.group_id for g in learner.groups]
    for d, g in zip(dumped, learner.groups):
        for t, tg in zip(d["trajectories"], g.trajectories):
            assert t["tokens"] == tg.tokens.tolist() and t["weight_versions"] == tg.weight_versions.tolist()
            assert t["metadata"]["messages"] == tg.metadata["messages"]
            assert tg.metadata["env"] == "add" and tg.metadata["num_turns"] == 2


def test_serve_actors_config_errors(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[actors]\ngroup_size = 2\nnum_episodes = 3\n")
    res = subprocess.run(
        [sys.executable, "-m", "agentrl", "serve-actors", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "unknown key 'actors.num_episodes'" in res.stderr
    config.write_text(f'[model]\npath = "{tmp_path}/nothing"\n')
    res = subprocess.run(
        [sys.executable, "-m", "agentrl", "serve-actors", "--config", str(config), "--no-send"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "--no-send without --dump-trajectories" in res.stderr
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrl",
            "serve-actors",
            "--config",
            str(config),
            "--no-send",
            "--dump-trajectories",
            str(tmp_path / "d.jsonl"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "no tokenizer at model.path" in res.stderr


def test_serve_actors_runs_several_envs_one_an_agent_env(tmp_path_factory, tmp_path):
    """[[envs]] with a built-in-style env and an AgentEnv in one real actor process (the real engine client
    and agent endpoint, no learner): both envs' groups are dumped, each from one env; a name clash is refused."""
    from tests._actors_user_env import prompt_solver

    tok_dir = tiny_tokenizer_dir(tmp_path_factory)
    tokenizer = load_tokenizer(tok_dir)
    dump = tmp_path / "groups.jsonl"
    envs = """
[[envs]]
cls = "tests._actors_user_env:AddEnv"
weight = 1.0
[[envs]]
cls = "tests._actors_user_env:AddAgentEnv"
kwargs = { rewrite_history = true }
weight = 1.0
max_turns = 3
"""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with ScriptedEngine(TurnScript(tokenizer, prompt_solver), version=4) as engine:
        config = tmp_path / "run.toml"
        config.write_text(f"""
[model]
path = "{tok_dir}"
[engine]
urls = ["{engine.url}"]
request_retries = 0
[actors]
group_size = 2
num_concurrent_episodes = 4
max_new_tokens_per_turn = 64
{envs}""")
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "agentrl",
                "serve-actors",
                "--config",
                str(config),
                "--no-send",
                "--dump-trajectories",
                str(dump),
                "--max-groups",
                "8",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    dumped = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(dumped) == 8 == report["groups_delivered"] and report["groups_lost"] == 0
    assert {d["env"] for d in dumped} == {"add", "add-agent"}
    for d in dumped:
        assert {t["metadata"]["env"] for t in d["trajectories"]} == {d["env"]}
        assert all(t["metadata"]["success"] and t["reward"] == 1.0 for t in d["trajectories"])
        assert all(set(t["weight_versions"]) == {-1, 4} for t in d["trajectories"])
        if d["env"] == "add-agent":
            assert [t["metadata"]["sequence_index"] for t in d["trajectories"]] == [0, 1, 0, 1]
    assert sum(r["episodes"] for r in report["by_env"].values()) == report["episodes"] == 16
    assert "env(s) add (weight 1), add-agent (weight 1)" in res.stderr

    config.write_text(config.read_text().replace("max_turns = 3", 'max_turns = 3\nname = "add"'))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrl",
            "serve-actors",
            "--config",
            str(config),
            "--no-send",
            "--dump-trajectories",
            str(dump),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "env names must be unique" in res.stderr and "'add'" in res.stderr
