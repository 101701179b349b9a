"""Run under torchrun by tests/test_learner_distributed.py: one GRPO and one PPO step on a
fixed batch with FSDP2 over the ranks, then the gathered full weights and a checkpoint.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/_learner_dist_worker.py OUT MODEL
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(out: Path, model_path: str, *, world_tag: str) -> dict:
    """Two steps of each recipe; returns (and on rank 0 saves) metrics and full parameters."""
    from agentrl.learner.checkpoint import save_checkpoint
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.lora import LoraSpec
    from agentrl.learner.loss import PolicyLossConfig
    from agentrl.learner.trainer import Trainer, TrainerSpec
    from tests._learner_helpers import fixed_samples, iter_full_tensors

    torch.set_num_threads(1)
    dist_info = init_distributed("cpu")
    results = {}
    recipes = {
        "grpo": (
            TrainerSpec(
                model_path=model_path,
                lr=1e-3,
                max_tokens_per_microbatch=96,
                num_minibatches=2,
                loss=PolicyLossConfig(kl_coef=0.05, entropy_coef=0.01, normalization="sequence"),
            ),
            "grpo",
        ),
        "ppo": (
            TrainerSpec(
                model_path=model_path,
                lr=1e-3,
                algorithm="ppo",
                max_tokens_per_microbatch=96,
                normalize_advantage_std=True,
            ),
            "gae",
        ),
        "lora": (  # adapters sharded by FSDP2, the KL reference with adapters off, a merged gather
            TrainerSpec(
                model_path=model_path,
                lr=1e-2,
                max_tokens_per_microbatch=96,
                num_minibatches=2,
                loss=PolicyLossConfig(kl_coef=0.05),
                lora=LoraSpec(rank=4, alpha=8.0),
            ),
            "grpo",
        ),
    }
    for name, (spec, advantage) in recipes.items():
        trainer = Trainer(spec, dist_info)
        # two steps: Adam's first update is nearly sign(g), the second one depends on magnitudes
        first = trainer.rl_step(fixed_samples(11, groups=3, advantage=advantage))
        metrics = trainer.rl_step(fixed_samples(12, groups=3, advantage=advantage))
        metrics.update({f"first/{k}": v for k, v in first.items()})
        params = {n: t.clone() for n, t in iter_full_tensors(trainer.policy, bucket_bytes=64 << 10)}
        results[name] = {"metrics": metrics, "params": params}
        if name == "grpo":
            save_checkpoint(out / f"ckpt-{world_tag}", trainer, state={"policy_version": 1})
    if dist_info.rank == 0:
        torch.save(results, out / f"result-{world_tag}.pt")
    return results


def run_loop(out: Path, model_path: str) -> None:
    """The learn loop on every rank: rank 0 has the data (after a few empty polls, so the other
    rank sits through "wait" broadcasts), both ranks train two steps, then stop together."""
    import json

    import numpy as np

    from agentrl.config import load_config
    from agentrl.learner.loop import Learner, LearnerIO
    from tests._learner_helpers import ListSource, Recorder, make_group

    rng = np.random.default_rng(0)
    overrides = [
        f'model.path="{model_path}"',
        f'run.run_dir="{out / "loop"}"',
        "learner.groups_per_step=2",
        "learner.max_steps=2",
        "learner.max_tokens_per_microbatch=128",
        "learner.checkpoint_every_steps=0",
        'learner.device="cpu"',
        "tracking.enabled=false",
        "actors.group_size=4",
    ]
    rec = Recorder()
    source = ListSource(
        [make_group(rng, version=v, group_id=f"g{i}") for i, v in enumerate([0, 0, 1, 1])], empty_polls=30
    )
    learner = Learner(load_config(None, overrides), io=LearnerIO(source=source, progress=rec, weights=rec))
    reason = learner.run()
    summary = {
        "reason": reason,
        "step": learner.trainer.step,
        "version": learner.version,
        "pushes": [v for v, _ in rec.pushes],
    }
    (out / f"loop-rank{learner.dist.rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    from agentrl.learner.distributed import shutdown_distributed

    run(Path(sys.argv[1]), sys.argv[2], world_tag="world2")
    run_loop(Path(sys.argv[1]), sys.argv[2])
    shutdown_distributed()
