"""FSDP2 over 2 torchrun ranks (gloo, CPU) matches 1 rank on the same batch (GRPO, PPO, GRPO with LoRA)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tests._learner_helpers import PYTHON, REPO, subprocess_env, tiny_model  # noqa: F401


@pytest.fixture(scope="module")
def two_rank_results(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    cmd = [
        PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(REPO / "tests" / "_learner_dist_worker.py"), str(out), str(tiny_model),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out, torch.load(out / "result-world2.pt", weights_only=False)


def test_two_ranks_match_one_rank(two_rank_results, tiny_model):
    from tests._learner_dist_worker import run

    out, two = two_rank_results
    one = run(out, str(tiny_model), world_tag="world1")  # in this process: a single-rank group
    for recipe in ("grpo", "ppo", "lora"):
        m1, m2 = one[recipe]["metrics"], two[recipe]["metrics"]
        for key in (
            "loss/total",
            "grad_norm",
            "policy/clip_frac",
            "policy/entropy",
            "policy/iw_max",
            "first/grad_norm",
        ):
            if key in m1:
                assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), (recipe, key)
        if recipe == "ppo":
            assert m2["critic/value_loss"] == pytest.approx(m1["critic/value_loss"], rel=1e-4)
        p1, p2 = one[recipe]["params"], two[recipe]["params"]
        assert set(p1) == set(p2)
        worst = max((p1[n] - p2[n]).abs().max().item() for n in p1)
        moved = max((p1[n] - p0).abs().max().item() for n, p0 in _initial(tiny_model).items())
        assert moved > 1e-4  # the step did change the weights...
        assert worst < 1e-5, (recipe, worst)  # ...identically on 1 and 2 ranks


def test_checkpoint_from_two_ranks_loads_on_one(two_rank_results, tiny_model):
    from agentrl.learner.checkpoint import latest_checkpoint, load_checkpoint
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.loss import PolicyLossConfig
    from agentrl.learner.trainer import Trainer, TrainerSpec
    from tests._learner_helpers import iter_full_tensors

    out, two = two_rank_results
    spec = TrainerSpec(
        model_path=str(tiny_model),
        lr=1e-3,
        max_tokens_per_microbatch=96,
        num_minibatches=2,
        loss=PolicyLossConfig(kl_coef=0.05, entropy_coef=0.01, normalization="sequence"),
    )
    trainer = Trainer(spec, init_distributed("cpu"))
    state = load_checkpoint(latest_checkpoint(out / "ckpt-world2"), trainer)
    assert state["policy_version"] == 1 and trainer.step == 2
    for name, tensor in iter_full_tensors(trainer.policy):
        assert torch.equal(tensor, two["grpo"]["params"][name]), name


_INITIAL: dict = {}


def _initial(path) -> dict[str, torch.Tensor]:
    if not _INITIAL:
        from transformers import AutoModelForCausalLM

        _INITIAL.update(AutoModelForCausalLM.from_pretrained(path).state_dict())
        _INITIAL.pop("lm_head.weight", None)
    return _INITIAL


def test_learn_loop_on_two_ranks(two_rank_results):
    out, _ = two_rank_results
    rank0 = json.loads((out / "loop-rank0.json").read_text())
    rank1 = json.loads((out / "loop-rank1.json").read_text())
    assert rank0 == {"reason": "done", "step": 2, "version": 2, "pushes": [1, 2]}
    assert rank1 == {"reason": "done", "step": 2, "version": 2, "pushes": []}  # only rank 0 pushes
