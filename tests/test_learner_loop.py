"""The `learn` loop: in memory, and end to end through the CLI over real ZMQ sockets."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time

import numpy as np
import pytest

from agentrl.net import free_port
from agentrl.protocol import ActorAck, Progress, decode, encode
from tests._learner_helpers import (  # noqa: F401
    PYTHON,
    ListSource,
    Recorder,
    learner_overrides,
    make_agent_group,
    make_group,
    subprocess_env,
    tiny_model,
)


def test_loop_keeps_pending_groups_and_pushes_weights(tiny_model, tmp_path):
    from agentrl.config import load_config
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.loop import Learner, LearnerIO

    init_distributed("cpu")
    rng = np.random.default_rng(0)
    rec = Recorder()
    cfg = load_config(None, learner_overrides(tiny_model, tmp_path, **{"learner.max_steps": 1}))
    groups = [make_group(rng, group_id=f"a{i}", session="s1", seq=i) for i in range(3)]
    groups.insert(2, make_group(rng, group_id="a1-again", session="s1", seq=1))  # sent twice
    first = Learner(cfg, io=LearnerIO(source=ListSource(groups, empty_polls=2), progress=rec, weights=rec))
    assert first.run() == "done"
    assert first.trainer.step == 1 and first.version == 1
    assert [v for v, _ in rec.pushes] == [1]
    assert "model.layers.0.mlp.up_proj.weight" in rec.pushes[0][1]
    p0 = rec.progress[0]
    assert (p0.policy_version, p0.accept_groups, p0.step, p0.max_staleness) == (0, 2 * 1 * 2, 0, 1)
    assert p0.actors == [] and p0.learner_session == first.session
    last = rec.progress[-1]
    assert last.done and last.policy_version == 1
    assert last.actors == [ActorAck("test-actor", groups=3, session="s1", session_groups=3, acked=[(0, 2)])]
    assert first.buffer.counters["duplicate"] == 1 and first.buffer.counters["received"] == 3

    # a restart resumes at step 2 with the group that was waiting, re-pushes its weights first
    rec2 = Recorder()
    cfg = load_config(None, learner_overrides(tiny_model, tmp_path, **{"learner.max_steps": 2}))
    stale = make_group(rng, version=0, group_id="late")
    resent = make_group(rng, group_id="a0-resent", session="s1", seq=0)  # an actor resends after the restart
    source = ListSource([resent, make_group(rng, version=1, group_id="b"), stale])
    second = Learner(cfg, io=LearnerIO(source=source, progress=rec2, weights=rec2))
    assert second.run() == "done"
    assert rec2.progress[0].learner_session == second.session != first.session
    assert rec2.progress[0].actors == last.actors  # what the first learner acknowledged, from its checkpoint
    assert second.buffer.counters["duplicate"] == 2
    assert second.trainer.step == 2 and second.version == 2
    assert [v for v, _ in rec2.pushes] == [1, 2]
    rows = [json.loads(line) for line in (tmp_path / "learner_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["data/received"] == 3 + 2  # counters survive the restart; duplicates are not received
    # step 2 trained the group that was pending (version 0, now one behind) and "b" (current)
    assert rows[-1]["staleness/1"] == 0.5 and rows[-1]["staleness/0"] == 0.5
    assert len(second.buffer) == 1  # "late" waits for the next step (and is in the checkpoint)
    for key in ("reward/mean", "advantage/std", "policy/clip_frac", "time/wait_data_s", "throughput/tokens_per_s"):
        assert key in rows[-1]


def test_loop_trains_agent_groups_per_episode_and_reports_per_env(tiny_model, tmp_path):
    """Groups of agent episodes (several sequences each) next to one-sequence groups of another env:
    rewards and advantages are per episode, metrics per env, and both kinds train in one step."""
    from agentrl.config import load_config
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.loop import Learner, LearnerIO

    init_distributed("cpu")
    rng = np.random.default_rng(11)
    cfg = load_config(
        None,
        learner_overrides(
            tiny_model,
            tmp_path,
            **{"learner.max_steps": 1, "learner.groups_per_step": 3, "learner.loss_normalization": '"sequence"'},
        ),
    )
    agent = [
        make_agent_group(rng, [3, 1, 2, 1], [1.0, 0.0, 0.0, 0.0], env="calc-agent", group_id=f"a{i}", success=True)
        for i in range(2)
    ]
    uniform = make_agent_group(rng, [2, 2, 1, 1], [1.0, 1.0, 1.0, 1.0], env="calc-agent", group_id="u", success=True)
    plain = make_group(rng, rewards=[1, 0, 1, 0], group_id="p")
    plain.env = "calculator"
    rec = Recorder()
    learner = Learner(
        cfg, io=LearnerIO(source=ListSource([agent[0], uniform, plain, agent[1]]), progress=rec, weights=rec)
    )
    assert learner.run() == "done" and learner.trainer.step == 1
    [row] = [json.loads(line) for line in (tmp_path / "learner_metrics.jsonl").read_text().splitlines()]
    assert row["batch/groups"] == 3 and row["batch/episodes"] == 12 and row["batch/sequences"] == 7 + 7 + 4
    assert row["reward/mean"] == (0.25 + 0.25 + 0.5) / 3  # per episode; per sequence it would be 3/7 per agent group
    # episode 0 (three sequences, +0.75 each) outnumbers the others' sequences: per-sequence GRPO would average 0
    assert row["advantage/mean"] == pytest.approx(2 * (3 * 0.75 - 3 * 0.25 - 0.25) / 18, abs=1e-6)
    assert (row["env/calc-agent/received"], row["env/calc-agent/accepted"]) == (3, 2)
    assert row["env/calc-agent/dropped_zero_variance"] == 1  # its episodes all scored 1 (its sequences too)
    assert row["env/calc-agent/success_recent"] == pytest.approx((1 + 1 + 4) / 12)
    assert row["env/calculator/accepted"] == 1 and row["env/calculator/reward_recent"] == 0.5
    assert np.isfinite(row["loss/total"])


def test_loop_waits_for_data_then_gives_up_cleanly(tiny_model, tmp_path):
    from agentrl.config import load_config
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.loop import Learner, LearnerIO

    init_distributed("cpu")
    rec = Recorder()
    cfg = load_config(None, learner_overrides(tiny_model, tmp_path, **{"learner.max_wait_for_data_s": 1.0}))
    # one group of the two a step needs: the wait's clock runs once data flows (none: it waits on)
    one = [make_group(np.random.default_rng(0), group_id="only", session="s", seq=0)]
    learner = Learner(cfg, io=LearnerIO(source=ListSource(one), progress=rec, weights=rec))
    assert learner.run() == "data_timeout"
    assert learner.trainer.step == 0 and rec.progress and not rec.progress[-1].done
    assert (tmp_path / "checkpoints" / "learn" / "latest").exists()


def test_a_learner_starved_by_zero_variance_groups_says_so(tiny_model, tmp_path, caplog):
    """A warm start with almost no successes: every group's rewards are equal, dynamic sampling
    drops them all and no batch fills. The learner says so in plain words, and its counts by
    reason are in learner_status.json as they happen (the live table and summary read it)."""
    import logging

    from agentrl.config import load_config
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.loop import Learner, LearnerIO

    init_distributed("cpu")
    rng = np.random.default_rng(0)
    flat = [make_group(rng, group_id=f"z{i}", session="s", seq=i, rewards=[0.0] * 4) for i in range(12)]
    cfg = load_config(
        None,
        learner_overrides(
            tiny_model,
            tmp_path,
            **{
                "learner.max_wait_for_data_s": 1.5,
                "learner.wait_log_interval_s": 0.5,
                "learner.dynamic_sampling": "true",
            },
        ),
    )
    learner = Learner(cfg, io=LearnerIO(source=ListSource(flat), progress=Recorder(), weights=Recorder()))
    with caplog.at_level(logging.WARNING, logger="agentrl.learner"):
        assert learner.run() == "data_timeout"
    status = json.loads((tmp_path / "learner_status.json").read_text())
    assert status["received"] == 12 and status["dropped"] == {"zero_variance": 12} and status["consumed"] == 0
    assert status["buffered"] == 0 and status["groups_per_step"] == 2 and status["waiting_s"] > 1.0
    assert "12 of the 12 groups received" in status["warning"]
    for advice in ("stronger", "easier", "actors.group_size larger", "learner.dynamic_sampling = false"):
        assert advice in status["warning"]
    assert any("GRPO learns nothing from those" in r.getMessage() for r in caplog.records)


def test_a_learner_that_died_before_any_checkpoint_leaves_nothing_it_acknowledged_behind(tiny_model, tmp_path):
    """The first learner receives and acknowledges three groups (journaled), trains one step and
    dies before any checkpoint (it writes none: what a SIGKILL before the first one leaves). The next
    learner in the run folder has no checkpoint, continues the dead one's journal from the start,
    so the acknowledged groups are held again (their resend is a duplicate), and trains on."""
    from agentrl.config import load_config
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.loop import Learner, LearnerIO

    init_distributed("cpu")
    rng = np.random.default_rng(1)
    groups = [make_group(rng, group_id=f"a{i}", session="s1", seq=i) for i in range(3)]
    first = Learner(
        load_config(None, learner_overrides(tiny_model, tmp_path, **{"learner.max_steps": 1})),
        io=LearnerIO(source=ListSource(list(groups)), progress=Recorder(), weights=None),
    )
    first._checkpoint = lambda: 0.0  # dies before writing any
    assert first.run() == "done"
    assert not (tmp_path / "checkpoints" / "learn").exists() or not any((tmp_path / "checkpoints" / "learn").iterdir())

    rec = Recorder()
    resent = make_group(rng, group_id="a2-resent", session="s1", seq=2)
    second = Learner(
        load_config(None, learner_overrides(tiny_model, tmp_path, **{"learner.max_steps": 1})),
        io=LearnerIO(
            source=ListSource([resent, make_group(rng, group_id="b", session="s2", seq=0)]), progress=rec, weights=None
        ),
    )
    assert second.run() == "done"
    assert second.lineage == first.lineage
    assert rec.progress[0].actors == [
        ActorAck("test-actor", groups=3, session="s1", session_groups=3, acked=[(0, 2)])
    ]  # before anything new arrived
    assert second.buffer.counters["duplicate"] == 1
    assert second.buffer.counters["received"] == 4 and second.buffer.counters["consumed"] == 2


def test_learn_cli_over_zmq_survives_restart(tiny_model, tmp_path):
    """`agentrl learn` trains from groups sent over ZMQ, drops malformed and stale ones, logs to
    MLflow and stops cleanly on SIGTERM with a checkpoint; a restart resumes from it."""
    import zmq

    traj, prog = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    config = tmp_path / "learn.toml"
    config.write_text(
        f"""
