"""Cost of ``--tp-size 2`` (one shadow rank in the weight group) against ``--tp-size 1``, side by side.

Two embedded engines serve the ``small`` model, one with ``--tp-size 2`` (its shadow rank receives
every tensor into scratch and drops it). A trainer pushes the same weights to each, alternating,
and the best push of each counts; then the same short generation workload runs on each, to show
that an idle shadow costs generation nothing.

    python bench/tp_shadow.py       # about a minute on a (busy) 2-core CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMOKE = {"size": "tiny", "reps": 1}
SMOKE_HELP = "the same code path on the smallest sizes, in seconds: checks the path, not the numbers"


def join(url: str, world: int, group: str):
    import httpx

    from agentrl.net import free_port
    from agentrl.weight_group import init_weight_group

    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            httpx.post,
            url + "/init_weights_update_group",
            timeout=120,
            json={
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": world,
                "group_name": group,
                "backend": "gloo",
            },
        )
        pg = init_weight_group("gloo", "127.0.0.1", port, world, 0, group, timeout_s=120)
        assert answer.result().json()["success"], answer.result().text
    return pg


def push(url: str, pg, named, group: str, version: int) -> float:
    import httpx
    import torch.distributed as dist

    from agentrl.weight_group import dtype_name

    t0 = time.perf_counter()
    assert httpx.post(url + "/begin_weight_update", json={}, timeout=60).json()["success"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            httpx.post,
            url + "/update_weights_from_distributed",
            timeout=120,
            json={
                "names": [n for n, _ in named],
                "dtypes": [dtype_name(t.dtype) for _, t in named],
                "shapes": [list(t.shape) for _, t in named],
                "group_name": group,
                "weight_version": str(version),
                "flush_cache": False,
            },
        )
        for w in [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in named]:
            w.wait()
        assert answer.result().json()["success"], answer.result().text
    assert httpx.post(url + "/end_weight_update", json={}, timeout=60).json()["success"]
    return time.perf_counter() - t0


def generate(url: str, n: int) -> float:
    """Tokens/s of ``n`` concurrent 32-token greedy generations."""
    import httpx

    def one(i: int) -> int:
        body = {"input_ids": [5 + i % 50, 6, 7], "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}}
        return httpx.post(url + "/generate", json=body, timeout=120).json()["meta_info"]["completion_tokens"]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        tokens = sum(pool.map(one, range(n)))
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=4, help="pushes / generation rounds per engine (best counts)")
    ap.add_argument("--model", default="", help="model folder (default: build one of --size in a temp dir)")
    ap.add_argument("--size", default="small", help="size to build when --model is not given")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:  # flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind: the finally blocks stop what was started

    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.engine.launch import EngineProcess, wait_ready
    from agentrl.models.builder import init_model
    from agentrl.net import free_port
    from agentrl.weight_group import destroy_weight_group

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="agentrl-bench-"))
    model_path = Path(args.model) if args.model else init_model(tmp / args.size, args.size)
    flags = ["--num-threads", "1", "--weight-version", "0"]
    engines = {
        tp: EngineProcess(
            str(model_path), free_port(), extra=[*flags, "--tp-size", str(tp)], log_path=tmp / f"tp{tp}.log"
        ).start(wait_s=0)
        for tp in (1, 2)
    }
    try:
        for e in engines.values():
            wait_ready(e.url, 300, process=e.process)
        named = [
            (n, p.detach())
            for n, p in AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).named_parameters()
        ]
        mib = sum(t.numel() * t.element_size() for _, t in named) / 2**20
        groups = {tp: join(e.url, 1 + tp, f"tp{tp}") for tp, e in engines.items()}
        pushes: dict[int, list[float]] = {1: [], 2: []}
        gens: dict[int, list[float]] = {1: [], 2: []}
        for v in range(args.reps):  # alternate, so both see the same machine load
            for tp, e in engines.items():
                pushes[tp].append(push(e.url, groups[tp], named, f"tp{tp}", v + 1))
        for _ in range(args.reps):
            for tp, e in engines.items():
                gens[tp].append(generate(e.url, 8))
        for pg in groups.values():
            destroy_weight_group(pg)
    finally:
        for e in engines.values():
            e.stop()

    p1, p2 = min(pushes[1]), min(pushes[2])
    g1, g2 = max(gens[1]), max(gens[2])
    print(f"{model_path.name} model, {mib:.0f} MiB in {len(named)} tensors, one bucket, gloo; best of {args.reps}")
    print(f"{'':<28} {'--tp-size 1':>12} {'--tp-size 2':>12} {'tp2 / tp1':>10}")
    print(f"{'weight push (ms)':<28} {p1 * 1e3:>12.1f} {p2 * 1e3:>12.1f} {p2 / p1:>9.2f}x")
    print(f"{'generation (tokens/s)':<28} {g1:>12.0f} {g2:>12.0f} {g2 / g1:>9.2f}x")
    print(f"shadow rank scratch memory during a push: one bucket ({mib:.0f} MiB here), freed after it")


if __name__ == "__main__":
    main()
