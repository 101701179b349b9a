"""A learner over several machines: ``agentrl learn --nnodes``'s torchrun command, rank 0's address
check, and two "nodes" on this machine (two torchrun invocations joined by c10d rendezvous) that
train on trajectory groups sent over ZMQ and push their weights into a real embedded engine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from agentrl.config import load_config
from agentrl.learner.launch import Nodes, check_rank0_addresses, torchrun_command
from agentrl.net import free_port
from tests._learner_helpers import PYTHON, make_group, subprocess_env, tiny_model  # noqa: F401


def test_torchrun_command_for_one_and_several_nodes(tmp_path):
    config = tmp_path / "c.toml"
    one = torchrun_command("learn", config, ["learner.lr=1e-5"], 4)
    assert one == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        "-m",
        "agentrl.learner.launch",
        "learn",
        "--config",
        str(config),
        "--set",
        "learner.lr=1e-5",
    ]
    nodes = Nodes(nnodes=2, rdzv_endpoint="head:29400", rdzv_id="job7", local_addr="node-b")
    two = torchrun_command("learn", config, [], 8, nodes)
    assert two[3:15] == [
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "head:29400",
        "--rdzv-id",
        "job7",
        "--local-addr",
        "node-b",
        "--nproc-per-node=8",
        "-m",
    ]
    with pytest.raises(ValueError, match="--nnodes 2 needs --rdzv-endpoint"):
        torchrun_command("learn", config, [], 8, Nodes(nnodes=2))


def test_several_nodes_need_a_shared_run_folder_and_an_endpoint():
    from typer.testing import CliRunner

    from agentrl.cli import app

    result = CliRunner().invoke(app, ["learn", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"])
    assert result.exit_code == 2 and "must share one run folder: set run.run_dir" in result.output
    result = CliRunner().invoke(app, ["learn", "--nnodes", "2", "-s", "run.run_dir=/tmp/x"])
    assert result.exit_code == 2 and "needs --rdzv-endpoint" in result.output


def test_rank0_refuses_addresses_that_are_not_its_own():
    ok = load_config(
        None,
        [
            "actors.trajectory_endpoint=tcp://0.0.0.0:5557",
            f"actors.progress_endpoint=tcp://{socket.gethostname()}:5558",
            "engine.urls=['http://10.1.2.3:30000']",
            "learner.weight_sync_address=localhost",
        ],
    )
    check_rank0_addresses(ok)
    # 192.0.2.0/24 is TEST-NET-1: never an address of this machine
    far = load_config(None, ["engine.urls=['http://e:1']", "learner.weight_sync_address=192.0.2.7"])
    with pytest.raises(
        ValueError,
        match=r"learner.weight_sync_address points at '192.0.2.7', which is not this "
        r"machine.*--local-addr sorts first",
    ):
        check_rank0_addresses(far)
    with pytest.raises(ValueError, match="actors.trajectory_endpoint points at 'no-such-host.invalid'"):
        check_rank0_addresses(load_config(None, ["actors.trajectory_endpoint=tcp://no-such-host.invalid:5557"]))
    check_rank0_addresses(load_config(None, ["learner.weight_sync_address=192.0.2.7"]))  # no engines: not used


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_learner_nodes_train_and_push_weights_into_a_real_engine(tiny_model, tmp_path):
    import httpx
    import zmq

    from agentrl.engine.launch import EngineProcess, wait_ready
    from agentrl.learner.export import export_checkpoint
    from agentrl.protocol import decode, encode
    from tests.conftest_engine import ENGINE_FLAGS, Teacher, max_abs_diff

    engine = EngineProcess(str(tiny_model), free_port(), extra=ENGINE_FLAGS, log_path=tmp_path / "engine.log")
    engine.start(wait_s=0)
    traj, prog = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    config = tmp_path / "learn.toml"
    config.write_text(f"""
[run]
run_dir = "{run_dir}"
torch_num_threads = 1
[model]
path = "{tiny_model}"
[engine]
urls = ["{engine.url}"]
weight_group_backend = "gloo"
[actors]
group_size = 4
trajectory_endpoint = "{traj}"
progress_endpoint = "{prog}"
[learner]
device = "cpu"
lr = 5e-2
groups_per_step = 2
max_steps = 2
max_tokens_per_microbatch = 128
checkpoint_every_steps = 0
weight_sync_address = "127.0.0.1"
[tracking]
enabled = false
""")
    rdzv = f"127.0.0.1:{free_port()}"
    job = f"two-nodes-{uuid.uuid4().hex[:8]}"

    def node(local_addr: str) -> subprocess.Popen:
        argv = [
            PYTHON,
            "-m",
            "agentrl",
            "learn",
            "--config",
            str(config),
            "--nproc",
            "1",
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            rdzv,
            "--rdzv-id",
            job,
            "--local-addr",
            local_addr,
        ]
        return subprocess.Popen(
            argv,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    # c10d numbers nodes by their address in sorted order: "127.0.0.1" < "localhost", so the node
    # started second is rank 0 (it binds the sockets and leads the weight push)
    second_rank = node("localhost")
    first_rank = node("127.0.0.1")
    ctx = zmq.Context.instance()
    push, sub = ctx.socket(zmq.PUSH), ctx.socket(zmq.SUB)
    push.setsockopt(zmq.LINGER, 1000)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    push.connect(traj)
    sub.connect(prog)
    rng = np.random.default_rng(3)

    def wait_version(version: int, timeout_s: float = 240.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sub.poll(200):
                msg = decode(sub.recv())
                if msg.policy_version >= version:
                    return msg
            for p in (first_rank, second_rank):
                assert p.poll() is None, p.stdout.read()[-4000:]
        raise AssertionError(f"no progress with policy version {version}")

    prompt = [5, 17, 42, 99, 7]
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True},
    }
    try:
        wait_ready(engine.url, 240, process=engine.process)
        before = httpx.post(engine.url + "/generate", json=body, timeout=60).json()
        for version in (0, 1):
            wait_version(version)
            for i in range(2):
                push.send(encode(make_group(rng, version=version, group_id=f"v{version}-{i}")))
        outs = [p.communicate(timeout=240)[0] for p in (first_rank, second_rank)]
        assert first_rank.returncode == 0 and second_rank.returncode == 0, outs[0][-3000:] + outs[1][-3000:]
        after = httpx.post(engine.url + "/generate", json=body, timeout=60).json()
    finally:
        for p in (first_rank, second_rank):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        engine.stop()
        push.close(0)
        sub.close(0)
    assert "learn: rank 0 of 2" in outs[0] and "learn: rank 1 of 2" in outs[1]
    assert before["meta_info"]["weight_version"] == "0" and after["meta_info"]["weight_version"] == "2"

    # the engine now serves exactly the learner's final weights (its checkpoint, exported)
    exported = export_checkpoint(run_dir, tmp_path / "exported")
    learner = Teacher(exported)
    engine_lp = [lp for lp, _, _ in after["meta_info"]["output_token_logprobs"]]
    assert max_abs_diff(engine_lp, learner.logprobs(prompt, after["output_ids"])) <= 1e-4
    start = Teacher(tiny_model)
    assert max_abs_diff(engine_lp, start.logprobs(prompt, after["output_ids"])) > 1e-3  # they did change
