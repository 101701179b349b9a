"""Learner throughput against a bare torch loop on the same packed data and model.

    python bench/learner.py                      # CPU, tiny model
    python bench/learner.py --size 0.5b --device cuda --microbatch-tokens 8192   # GPU: + MFU

The **learner** side is ``Trainer.rl_step`` (FSDP2, the decoupled PPO loss and its metrics,
clipping, AdamW); the **bare** side the unwrapped model with a one-line surrogate, also applying the
LM head to loss positions only. Steps alternate and medians are reported (wall clock and CPU time).
Target ratio >= 0.90. On GPU, MFU is against ``--peak-tflops`` (989 for an H100/H200 in dense
bf16). See docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMOKE = {"size": "tiny", "groups": 1, "group_size": 2, "min_len": 16, "max_len": 64, "steps": 1, "warmup": 0}
SMOKE_HELP = "the same code path on the smallest sizes, in seconds: checks the path, not the numbers"


def synthetic_samples(num_groups: int, group_size: int, min_len: int, max_len: int, vocab: int, seed: int):
    import numpy as np

    from agentrl.learner.batching import Sample

    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(num_groups):
        rewards = rng.integers(0, 2, group_size).astype(np.float64)
        adv = rewards - rewards.mean()
        for r, a in zip(rewards, adv):
            n = int(rng.integers(min_len, max_len + 1))
            mask = np.zeros(n, np.uint8)
            mask[n // 3 :] = 1
            samples.append(
                Sample(
                    tokens=rng.integers(0, vocab, n).astype(np.int32),
                    loss_mask=mask,
                    behavior_logprobs=np.where(mask, -rng.uniform(0.1, 5.0, n), 0.0).astype(np.float32),
                    advantage=float(a),
                    reward=float(r),
                )
            )
    return samples


def flops_per_token(config, mean_seq_len: float) -> float:
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = config.num_key_value_heads
    attn = hidden * head_dim * (heads + 2 * kv) + heads * head_dim * hidden
    mlp = 3 * hidden * config.intermediate_size
    dense = layers * (attn + mlp) + config.vocab_size * hidden  # + LM head
    return 6.0 * dense + 6.0 * layers * heads * head_dim * mean_seq_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=["tiny", "small", "0.5b"])
    parser.add_argument("--model-path", default="", help="use this model instead of building one")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--microbatch-tokens", type=int, default=2048)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (0: torch's default); 1 is steadier on a shared CPU"
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--json", default="", help="also write the results to this file (bench/gpu_check.sh's table)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke:  # flags given explicitly still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()

    import torch

    from agentrl.learner.batching import collate, plan_microbatches
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.model import load_causal_lm
    from agentrl.learner.trainer import Trainer, TrainerSpec
    from agentrl.models.builder import init_model

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_path = args.model_path
    tmp = None
    if not model_path:
        tmp = tempfile.TemporaryDirectory()
        model_path = str(init_model(Path(tmp.name) / args.size, args.size))
    dist_info = init_distributed(args.device)
    device = dist_info.device
    spec = TrainerSpec(model_path=model_path, lr=1e-5, max_tokens_per_microbatch=args.microbatch_tokens)
    trainer = Trainer(spec, dist_info)
    vocab = min(trainer.vocab_size, 2048)
    samples = synthetic_samples(args.groups, args.group_size, args.min_len, args.max_len, vocab, seed=0)
    tokens = sum(s.num_tokens for s in samples)
    mean_len = tokens / len(samples)

    bare_model = load_causal_lm(model_path, device=device)
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-5)
    plan = plan_microbatches([s.num_tokens for s in samples], args.microbatch_tokens, 1)[0]
    micro_batches = [collate([samples[i] for i in idx]).to(device) for idx in plan]
    n_loss = float(sum(mb.num_loss_tokens for mb in micro_batches))

    def bare_step() -> None:
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if device.type == "cuda"
            else torch.autocast("cpu", enabled=False)
        )
        for mb in micro_batches:
            with autocast:
                keep = mb.loss_mask.nonzero().squeeze(-1)  # the LM head on loss positions only, as the learner
                out = bare_model(
                    input_ids=mb.input_ids,
                    position_ids=mb.position_ids,
                    cu_seq_lens_q=mb.cu_seqlens,
                    use_cache=False,
                    logits_to_keep=keep,
                )
            logprobs = torch.log_softmax(out.logits[0].float(), -1).gather(-1, mb.targets[keep, None]).squeeze(-1)
            ratio = torch.exp(logprobs - logprobs.detach())
            loss = -(ratio * mb.advantages[keep]).sum() / n_loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(bare_model.parameters(), 1.0)
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)

    def timed(fn) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process)."""
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, time.process_time() - cpu_start

    for _ in range(args.warmup):
        timed(lambda: trainer.rl_step(samples))
        timed(bare_step)
    learner_t, bare_t = [], []
    for _ in range(args.steps):
        learner_t.append(timed(lambda: trainer.rl_step(samples)))
        bare_t.append(timed(bare_step))
    print(f"model {Path(model_path).name} ({sum(p.numel() for p in bare_model.parameters()):,} parameters) on {device}")
    print(
        f"batch: {len(samples)} sequences, {tokens} tokens (mean length {mean_len:.0f}), "
        f"{len(micro_batches)} micro-batches of <= {args.microbatch_tokens} tokens"
    )
    clocks = [("wall", 0)] + ([("cpu", 1)] if device.type == "cpu" else [])
    for clock, i in clocks:
        learner_tps = tokens / statistics.median(t[i] for t in learner_t)
        bare_tps = tokens / statistics.median(t[i] for t in bare_t)
        print(
            f"[{clock:4s}] learner {learner_tps:10,.0f} tokens/s | bare {bare_tps:10,.0f} tokens/s | "
            f"ratio learner/bare = {learner_tps / bare_tps:.3f} (overhead {100 * (1 - learner_tps / bare_tps):+.1f}%, "
            f"target <= 10%; median of {args.steps} steps)"
        )
    learner_tps = tokens / statistics.median(t[0] for t in learner_t)
    bare_tps = tokens / statistics.median(t[0] for t in bare_t)
    fpt = flops_per_token(trainer.hf_config, mean_len)
    result = {
        "model": Path(model_path).name,
        "parameters": sum(p.numel() for p in bare_model.parameters()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tokens": tokens,
        "microbatch_tokens": args.microbatch_tokens,
        "learner_tokens_per_s": learner_tps,
        "bare_tokens_per_s": bare_tps,
        "peak_tflops": args.peak_tflops,
        "mfu_learner": fpt * learner_tps / (args.peak_tflops * 1e12),
        "mfu_bare": fpt * bare_tps / (args.peak_tflops * 1e12),
    }
    if device.type == "cuda":
        for name in ("learner", "bare"):
            print(f"MFU {name:8s} {100 * result['mfu_' + name]:5.1f}%  (peak {args.peak_tflops:.0f} TFLOP/s)")
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        print(f"peak GPU memory {result['peak_memory_gib']:.1f} GiB")
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(result, indent=2))
    from agentrl.learner.distributed import shutdown_distributed

    shutdown_distributed()
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
