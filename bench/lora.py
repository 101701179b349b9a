"""Optimiser-state and gradient memory of the learner with and without LoRA, side by side.

    python bench/lora.py                          # CPU, the small model, rank 16
    python bench/lora.py --size 0.5b --device cuda --ranks 16 64

For each setting one ``Trainer`` takes the same RL steps and the script counts the bytes of the
gradients (right before the optimiser step), the optimiser state and the parameters: exact, the
same on every machine. On a GPU it also reports ``torch.cuda.max_memory_allocated``; step times are
a rough guide. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.learner import synthetic_samples

SMOKE = {"size": "tiny", "ranks": [4], "groups": 1, "group_size": 2, "steps": 1}
SMOKE_HELP = "the same code path on the smallest sizes, in seconds: checks the path, not the numbers"


def _bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def measure(model_path: str, lora, samples, args, dist_info) -> dict:
    import torch

    from agentrl.learner.trainer import Trainer, TrainerSpec

    if dist_info.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    spec = TrainerSpec(model_path=model_path, lr=1e-4, max_tokens_per_microbatch=args.microbatch_tokens, lora=lora)
    trainer = Trainer(spec, dist_info)
    grads: list[int] = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, a, k: grads.append(
            _bytes(p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None)
        )
    )
    times = []
    for _ in range(args.steps + 1):  # the first step warms up and is not timed
        start, cpu = time.perf_counter(), time.process_time()
        trainer.rl_step(samples)
        if dist_info.device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out = {
        "trainable": sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad),
        "parameters_bytes": _bytes(trainer.policy.parameters()),
        "grad_bytes": max(grads),
        "optimizer_bytes": _bytes(state),
        "wall_s": statistics.median(t[0] for t in times[1:]),
        "cpu_s": statistics.median(t[1] for t in times[1:]),
    }
    if dist_info.device.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    del trainer, state
    gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=["tiny", "small", "0.5b"])
    parser.add_argument("--model-path", default="", help="use this model instead of building one")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16], help="LoRA ranks to compare with full training")
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--microbatch-tokens", type=int, default=2048)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per setting")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke:  # flags given explicitly still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()

    import torch

    from agentrl.learner.distributed import init_distributed, shutdown_distributed
    from agentrl.learner.lora import LoraSpec
    from agentrl.models.builder import init_model

    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = None
    model_path = args.model_path
    if not model_path:
        tmp = tempfile.TemporaryDirectory()
        model_path = str(init_model(Path(tmp.name) / args.size, args.size))
    dist_info = init_distributed(args.device)
    from transformers import AutoConfig

    vocab = min(AutoConfig.from_pretrained(model_path).vocab_size, 2048)
    samples = synthetic_samples(args.groups, args.group_size, 64, 256, vocab, seed=0)
    settings = [("full", None)] + [(f"LoRA r={r}", LoraSpec(rank=r, alpha=args.alpha)) for r in args.ranks]
    results = {name: measure(model_path, lora, samples, args, dist_info) for name, lora in settings}

    full = results["full"]
    tokens = sum(s.num_tokens for s in samples)
    print(
        f"model {Path(model_path).name}, {full['trainable']:,} parameters, on {dist_info.device}; "
        f"{len(samples)} sequences / {tokens} tokens per step; LoRA on q,k,v,o,gate,up,down, alpha {args.alpha:g}"
    )
    mib = lambda b: f"{b / 2**20:9.2f} MiB"  # noqa: E731
    header = (
        f"{'':14s} {'trainable':>12s} {'gradients':>13s} {'optimiser':>13s} {'grad+optim':>13s} "
        f"{'vs full':>8s} {'step wall':>10s} {'step cpu':>9s}"
    )
    if "peak_gpu_bytes" in full:
        header += f" {'peak GPU':>13s}"
    print(header)
    for name, r in results.items():
        both = r["grad_bytes"] + r["optimizer_bytes"]
        line = (
            f"{name:14s} {r['trainable']:12,d} {mib(r['grad_bytes'])} {mib(r['optimizer_bytes'])} {mib(both)} "
            f"{both / (full['grad_bytes'] + full['optimizer_bytes']):8.4f} {r['wall_s']:9.2f}s {r['cpu_s']:8.2f}s"
        )
        if "peak_gpu_bytes" in r:
            line += f" {mib(r['peak_gpu_bytes'])}"
        print(line)
    print(
        f"parameters: full {mib(full['parameters_bytes']).strip()}, "
        + ", ".join(f"{n} {mib(r['parameters_bytes']).strip()}" for n, r in results.items() if n != "full")
    )
    shutdown_distributed()
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