[run]
run_dir = "{run_dir}"
torch_num_threads = 1
[model]
path = "{tiny_model}"
[actors]
group_size = 4
trajectory_endpoint = "{traj}"
progress_endpoint = "{prog}"
[learner]
device = "cpu"
groups_per_step = 2
max_steps = 10
max_tokens_per_microbatch = 128
checkpoint_every_steps = 2
wait_log_interval_s = 1.0
[tracking]
enabled = true
"""
    )
    ctx = zmq.Context.instance()
    rng = np.random.default_rng(1)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(traj)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(prog)
    log_path = tmp_path / "learn.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [PYTHON, "-m", "agentrl", "learn", "--config", str(config)],
            env=subprocess_env(),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    end = time.monotonic() + 500  # every wait within the test's 600 s (the restart below needs the rest)

    def wait_version(version: int, timeout_s: float = 150.0) -> Progress:
        deadline = min(time.monotonic() + timeout_s, end)
        while time.monotonic() < deadline:
            if sub.poll(200):
                msg = decode(sub.recv())
                if msg.policy_version >= version:
                    return msg
            assert proc.poll() is None, log_path.read_text()[-4000:]
        raise AssertionError(f"no progress with version {version}")

    def wait_logged(text: str, after: int, timeout_s: float = 60.0) -> None:
        """Until the log has ``text`` beyond its first ``after`` characters."""
        deadline = min(time.monotonic() + timeout_s, end)
        while text not in log_path.read_text()[after:]:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, f"{text!r} not logged in {timeout_s} s"
            time.sleep(0.05)

    try:
        first = wait_version(0)
        assert first.accept_groups == 2 * 1 * 2 and not first.done
        push.send(b"\x93not a group")  # malformed: counted by the transport, dropped
        push.send(encode(make_group(rng, version=0, rewards=[1e300, 0, 0, 1])))  # the border: malformed_reward
        push.send(encode(make_group(rng, version=0, rewards=[float("nan"), 0, 1, 0])))
        twice = encode(make_group(rng, version=0))
        push.send(twice)
        push.send(twice)  # a duplicate: counted, trained once
        push.send(encode(make_group(rng, version=0)))
        wait_version(1)
        push.send(encode(make_group(rng, version=1, rewards=[1, 1, 1, 1])))  # zero variance
        push.send(encode(make_group(rng, version=1)))
        push.send(encode(make_group(rng, version=0)))  # staleness 1: still fine
        wait_version(2)
        push.send(encode(make_group(rng, version=0)))  # staleness 2 > max_staleness 1: dropped
        push.send(encode(make_group(rng, version=2)))
        push.send(encode(make_group(rng, version=2)))
        assert wait_version(3).step == 3
        logged = len(log_path.read_text())
        wait_logged("waiting for trajectory groups", after=logged)  # it waits for data (and says so in its log) ...
        proc.send_signal(signal.SIGTERM)  # ... then stop it: a clean stop with a checkpoint
        proc.wait(timeout=max(1.0, min(120.0, end - time.monotonic())))
        out = log_path.read_text()
        assert proc.returncode == 0, out[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "stopping after the current step" in out and "waiting for trajectory groups" in out
    rows = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    last = rows[-1]
    assert last["transport/malformed"] == 1
    assert last["data/dropped_malformed_reward"] == 2 and last["data/duplicate"] == 1
    assert np.isfinite(rows[0]["loss/total"]) and np.isfinite(rows[0]["grad_norm"]) and rows[0]["reward/max"] <= 1
    assert last["data/dropped_zero_variance"] == 1 and last["data/dropped_stale"] == 1
    assert rows[1]["staleness/1"] == 0.5 and rows[1]["staleness/0"] == 0.5
    assert (run_dir / "checkpoints" / "learn" / "latest").read_text() == "step_00000003"
    with sqlite3.connect(run_dir / "mlflow.db") as db:
        keys = {k for (k,) in db.execute("select distinct key from metrics")}
        steps = {s for (s,) in db.execute("select distinct step from metrics where key = 'loss/total'")}
    assert {"loss/total", "policy/clip_frac", "policy/iw_max", "grad_norm", "staleness/0", "time/weight_push_s"} <= keys
    assert steps == {1, 2, 3}

    # Restart (in this process, same sockets and code path as the command): it resumes at step 4
    # with policy version 3 and trains on the groups that are already queued for it.
    from agentrl.config import load_config
    from agentrl.learner.loop import Learner

    push.send(encode(make_group(rng, version=3)))
    push.send(encode(make_group(rng, version=3)))
    cfg = load_config(config, ["learner.max_steps=4", "tracking.enabled=false"])
    learner = Learner(cfg)
    assert learner.run() == "done"
    assert learner.trainer.step == 4 and learner.version == 4
    rows = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["data/received"] == 10 + 2  # counters carried over by the checkpoint
    assert (run_dir / "checkpoints" / "learn" / "latest").read_text() == "step_00000004"
    push.close(0)
    sub.close(0)


def test_learn_config_errors_are_clear(tmp_path):
    from typer.testing import CliRunner

    from agentrl.cli import app

    result = CliRunner().invoke(app, ["learn", "--set", "learner.tis=token"])
    assert result.exit_code == 2 and "learner.decoupled = false" in result.output
