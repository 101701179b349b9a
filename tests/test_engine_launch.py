"""Launching servers: command lines (SGLang's flags), readiness, and serve-engine without SGLang."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.engine import launch
from agentrl.engine.launch import EngineLaunchError, engine_args, engine_command, wait_ready
from agentrl.net import free_port


def test_engine_commands():
    emb = engine_command("/m", 31000, extra=["--num-threads", "1"])
    assert emb[:3] == [sys.executable, "-m", "agentrl.run.engine_process"]
    assert emb[3:] == ["--model", "/m", "--host", "127.0.0.1", "--port", "31000", "--num-threads", "1"]
    sg = engine_command(
        "/m",
        31001,
        backend="sglang",
        host="0.0.0.0",
        extra=engine_args(
            "sglang",
            dtype="bfloat16",
            max_running_requests=32,
            max_context_tokens=4096,
            gpus_per_engine=2,
            mem_fraction_static=0.4,
            api_key="k1",
            admin_api_key="k2",
            sglang_args=["--tool-call-parser", "qwen25"],
        ),
    )
    assert sg[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = sg[3:]
    pairs = dict(zip(flags[::2], flags[1::2]))
    assert pairs == {
        "--model-path": "/m",
        "--host": "0.0.0.0",
        "--port": "31001",
        "--context-length": "4096",
        "--max-running-requests": "32",
        "--weight-version": "0",
        "--dtype": "bfloat16",
        "--tp-size": "2",
        "--base-gpu-id": "0",
        "--mem-fraction-static": "0.4",
        "--api-key": "k1",
        "--admin-api-key": "k2",
        "--tool-call-parser": "qwen25",
    }
    # SGLang's defaults stay SGLang's: no memory fraction, no keys, unless set
    plain = engine_args("sglang")
    assert "--mem-fraction-static" not in plain and "--api-key" not in plain and "--admin-api-key" not in plain
    with pytest.raises(ValueError, match="unknown engine backend"):
        engine_command("/m", 1, backend="vllm")
    with pytest.raises(ValueError, match="one device"):
        engine_args("embedded", gpus_per_engine=2)


def test_every_engine_command_carries_a_weight_version():
    """SGLang reports "default" for a server started without --weight-version: never start one."""
    from agentrl.config import load_config
    from agentrl.engine.launch import config_engine_args

    for backend in ("embedded", "sglang"):
        assert engine_args(backend)[engine_args(backend).index("--weight-version") + 1] == "0"
        cfg = load_config(None, [f"engine.backend={backend}"])
        args = config_engine_args(cfg, secret=lambda var: "")
        assert args[args.index("--weight-version") + 1] == "0"


def test_config_engine_args_take_keys_from_the_environment_for_sglang_only(monkeypatch):
    from agentrl.config import load_config
    from agentrl.engine.launch import config_engine_args

    monkeypatch.setenv("MY_ENGINE_KEY", "s3cret")
    monkeypatch.delenv("AGENTRL_ENGINE_ADMIN_API_KEY", raising=False)
    monkeypatch.delenv("AGENTRL_ENGINE_ADMIN_API_KEY_FILE", raising=False)
    sg = config_engine_args(
        load_config(
            None,
            [
                "engine.backend=sglang",
                "engine.api_key_env=MY_ENGINE_KEY",
                "engine.gpus_per_engine=4",
                "engine.mem_fraction_static=0.5",
            ],
        )
    )
    pairs = dict(zip(sg[::2], sg[1::2]))
    assert pairs["--api-key"] == "s3cret" and "--admin-api-key" not in pairs
    assert pairs["--tp-size"] == "4" and pairs["--base-gpu-id"] == "0" and pairs["--mem-fraction-static"] == "0.5"
    emb = config_engine_args(load_config(None, ["engine.api_key_env=MY_ENGINE_KEY"]))
    assert "s3cret" not in emb  # the embedded engine reads its key from its environment,
    assert emb[emb.index("--api-key-env") + 1] == "MY_ENGINE_KEY"  # from the variable the config names


def test_serve_engine_with_sglang_missing_fails_at_once(tmp_path):
    from tests.test_sglang_launch import interpreter_with_sglang

    python = interpreter_with_sglang(tmp_path, None)  # an interpreter without sglang
    result = CliRunner().invoke(
        app, ["serve-engine", "--model", "/m", "--backend", "sglang", "--sglang-python", python]
    )
    assert result.exit_code == 2
    assert "has no sglang" in result.output and "AGENTRL_SGLANG=1 bash scripts/install.sh" in result.output
    with pytest.raises(EngineLaunchError, match="has no sglang"):
        launch.EngineProcess("/m", 1, backend="sglang", python=python)


def test_serve_engine_rejects_an_unknown_backend():
    result = CliRunner().invoke(app, ["serve-engine", "--model", "/m", "--backend", "tgi"])
    assert result.exit_code == 2 and "unknown backend" in result.output


def test_wait_ready_reports_a_dead_process_and_a_timeout():
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    port = free_port()
    with pytest.raises(EngineLaunchError, match="exited with code 3"):
        wait_ready(f"http://127.0.0.1:{port}", 5, process=dead)
    with pytest.raises(EngineLaunchError, match="not ready after"):
        wait_ready(f"http://127.0.0.1:{port}", 0.5)


def test_config_helpers_read_the_engine_section():
    from agentrl.config import load_config
    from agentrl.engine.client import EngineClient
    from agentrl.learner.weight_push import WeightUpdater

    cfg = load_config(
        None,
        [
            "engine.urls=['http://a:1', 'http://b:2']",
            "engine.request_retries=2",
            "engine.router_url=http://r:3",
            "engine.weight_bucket_mb=1.5",
            "engine.weight_group_backend=gloo",
        ],
    )
    client = EngineClient.from_config(cfg.engine)
    assert [s.url for s in client.engines] == ["http://a:1", "http://b:2"] and client.router.url == "http://r:3"
    assert client.max_retries == 2
    updater = WeightUpdater.from_config(cfg.engine, urls=["http://c:4"])
    try:
        assert updater.engine_urls == ["http://c:4"] and updater.backend == "gloo"
        assert updater.bucket_bytes == int(1.5 * 2**20)
    finally:
        updater.close()
