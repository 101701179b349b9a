"""Actor benchmark: framework overhead per turn, and concurrent episodes in one process.

An engine that answers instantly (a raw asyncio HTTP server in its own process, no model) returns
a scripted tool call, then an answer. The same HTTP calls run twice, side by side: a **bare loop**
of trio tasks that only POST /generate (the cost of HTTP alone), and the **framework**, one
:class:`ActorService` running the same episodes in groups. Prints turns/s for both and their
ratio (target >= 0.8: the actor is never the bottleneck), CPU time per turn for both, and the
framework's turns/s with an in-process engine as its ceiling. See docs/performance.md.

    python bench/actors.py --concurrency 1000 --episodes 4000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOKE = {"concurrency": 8, "episodes": 16, "group_size": 4, "repeats": 1}
SMOKE_HELP = "the same code path on the smallest sizes, in seconds: checks the path, not the numbers"


# ----------------------------------------------------------------------------- the instant engine


def serve(port: int, script: dict[str, Any]) -> None:
    """A minimal HTTP/1.1 keep-alive server answering /generate from ``script`` at once."""
    tool_ids, answer_ids = script["tool_ids"], script["answer_ids"]
    marker, turns = script["marker"], script["turns"]

    def answer(body: bytes) -> bytes:
        req = json.loads(body)
        ids = req["input_ids"]
        out = tool_ids if ids.count(marker) < turns - 1 else answer_ids
        out = out[: req["sampling_params"].get("max_new_tokens", 128)]
        return json.dumps(
            {
                "text": "",
                "output_ids": out,
                "meta_info": {
                    "id": req.get("rid", ""),
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(out),
                    "finish_reason": {"type": "stop", "matched": out[-1]},
                    "weight_version": "0",
                    "output_token_logprobs": [[-0.1, t, None] for t in out],
                },
            }
        ).encode()

    class Http(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buf = transport, b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while True:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = self.buf[:end].decode("latin-1").lower()
                length = 0
                for line in head.split("\r\n"):
                    if line.startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                if len(self.buf) < end + 4 + length:
                    return
                body, self.buf = self.buf[end + 4 : end + 4 + length], self.buf[end + 4 + length :]
                payload = answer(body) if head.startswith("post /generate") else b"{}"
                self.transport.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(payload)).encode()
                    + b"\r\n\r\n"
                    + payload
                )

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Http, "127.0.0.1", port, backlog=4096)
        await server.serve_forever()

    asyncio.run(main())


# ----------------------------------------------------------------------------- clients


class BareHttpClient:
    """The EngineClient interface in a few lines of httpx (``--client bare``), answering the engine
    client's own :class:`~agentrl.engine.client.GenerateResult`.

    httpx's connection pool degrades badly with many waiting requests (at 1,000 concurrent requests
    on 64 connections it spent ~30 ms of CPU per request here and timed out), so requests are
    admitted through a semaphore of ``max_in_flight`` first.
    """

    def __init__(self, urls: list[str], max_in_flight: int = 16, **_: Any):
        import httpx
        import trio

        self.url = urls[0]
        self.gate = trio.Semaphore(max_in_flight)
        self.http = httpx.AsyncClient(
            timeout=120, limits=httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
        )

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.http.aclose()

    async def generate(self, input_ids, sampling_params, *, affinity_key=None, rid=None, return_logprob=True):
        async with self.gate:
            r = await self.http.post(
                self.url + "/generate",
                json={
                    "input_ids": input_ids,
                    "rid": rid,
                    "sampling_params": sampling_params,
                    "return_logprob": return_logprob,
                },
            )
        r.raise_for_status()
        from agentrl.engine.client import GenerateResult

        return GenerateResult.from_response(r.json(), self.url)


class InstantClient:
    """An in-process engine (no HTTP): the framework's own ceiling. Its results are the engine client's
    :class:`~agentrl.engine.client.GenerateResult`, so that they keep whatever the episode reads of them."""

    def __init__(self, script: dict[str, Any]):
        self.script = script

    async def generate(self, input_ids, sampling_params, *, affinity_key=None, rid=None, return_logprob=True):
        import trio

        from agentrl.engine.client import GenerateResult

        await trio.lowlevel.checkpoint()
        s = self.script
        out = s["tool_ids"] if input_ids.count(s["marker"]) < s["turns"] - 1 else s["answer_ids"]
        return GenerateResult(list(out), [-0.1] * len(out), "", {"type": "stop"}, "0", len(input_ids), {}, "in-process")


def make_client(kind: str, url: str):
    if kind == "real":
        from agentrl.engine.client import EngineClient

        return EngineClient([url], max_retries=0)
    return BareHttpClient([url])


# ----------------------------------------------------------------------------- the env


def bench_env(turns: int):
    from agentrl.envs.base import Env, Task
    from agentrl.tools.base import tool

    @tool
    async def add(a: int, b: int) -> str:  # async: a sync tool costs a thread hop in the ToolBox (~0.3 ms)
        """Add two integers.

        Args:
            a: first.
            b: second.
        """
        return str(a + b)

    class BenchEnv(Env):
        name = "bench"

        def tasks(self, split="train", seed=0):
            i = 0
            while True:
                yield Task(id=str(i), data={})
                i += 1

        def initial_messages(self, task):
            return [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 2 + 3?"}]

        def tools(self):
            return [add]

        async def reward(self, task, state, messages):
            return 1.0 if "5" in messages[-1]["content"] else 0.0

    return BenchEnv()


def load_tokenizer(model: str):
    if model:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)
    from agentrl.models.builder import build_tokenizer

    return build_tokenizer(512, seed=0)


def make_script(tokenizer, turns: int) -> dict[str, Any]:
    from agentrl.episode.chat import codec_for

    codec = codec_for(tokenizer)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    return {
        "tool_ids": codec.encode(call) + [codec.end_of_turn_id],
        "answer_ids": codec.encode("The answer is 5.") + [codec.end_of_turn_id],
        "marker": tokenizer.convert_tokens_to_ids("<tool_response>"),
        "turns": turns,
    }


# ----------------------------------------------------------------------------- the two loops


async def bare_loop(client, script, prompt_ids, observation_ids, episodes: int, concurrency: int) -> int:
    """The same HTTP calls as the framework makes, without the framework."""
    import trio

    remaining = [episodes]
    turns = [0]

    async def worker(w: int) -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            ids = list(prompt_ids)
            for t in range(script["turns"]):
                res = await client.generate(
                    ids, {"temperature": 1.0, "max_new_tokens": 64}, affinity_key=str(w), rid=f"{w}-{t}"
                )
                ids = ids + res.output_ids + (observation_ids if t < script["turns"] - 1 else [])
                turns[0] += 1

    async with trio.open_nursery() as nursery:
        for w in range(concurrency):
            nursery.start_soon(worker, w)
    return turns[0]


async def framework_loop(client, tokenizer, env, episodes: int, concurrency: int, group_size: int) -> dict:
    from agentrl.actors.actor import ActorEnv, ActorService, ActorSettings
    from agentrl.episode.rollout import toolbox_for
    from agentrl.episode.turn import EpisodeLimits

    class Discard:
        async def send(self, group):
            pass

    settings = ActorSettings(
        group_size=group_size,
        num_concurrent_episodes=concurrency,
        max_groups=max(1, episodes // group_size),
        log_interval_s=0,
        max_consecutive_lost=1,  # a lost group is a failed bench: stop at once (the report says why)
    )
    limits = EpisodeLimits(max_turns=8, max_total_tokens=2048, max_new_tokens_per_turn=64)
    service = ActorService(
        client=client,
        tokenizer=tokenizer,
        envs=[ActorEnv(env, toolbox_for(env), limits)],
        sampling={"temperature": 1.0},
        settings=settings,
        sender=Discard(),
    )
    peak = [0]

    async def watch():
        import trio

        while True:
            peak[0] = max(peak[0], service.open_groups * group_size)
            await trio.sleep(0.05)

    import trio

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        report = await service.run()
        nursery.cancel_scope.cancel()
    report["peak_concurrent_episodes"] = peak[0]
    return report


def measure(fn) -> tuple[Any, float, float]:
    import trio

    wall, cpu = time.perf_counter(), time.process_time()
    out = trio.run(fn)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=1000, help="concurrent episodes")
    ap.add_argument("--episodes", type=int, default=1000, help="episodes per measurement")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--turns", type=int, default=2, help="model turns per episode")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="measure this many (bare, framework) pairs back to back; report the medians",
    )
    ap.add_argument(
        "--client",
        choices=["real", "bare"],
        default="real",
        help="agentrl.engine.client.EngineClient (real) or a minimal httpx client (bare)",
    )
    ap.add_argument("--model", default="", help="model folder whose tokenizer to use (default: build a small BPE)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--script", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:  # flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    if args.serve:
        serve(args.serve, json.loads(args.script))
        return

    from agentrl.episode.chat import TokenChat, codec_for
    from agentrl.episode.rollout import toolbox_for

    tokenizer = load_tokenizer(args.model)
    env = bench_env(args.turns)
    script = make_script(tokenizer, args.turns)
    kind = args.client
    # the exact token sequences the framework sends, for the bare loop
    chat = TokenChat.start(codec_for(tokenizer), env.initial_messages(None), toolbox_for(env).schemas())
    prompt_ids = list(chat.tokens)
    chat.append_model(script["tool_ids"], [0.0] * len(script["tool_ids"]), [0] * len(script["tool_ids"]))
    before = len(chat.tokens)
    chat.close_turn_and_add([{"role": "tool", "name": "add", "content": "5"}])
    observation_ids = chat.tokens[before:]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--script", json.dumps(script)])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        print(
            f"actors bench: {args.concurrency} concurrent episodes, {args.episodes} episodes of {args.turns} turns "
            f"per run, groups of {args.group_size}, client={kind}, prompt {len(prompt_ids)} tokens, "
            f"{os.cpu_count()} CPUs"
        )

        async def run_bare(n=args.episodes):
            client = make_client(kind, url)
            async with client:
                return await bare_loop(client, script, prompt_ids, observation_ids, n, args.concurrency)

        async def run_framework(n=args.episodes):
            client = make_client(kind, url)
            async with client:
                return await framework_loop(client, tokenizer, env, n, args.concurrency, args.group_size)

        if not args.smoke:
            measure(lambda: run_bare(min(args.episodes, 500)))  # warm up both paths
            measure(lambda: run_framework(min(args.episodes, 500)))
        pairs = []
        for _ in range(args.repeats):
            turns, wall, cpu = measure(run_bare)
            bare = (turns / wall, cpu / turns)
            report, wall, cpu = measure(run_framework)
            turns = report["turns_mean"] * report["episodes"]
            assert report["reward_mean"] == 1.0 and report["groups_lost"] == 0, report
            pairs.append((*bare, turns / wall, cpu / turns, report["peak_concurrent_episodes"]))
            print(f"  pair: bare {bare[0]:.0f} turns/s, framework {turns / wall:.0f} turns/s", flush=True)
        b_rate, b_cpu, f_rate, f_cpu = (statistics.median(p[i] for p in pairs) for i in range(4))
        ratio = statistics.median(p[2] / p[0] for p in pairs)
        peak = max(p[4] for p in pairs)

        async def run_instant():
            return await framework_loop(
                InstantClient(script), tokenizer, env, args.episodes, args.concurrency, args.group_size
            )

        report, wall, cpu = measure(run_instant)
        i_rate = report["turns_mean"] * report["episodes"] / wall
        print(f"{'loop':<34}{'turns/s':>10}{'actor CPU ms/turn':>20}")
        print(f"{'bare HTTP loop':<34}{b_rate:>10.0f}{b_cpu * 1e3:>20.3f}")
        print(f"{'framework over HTTP':<34}{f_rate:>10.0f}{f_cpu * 1e3:>20.3f}")
        print(f"{'framework, in-process engine':<34}{i_rate:>10.0f}{cpu / (i_rate * wall) * 1e3:>20.3f}")
        print(f"peak concurrent episodes in the framework run: {peak}")
        print(f"framework overhead per turn: {(f_cpu - b_cpu) * 1e3:.3f} ms of actor CPU")
        print(f"ratio framework / bare loop (median of {len(pairs)} back-to-back pairs): {ratio:.2f} (target >= 0.8)")
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
