"""Agent endpoint benchmark: what an existing agent's call costs on top of the engine call it makes.

An instant engine (bench/actors.py's server) answers every /generate. Side by side, with the same
engine calls, concurrency and growing prompts: **bare** (``EngineClient.generate`` directly),
**endpoint** (``AgentRunner`` episodes posting through the agent endpoint with httpx) and
**endpoint+sdk** (the same with the official ``openai`` SDK). Prints calls/s, the ratio to bare,
and CPU time per call of this process. See docs/performance.md.

    python bench/agents.py --episodes 64 --turns 4 --concurrency 16
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOKE = {"episodes": 4, "turns": 2, "concurrency": 2, "repeats": 1}
SMOKE_HELP = "the same code path on the smallest sizes, in seconds: checks the path, not the numbers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_tokenizer(model: str):
    if model:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)
    from agentrl.models.builder import SIZES, build_tokenizer

    return build_tokenizer(SIZES["tiny"]["vocab_target"], seed=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="", help="model folder whose tokenizer to use (default: build the tiny one)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:  # flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()

    import httpx
    import trio

    from agentrl.agents.agent_runner import AgentRunner
    from agentrl.engine.client import EngineClient
    from agentrl.envs.agent import AgentEnv
    from agentrl.envs.base import Task
    from agentrl.episode.chat import ChatCodec, TokenChat

    tokenizer = load_tokenizer(args.model)
    codec = ChatCodec(tokenizer)
    answer = codec.encode("The answer is 5.") + [codec.end_of_turn_id]
    script = {"tool_ids": answer, "answer_ids": answer, "marker": -1, "turns": 1}
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "actors.py"), "--serve", str(port), "--script", json.dumps(script)]
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        user = [{"role": "user", "content": "What is 2 + 3? Think about it, then answer."}]
        follow = {"role": "user", "content": "Are you sure? Check again."}
        calls = args.episodes * args.turns

        class Sdk(AgentEnv):
            async def run(self, task, client):
                messages = list(user)
                for _ in range(args.turns):
                    reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=32)
                    messages += [reply.choices[0].message.model_dump(exclude_none=True), follow]
                return 1.0

        class Plain(AgentEnv):
            async def run(self, task, client):
                messages = list(user)
                async with httpx.AsyncClient(base_url=str(client.base_url), verify=False) as http:  # http: no CA
                    for _ in range(args.turns):
                        r = await http.post(
                            "chat/completions", json={"model": "m", "messages": messages, "max_tokens": 32}
                        )
                        message = r.json()["choices"][0]["message"]
                        messages += [{"role": "assistant", "content": message["content"]}, follow]
                return 1.0

        async def bare() -> None:
            async with EngineClient([url], max_retries=0) as engine:
                limiter = trio.CapacityLimiter(args.concurrency)

                async def episode(i: int) -> None:
                    async with limiter:
                        chat = TokenChat.start(codec, user, None)
                        for _ in range(args.turns):
                            r = await engine.generate(chat.tokens, {"max_new_tokens": 32}, affinity_key=str(i))
                            chat.append_model(r.output_ids, r.output_logprobs, [0] * len(r.output_ids))
                            chat.close_turn_and_add([follow])

                async with trio.open_nursery() as nursery:
                    for i in range(args.episodes):
                        nursery.start_soon(episode, i)

        async def endpoint(env: AgentEnv) -> None:
            async with AgentRunner(tokenizer, lambda: EngineClient([url], max_retries=0)) as runner:
                limiter = trio.CapacityLimiter(args.concurrency)
                sequences = []

                async def episode(i: int) -> None:
                    async with limiter:
                        sequences.extend(await runner.play(env, Task(str(i))))

                async with trio.open_nursery() as nursery:
                    for i in range(args.episodes):
                        nursery.start_soon(episode, i)
                assert len(sequences) == args.episodes, "every episode must be one stitched sequence"

        import openai  # noqa: F401 - imported before timing (a second, once per process)

        cases = {"bare": bare, "endpoint": lambda: endpoint(Plain()), "endpoint+sdk": lambda: endpoint(Sdk())}
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        for _ in range(args.repeats):  # interleaved: this machine's load drifts
            for name, fn in cases.items():
                wall, cpu = time.perf_counter(), time.process_time()
                trio.run(fn)
                results[name].append((time.perf_counter() - wall, time.process_time() - cpu))
        print(
            f"{args.episodes} episodes x {args.turns} calls, concurrency {args.concurrency}, instant engine "
            f"(best of {args.repeats}; runner start-up included)"
        )
        best = {k: (min(w for w, _ in v), min(c for _, c in v)) for k, v in results.items()}
        for name, (wall, cpu) in best.items():
            print(
                f"{name:13s} {calls / wall:8.1f} calls/s ({best['bare'][0] / wall:4.2f} of bare)   "
                f"{1e3 * cpu / calls:6.2f} ms CPU per call ({1e3 * (cpu - best['bare'][1]) / calls:+.2f})"
            )
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
