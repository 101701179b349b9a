"""How agentrl starts SGLang on a user's machine: the interpreter of SGLang's own virtualenv
(``engine.sglang_python``), extra environment (``engine.sglang_env``), SGLang's CPU flags and
``sgl_kernel`` stand-in when an engine is placed on no GPU, a KV pool sized from the run, and the
early check (``--dry-run`` and before a run starts) that the interpreter has sglang.
The real server itself is tested in tests/test_sglang_real.py."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from agentrl.config import load_config
from agentrl.engine.launch import SGLANG_CPU_FLAGS, SGLANG_CPU_SHIM, SGLANG_VERSION, cpu_kv_tokens, sglang_problem
from agentrl.engine.sglang_cpu import sgl_kernel
from agentrl.run.placement import placement_for
from agentrl.run.process_plan import engine_specs, plan_config
from tests.test_cli import run_cli

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "calculator" / "config.toml"


def _pairs(argv: list[str]) -> dict[str, str]:
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--") and not argv[i + 1].startswith("--")}


def _engine(overrides: list[str], visible: tuple[str, ...], tmp_path: Path, config: Path | None = QUICKSTART):
    cfg = load_config(config, ["engine.backend=sglang", *overrides])
    placement = placement_for(cfg, visible)
    planned = plan_config(cfg, tmp_path, cfg.model.path, placement)
    return planned, engine_specs(planned, tmp_path, placement, secret=lambda var: "")[0]


def test_on_the_cpu_agentrl_passes_sglangs_cpu_flags_environment_and_kv_pool(tmp_path):
    python = "/opt/sglang-venv/bin/python"
    cfg, spec = _engine(
        [f"engine.sglang_python={python}", 'engine.sglang_env={SGLANG_X = "1", PYTHONPATH = "/mine"}'], (), tmp_path
    )
    assert spec.argv[:3] == [python, "-m", "sglang.launch_server"]
    for argv in (spec.argv, spec.restart_argv):
        flags = _pairs(argv)
        assert all(f in argv for f in SGLANG_CPU_FLAGS[::2]) and flags["--attention-backend"] == "torch_native"
        assert flags["--device"] == "cpu" and flags["--sampling-backend"] == "pytorch" and flags["--dtype"] == "float32"
        # the quickstart: 128 concurrent episodes of at most 256 tokens on one engine (4096 made SGLang retract)
        assert flags["--max-total-tokens"] == "32768" == str(cpu_kv_tokens(cfg))
        assert "--skip-server-warmup" in argv
    assert spec.env["SGLANG_USE_CPU_ENGINE"] == "1" and spec.env["SGLANG_X"] == "1"
    assert spec.env["PYTHONPATH"].split(os.pathsep) == [str(SGLANG_CPU_SHIM), "/mine"]  # the stand-in first


def test_the_kv_pool_follows_the_runs_concurrency_and_a_users_own_size_wins(tmp_path):
    cfg, _ = _engine(
        ["engine.num_engines=2", "actors.num_concurrent_episodes=16", "env.max_total_tokens=200"], (), tmp_path
    )
    assert cpu_kv_tokens(cfg) == 8 * 200  # 16 episodes over two engines
    cfg, _ = _engine(["actors.num_concurrent_episodes=1", "env.max_total_tokens=32"], (), tmp_path)
    assert cpu_kv_tokens(cfg) == cfg.engine.max_context_tokens  # never below one request's context
    _, spec = _engine(['engine.sglang_args=["--max-total-tokens", "4096"]'], (), tmp_path)
    assert spec.argv.count("--max-total-tokens") == 1 and _pairs(spec.argv)["--max-total-tokens"] == "4096"


def test_on_gpus_there_are_no_cpu_flags_and_no_stand_in(tmp_path):
    _, spec = _engine(["learner.device=cpu"], ("0",), tmp_path)
    assert spec.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert "--attention-backend" not in spec.argv and "--max-total-tokens" not in spec.argv
    assert spec.argv[0] == sys.executable  # engine.sglang_python unset: agentrl's own interpreter


def interpreter_with_sglang(tmp_path: Path, version: str | None) -> str:
    """An interpreter (a wrapper around this one) that sees a package ``sglang`` of ``version``."""
    site = tmp_path / f"site-{version}"
    if version:
        (site / "sglang").mkdir(parents=True)
        (site / "sglang" / "__init__.py").write_text("raise RuntimeError('the check must not import sglang')\n")
        meta = site / f"sglang-{version}.dist-info"
        meta.mkdir()
        meta.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    wrapper = tmp_path / f"python-{version}"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def test_the_check_finds_sglang_in_the_named_interpreter_without_importing_it(tmp_path):
    assert sglang_problem(interpreter_with_sglang(tmp_path, SGLANG_VERSION)) is None
    missing = sglang_problem(interpreter_with_sglang(tmp_path, None))
    assert "has no sglang" in missing and "AGENTRL_SGLANG=1 bash scripts/install.sh" in missing
    assert "engine.sglang_python" in missing
    assert "cannot be run" in sglang_problem(str(tmp_path / "no-such-python"))


def test_dry_run_and_run_refuse_an_interpreter_without_sglang_before_anything_starts(tmp_path):
    python = interpreter_with_sglang(tmp_path, None)
    args = [
        "-s",
        "engine.backend=sglang",
        "-s",
        f"engine.sglang_python={python}",
        "-s",
        "model.init_size=tiny",
        "-s",
        f"model.path={tmp_path / 'model'}",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    rc, _, _, err = run_cli("run", str(QUICKSTART), *args, "--dry-run")
    assert rc == 2 and "engine check:" in err and "has no sglang" in err
    rc, _, _, err = run_cli("run", str(QUICKSTART), *args)
    assert rc == 2 and "has no sglang" in err
    assert not (tmp_path / "run" / "sft").exists()  # refused before the warm start


def test_the_kernel_stand_in_writes_each_requests_slice_of_cache_locations():
    req_to_token = torch.zeros(4, 10, dtype=torch.int32)
    rows, starts, ends = torch.tensor([2, 0]), torch.tensor([3, 0]), torch.tensor([6, 2])
    out_cache_loc = torch.tensor([11, 12, 13, 21, 22], dtype=torch.int64)
    sgl_kernel.assign_req_to_token_pool_cpu(rows, req_to_token, starts, ends, out_cache_loc, 10)
    expected = torch.zeros(4, 10, dtype=torch.int32)
    expected[2, 3:6] = torch.tensor([11, 12, 13])
    expected[0, 0:2] = torch.tensor([21, 22])
    assert torch.equal(req_to_token, expected)
    with pytest.raises(ValueError, match="cache locations"):
        sgl_kernel.assign_req_to_token_pool_cpu(rows, req_to_token, starts, ends, out_cache_loc[:4], 10)
    with pytest.raises(ValueError, match="outside a row"):
        sgl_kernel.assign_req_to_token_pool_cpu(
            rows[:1], req_to_token, starts[:1], torch.tensor([11]), out_cache_loc, 10
        )


def test_the_kernel_stand_in_names_itself_for_any_op_it_does_not_implement():
    # SGLang imports these at import time (speculative decoding, KV moves) and never calls them on the CPU path
    from agentrl.engine.sglang_cpu.sgl_kernel import build_tree_kernel_efficient_cpu, copy_all_layer_kv_cache_cpu

    for op in (build_tree_kernel_efficient_cpu, copy_all_layer_kv_cache_cpu, sgl_kernel.fused_add_rmsnorm):
        with pytest.raises(NotImplementedError, match=f"{op.__name__} is not implemented by agentrl's CPU stand-in"):
            op(torch.zeros(1))
