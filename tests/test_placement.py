"""GPU placement: visible GPUs, plans for several layouts, refusals, and the plan for clusters."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agentrl.config import ConfigError, load_config
from agentrl.run.placement import (
    Placement,
    PlacementError,
    parse_visible_devices,
    placement_for,
    plan_cluster,
    plan_placement,
    visible_gpus,
    weight_group_backend,
)


def cfg(*overrides: str):
    return load_config(None, list(overrides))


# ------------------------------------------------------------------------------ visible GPUs


def test_cuda_visible_devices_is_read_as_cuda_reads_it():
    assert parse_visible_devices("0,1") == ("0", "1")
    assert parse_visible_devices(" 2, 3 ") == ("2", "3")
    assert parse_visible_devices("GPU-8f0e,MIG-1a2b") == ("GPU-8f0e", "MIG-1a2b")
    assert parse_visible_devices("0,-1,2") == ("0",)  # CUDA stops at the first invalid entry
    assert parse_visible_devices("") == () and parse_visible_devices("-1") == ()
    with pytest.raises(PlacementError, match="lists GPU 1 twice"):
        parse_visible_devices("1,0,1")


def _fake_nvidia_smi(folder: Path, body: str) -> str:
    path = folder / "nvidia-smi"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_visible_gpus_from_the_environment_then_nvidia_smi_then_none(tmp_path):
    listing = (
        "GPU 0: NVIDIA H200 (UUID: GPU-aaaa)\\n"
        "  MIG 3g.71gb Device 0: (UUID: MIG-bbbb)\\n"
        "GPU 1: NVIDIA H200 (UUID: GPU-cccc)"
    )
    smi = _fake_nvidia_smi(tmp_path, f'[ "$1" = "-L" ] && printf "{listing}\\n"')
    # a cluster job's CUDA_VISIBLE_DEVICES wins over what the machine has
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}, nvidia_smi=smi) == ("3", "5")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, nvidia_smi=smi) == ()
    assert visible_gpus({}, nvidia_smi=smi) == ("0", "1")
    broken = tmp_path / "broken"
    broken.mkdir()
    assert visible_gpus({}, nvidia_smi=_fake_nvidia_smi(broken, "echo 'NVIDIA-SMI has failed' >&2; exit 9")) == ()
    assert visible_gpus({}, nvidia_smi=str(tmp_path / "absent")) == ()


# ------------------------------------------------------------------------------ plans on one machine


def test_default_layout_on_several_gpus_gives_everyone_their_own():
    p = placement_for(cfg("engine.num_engines=2", "learner.gpus=2"), ("0", "1", "2", "3"))
    assert p.learner == ("0", "1") and p.engines == (("2",), ("3",)) and not p.colocated
    assert p.learner_env() == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert p.engine_env(1) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert p.cpu_env() == {"CUDA_VISIBLE_DEVICES": ""}  # actors never touch a GPU
    assert p.describe() == [
        "GPUs visible: 0,1,2,3 (4)",
        "learner: 2 ranks on GPU 0,1",
        "engine0: GPU 2",
        "engine1: GPU 3",
        "actors, retrieval server: no GPU",
    ]


def test_sglang_tensor_parallel_engines_take_consecutive_gpus_by_uuid():
    gpus = tuple(f"GPU-{i}" for i in range(8))
    p = placement_for(
        cfg("engine.backend=sglang", "engine.num_engines=2", "engine.gpus_per_engine=2", "learner.gpus=4"), gpus
    )
    assert p.learner == gpus[:4] and p.engines == (gpus[4:6], gpus[6:8])
    assert p.engine_env(0) == {"CUDA_VISIBLE_DEVICES": "GPU-4,GPU-5"}


def test_learner_nproc_means_one_gpu_per_rank_and_gpus_implies_the_rank_count():
    assert placement_for(cfg("learner.nproc=2"), ("0", "1", "2")).learner == ("0", "1")
    assert cfg("learner.gpus=3").learner.nproc == 1  # nproc 1 (the default) defers to gpus
    with pytest.raises(ConfigError, match=r"learner.gpus \(2\) and learner.nproc \(4\) disagree"):
        cfg("learner.gpus=2", "learner.nproc=4")


def test_oversized_plans_are_refused_with_the_numbers():
    with pytest.raises(
        PlacementError,
        match=r"needs 2 GPUs \(learner 1 \+ engines 1 × 1\) but 1 is visible \(0\)"
        r".*engine.colocate = true",
    ):
        placement_for(cfg(), ("0",))
    with pytest.raises(PlacementError, match=r"needs 10 GPUs \(learner 4 \+ engines 3 × 2\) but 8 are visible"):
        placement_for(
            cfg("engine.backend=sglang", "engine.num_engines=3", "engine.gpus_per_engine=2", "learner.gpus=4"),
            tuple(str(i) for i in range(8)),
        )
    with pytest.raises(PlacementError, match="learner.gpus = 2 but no GPU is visible"):
        placement_for(cfg("learner.gpus=2"), ())


def test_one_gpu_is_shared_only_when_colocate_says_so():
    p = placement_for(cfg("engine.colocate=true"), ("0",))
    assert p.colocated and p.learner == ("0",) and p.engines == (("0",),)
    assert p.engine_env(0) == p.learner_env() == {"CUDA_VISIBLE_DEVICES": "0"}
    assert "engine0: GPU 0 (shared with the learner: engine.colocate)" in p.describe()
    # NCCL cannot put two ranks on one device: the weight push goes through gloo
    assert weight_group_backend("auto", p) == "gloo"
    with pytest.raises(PlacementError, match="NCCL cannot join them"):
        weight_group_backend("nccl", p)
    with pytest.raises(PlacementError, match="NCCL cannot join them"):  # before anything starts
        placement_for(cfg("engine.colocate=true", "engine.weight_group_backend=nccl"), ("0",))
    assert weight_group_backend("nccl", placement_for(cfg(), ("0", "1"))) == "nccl"
    # SGLang would take most of the GPU's memory
    with pytest.raises(PlacementError, match="needs engine.mem_fraction_static"):
        placement_for(cfg("engine.backend=sglang", "engine.colocate=true"), ("0",))
    p = placement_for(cfg("engine.backend=sglang", "engine.colocate=true", "engine.mem_fraction_static=0.4"), ("0",))
    assert p.engines == (("0",),)
    with pytest.raises(PlacementError, match=r"2 engine\(s\) × 1 GPU need 2, the learner has 1"):
        placement_for(cfg("engine.colocate=true", "engine.num_engines=2"), ("0", "1"))


def test_cpu_processes_and_machines_without_gpus():
    # engines on the CPU: the learner gets the GPU, the engines see none
    p = placement_for(cfg("engine.device=cpu"), ("0", "1"))
    assert p.learner == ("0",) and p.engines == ((),) and p.engine_env(0) == {"CUDA_VISIBLE_DEVICES": ""}
    p = placement_for(cfg("learner.device=cpu", "engine.num_engines=2"), ("0", "1"))
    assert p.learner == () and p.engines == (("0",), ("1",))
    # no GPU anywhere: the environment is left alone
    p = placement_for(cfg("engine.num_engines=3", "learner.nproc=2"), ())
    assert p.learner == () and p.engines == ((), (), ())
    assert p.learner_env() == p.engine_env(2) == p.cpu_env() == {}
    assert p.describe()[0].startswith("GPUs visible: none")
    # engines that already run elsewhere are not placed
    p = placement_for(cfg("engine.urls=['http://a:1', 'http://b:2']"), ("0",))
    assert p.learner == ("0",) and p.engines == ()


def test_device_settings_that_contradict_a_plan_are_refused():
    with pytest.raises(PlacementError, match="learner.device = 'cuda' but no GPU is visible"):
        placement_for(cfg("learner.device=cuda"), ())
    with pytest.raises(PlacementError, match="engine.device = 'cuda:1'.*use 'cuda' or 'auto'"):
        placement_for(cfg("engine.device=cuda:1"), ("0", "1"))
    with pytest.raises(PlacementError, match="learner.gpus = 1 but learner.device = 'cpu'"):
        placement_for(cfg("learner.gpus=1", "learner.device=cpu"), ("0", "1"))


def test_overlapping_or_invisible_devices_are_refused():
    with pytest.raises(PlacementError, match="GPU 0 is given to both learner rank 0 and engine0"):
        Placement(visible=("0", "1"), learner=("0",), engines=(("0",),))
    with pytest.raises(PlacementError, match="GPU 1 is given to both engine0 and engine1"):
        Placement(visible=("0", "1"), learner=("0",), engines=(("1",), ("1",)), colocated=True)
    with pytest.raises(PlacementError, match="GPU 1 is given to both learner rank 0 and learner rank 1"):
        Placement(visible=("0", "1"), learner=("1", "1"))
    with pytest.raises(PlacementError, match="engine0 is placed on GPU 7, which is not visible"):
        Placement(visible=("0", "1"), engines=(("7",),))
    assert plan_placement(("0", "1"), learner_gpus=1, num_engines=1, gpus_per_engine=1).engines == (("1",),)


def test_config_refuses_placement_keys_that_cannot_apply():
    with pytest.raises(ConfigError, match="gpus_per_engine = 2 needs engine.backend = 'sglang'"):
        cfg("engine.gpus_per_engine=2")
    with pytest.raises(ConfigError, match="the embedded engine has no static memory pool"):
        cfg("engine.mem_fraction_static=0.5")
    with pytest.raises(ConfigError, match=r"sets --tp-size.*engine.gpus_per_engine"):
        cfg("engine.backend=sglang", "engine.sglang_args=['--tp-size=2']")
    with pytest.raises(ConfigError, match=r"sets --weight-version"):
        cfg("engine.backend=sglang", "engine.sglang_args=['--weight-version', 'v1']")
    with pytest.raises(ConfigError, match="mem_fraction_static"):
        cfg("engine.backend=sglang", "engine.mem_fraction_static=1.0")


# ------------------------------------------------------------------------------ clusters


def test_cluster_layout_fills_engine_nodes_and_gives_the_learner_its_own():
    layout = plan_cluster(
        cfg("engine.backend=sglang", "engine.num_engines=5", "engine.gpus_per_engine=2"),
        gpus_per_node=8,
        learner_nodes=2,
    )
    assert (layout.engines_per_node, layout.engine_nodes, layout.learner_ranks_per_node) == (4, 2, 8)
    assert layout.engine_slots() == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    assert plan_cluster(cfg("learner.gpus=4"), gpus_per_node=8, learner_nodes=1).learner_ranks_per_node == 4
    with pytest.raises(PlacementError, match=r"gpus_per_engine \(16\) exceeds the 8 GPUs of a node"):
        plan_cluster(cfg("engine.backend=sglang", "engine.gpus_per_engine=16"), gpus_per_node=8, learner_nodes=1)
    with pytest.raises(PlacementError, match="wants 16 ranks per node"):
        plan_cluster(cfg("learner.gpus=16"), gpus_per_node=8, learner_nodes=1)
    with pytest.raises(PlacementError, match="engine.colocate = false"):
        plan_cluster(cfg("engine.colocate=true"), gpus_per_node=8, learner_nodes=1)


def test_visible_gpus_reads_this_process_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert visible_gpus() == ("4", "6")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"
