"""The embedded engine's prefix cache on a multi-turn workload, side by side in one run.

Two engine processes serve the same model, with and without the prefix cache. Each episode is an
agent loop over HTTP (a 60-token prompt, then ``--turns`` turns of 24 generated tokens each followed
by a 12-token tool result); both engines play the same episodes in alternating rounds. Prints
turns/s, prefill tokens saved, and the ratio. See docs/performance.md.

    python bench/prefix_cache.py            # about a minute on a 2-core CPU
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SYSTEM = 48  # tokens shared by every episode's prompt
QUESTION = 12
OUTPUT = 24
TOOL_RESULT = 12
SMOKE = {"episodes": 4, "turns": 2, "concurrency": 4, "rounds": 1}
SMOKE_HELP = "the same code path on the smallest sizes, in seconds: checks the path, not the numbers"


def episodes(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(SYSTEM)]
    return [system + [rng.randrange(3, 500) for _ in range(QUESTION)] for _ in range(n)]


async def play(url: str, prompts: list[list[int]], turns: int, concurrency: int) -> float:
    from agentrl.engine.client import EngineClient

    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(0)
    results = [[rng.randrange(3, 500) for _ in range(TOOL_RESULT)] for _ in range(turns)]
    async with EngineClient([url]) as client:  # its small httpx pools keep this process's CPU low

        async def episode(prompt: list[int]) -> int:
            async with sem:
                for turn in range(turns):
                    r = await client.generate(
                        prompt, {"max_new_tokens": OUTPUT, "temperature": 1.0, "ignore_eos": True}, return_logprob=False
                    )
                    prompt = prompt + r.output_ids + results[turn]
            return turns

        t0 = time.perf_counter()
        done = await asyncio.gather(*[episode(p) for p in prompts])
        return sum(done) / (time.perf_counter() - t0)


def server_info(url: str) -> dict:
    import httpx

    return httpx.get(url + "/server_info", timeout=10).json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="model folder (default: build the tiny model in a temp dir)")
    ap.add_argument("--episodes", type=int, default=96)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:  # flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind: the finally blocks stop what was started

    from agentrl.engine.launch import EngineProcess, wait_ready
    from agentrl.models.builder import init_model
    from agentrl.net import free_port

    tmp = Path(tempfile.mkdtemp(prefix="agentrl-bench-"))
    model = args.model or str(init_model(tmp / "tiny", "tiny"))
    flags = [
        "--num-threads",
        str(args.threads),
        "--device",
        "cpu",
        "--max-running-requests",
        str(args.concurrency),
        "--max-context-tokens",
        "512",
    ]
    engines = {
        "cache": EngineProcess(model, free_port(), extra=flags, log_path=tmp / "cache.log").start(wait_s=0),
        "no cache": EngineProcess(
            model, free_port(), extra=[*flags, "--prefix-cache-tokens", "0"], log_path=tmp / "nocache.log"
        ).start(wait_s=0),
    }
    best = {name: 0.0 for name in engines}
    try:
        for e in engines.values():
            wait_ready(e.url, 300, process=e.process)
            asyncio.run(play(e.url, episodes(8, seed=1), 2, 8))  # warm-up
        prompts = episodes(args.episodes, seed=2)
        for _ in range(args.rounds):  # alternate, so both see the same machine load
            for name, e in engines.items():
                best[name] = max(best[name], asyncio.run(play(e.url, prompts, args.turns, args.concurrency)))
                print(f"  {name:<8} {best[name]:7.1f} turns/s (best so far)", flush=True)
        saved = server_info(engines["cache"].url)["prefix_cache_hit_tokens"]
    finally:
        for e in engines.values():
            e.stop()
    print(
        f"\n{args.episodes} episodes x {args.turns} turns, concurrency {args.concurrency}, "
        f"{args.threads} torch thread(s), best of {args.rounds} rounds"
    )
    print(f"  with prefix cache    {best['cache']:8.1f} turns/s ({saved:,} prefill tokens served from the cache)")
    print(f"  without              {best['no cache']:8.1f} turns/s")
    print(f"  ratio                {best['cache'] / best['no cache']:8.2f}x")


if __name__ == "__main__":
    main()
