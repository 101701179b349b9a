"""Simulated SGLang engines for bench/scale.py: many in one process (asyncio, one port each), no model.

Each engine answers what agentrl's clients call (``/generate``, ``/ping``, ``/health``, ``/model_info``,
``/server_info``, pause/continue, versions, begin/end, the bucket updates, ``/flush_cache``,
``/abort_request``) with SGLang 0.5.23's field names, over a minimal HTTP/1.1 server (keep-alive,
``content-length`` bodies): cheap enough that 256 engines share a core with room to spare.

Latency model (:class:`LatencyModel`), per engine: at most ``max_batch`` requests run, the rest wait
in order. A request admitted while ``r`` others run takes ``prefill_s_per_token`` per uncached prompt
token plus, per output token, one decode step of ``decode_s_per_step + decode_s_per_seq * r``. The
prefix cache is approximated per engine from the request ids agentrl sends (``<episode>-<turn>-<part>#…``,
episode ``<group>-<i>``): an episode's last sequence and its group's first prompt are cached.

Replies: random ids of ordinary tokens (letters only, so no accidental tool call or special token),
``out_tokens`` on average (0.5-1.5x), capped by ``max_new_tokens``; with probability ``tool_rate`` the
turn ends with a well-formed calculator ``<tool_call>`` and the end-of-turn id, else with the end-of-turn
id alone (``stop``), or is cut (``length``). A pause with mode ``abort`` ends running requests with
their partial output (``abort``), as SGLang does; requests wait while paused.

``GET /_sim/stats`` (any port) reports every engine of the process and its CPU time.

    python bench/_sim_engine.py --base-port 31000 --count 64 --model runs/models/tiny [--ready-file F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import signal
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

try:
    from orjson import dumps, loads
except ImportError:  # orjson is not a dependency of agentrl; json is slower, not different

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj).encode()

    loads = json.loads

CACHE_ENTRIES = 4096  # episodes (and groups) an engine's simulated prefix cache remembers
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'


@dataclass(frozen=True)
class LatencyModel:
    prefill_s_per_token: float = 2e-5
    decode_s_per_step: float = 0.004
    decode_s_per_seq: float = 0.0
    max_batch: int = 64
    out_tokens: int = 32
    tool_rate: float = 0.6

    def request_s(self, uncached_prompt: int, out_tokens: int, running: int) -> float:
        """Seconds a request takes once admitted, with ``running`` others in the batch."""
        step = self.decode_s_per_step + self.decode_s_per_seq * running
        return uncached_prompt * self.prefill_s_per_token + out_tokens * step


@dataclass(frozen=True)
class Vocabulary:
    filler: list[int]  # ordinary tokens (letters only)
    tool_call: list[int]  # a well-formed calculator call
    end_of_turn: int

    @classmethod
    def from_tokenizer(cls, path: str) -> Vocabulary:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        special = set(tok.all_special_ids)
        filler = [
            i for i in range(len(tok)) if i not in special and tok.convert_ids_to_tokens(i).replace("Ġ", "").isalpha()
        ]
        eot = tok.convert_tokens_to_ids("<|im_end|>")
        return cls(filler, tok.encode(TOOL_CALL, add_special_tokens=False), int(eot))


def plan_reply(rng: random.Random, vocab: Vocabulary, model: LatencyModel, max_new: int) -> tuple[list[int], dict]:
    """The ids a turn returns and its finish reason (module docstring)."""
    want = max(1, round(model.out_tokens * rng.uniform(0.5, 1.5)))
    tool = rng.random() < model.tool_rate
    tail = [*vocab.tool_call, vocab.end_of_turn] if tool else [vocab.end_of_turn]
    want = max(want, len(tail))
    if want > max_new:
        return rng.choices(vocab.filler, k=max_new), {"type": "length", "length": max_new}
    ids = rng.choices(vocab.filler, k=want - len(tail)) + tail
    return ids, {"type": "stop", "matched": vocab.end_of_turn}


def cache_keys(rid: str) -> tuple[str, str]:
    """(episode, group) of an agentrl request id ``<group>-<i>-<turn>-<part>#hex``; ("", "") otherwise."""
    base = rid.split("#", 1)[0]
    parts = base.rsplit("-", 3)
    if len(parts) < 4:
        return "", ""
    return f"{parts[0]}-{parts[1]}", parts[0]


@dataclass
class EngineStats:
    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    uncached_tokens: int = 0
    output_tokens: int = 0
    busy_slot_s: float = 0.0  # summed request durations (utilisation = busy_slot_s / (max_batch * wall))
    max_running: int = 0
    max_waiting: int = 0
    pushes: int = 0


@dataclass
class SimEngine:
    index: int
    model: LatencyModel
    vocab: Vocabulary
    version: str = "0"
    stats: EngineStats = field(default_factory=EngineStats)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.index)
        self.slots = asyncio.Semaphore(self.model.max_batch)
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.running: set[asyncio.Future] = set()
        self.waiting = 0
        self.cache: OrderedDict[str, int] = OrderedDict()

    def _cached(self, rid: str, prompt: int) -> int:
        episode, group = cache_keys(rid)
        hit = max(self.cache.get(episode, 0), min(prompt, self.cache.get(group, 0)))
        return min(hit, prompt)

    def _remember(self, rid: str, prompt: int, total: int) -> None:
        episode, group = cache_keys(rid)
        if not episode:
            return
        self.cache.setdefault(group, prompt)
        self.cache[episode] = total
        self.cache.move_to_end(episode)
        while len(self.cache) > CACHE_ENTRIES:
            self.cache.popitem(last=False)

    async def generate(self, body: dict) -> dict:
        prompt = len(body.get("input_ids") or [])
        max_new = int((body.get("sampling_params") or {}).get("max_new_tokens") or 128)
        rid = str(body.get("rid") or "")
        self.waiting += 1
        self.stats.max_waiting = max(self.stats.max_waiting, self.waiting)
        admitted = False
        try:
            await self.unpaused.wait()
            async with self.slots:
                await self.unpaused.wait()
                self.waiting -= 1
                admitted = True
                ids, finish = plan_reply(self.rng, self.vocab, self.model, max_new)
                ids, finish = await self._run(rid, prompt, ids, finish)
        finally:
            if not admitted:
                self.waiting -= 1
        return self._reply(body, prompt, ids, finish)

    async def _run(self, rid: str, prompt: int, ids: list[int], finish: dict) -> tuple[list[int], dict]:
        uncached = prompt - self._cached(rid, prompt)
        seconds = self.model.request_s(uncached, len(ids), len(self.running))
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self.running.add(done)
        self.stats.max_running = max(self.stats.max_running, len(self.running))
        timer = loop.call_later(seconds, lambda: done.done() or done.set_result(False))
        started = loop.time()
        try:
            aborted = await done
        finally:
            timer.cancel()
            self.running.discard(done)
        elapsed = loop.time() - started
        s = self.stats
        s.requests += 1
        s.prompt_tokens += prompt
        s.uncached_tokens += uncached
        s.busy_slot_s += elapsed
        if aborted:
            s.aborted += 1
            ids = ids[: int(len(ids) * min(1.0, elapsed / max(seconds, 1e-9)))]
            finish = {"type": "abort", "message": "Abort before weight update."}
        s.output_tokens += len(ids)
        self._remember(rid, prompt, prompt + len(ids))
        return ids, finish

    def _reply(self, body: dict, prompt: int, ids: list[int], finish: dict) -> dict:
        lps = [[-self.rng.random() * 3.0, i, None] for i in ids]
        return {
            "text": "",
            "output_ids": ids,
            "meta_info": {
                "id": str(body.get("rid") or ""),
                "prompt_tokens": prompt,
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "finish_reason": finish,
                "weight_version": self.version,
                "output_token_logprobs": lps if body.get("return_logprob") else None,
            },
        }

    def abort_all(self) -> None:
        for done in list(self.running):
            if not done.done():
                done.set_result(True)

    def control(self, path: str, body: dict) -> dict:
        """Every route but /generate (SGLang's answers, reduced to what agentrl reads)."""
        ok = {"success": True, "message": "ok"}
        if path == "/pause_generation":
            self.unpaused.clear()
            if body.get("mode", "abort") == "abort":
                self.abort_all()
        elif path == "/continue_generation":
            self.unpaused.set()
        elif path == "/update_weight_version":
            self.version = str(body.get("new_version"))
            if body.get("abort_all_requests", True):
                self.abort_all()
        elif path == "/update_weights_from_distributed":
            if body.get("weight_version") is not None:
                self.version = str(body["weight_version"])
                self.stats.pushes += 1
        elif path == "/abort_request":
            if body.get("abort_all"):
                self.abort_all()
        elif path in ("/model_info", "/get_model_info"):
            return {"model_path": "sim", "weight_version": self.version, "is_generation": True}
        elif path in ("/server_info", "/get_server_info"):
            return {"tp_size": 1, "dp_size": 1, "version": "0.5.23-sim", "weight_version": self.version}
        return ok


class SimFleet:
    """The engines of this process and their HTTP servers."""

    def __init__(self, engines: list[SimEngine]):
        self.engines = engines
        self.started = time.monotonic()

    def stats(self) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "wall_s": time.monotonic() - self.started,
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "max_batch": self.engines[0].model.max_batch if self.engines else 0,
            "engines": [asdict(e.stats) for e in self.engines],
        }

    async def route(self, engine: SimEngine, method: bytes, path: str, raw: bytes) -> tuple[int, bytes]:
        if path == "/generate":
            return 200, dumps(await engine.generate(loads(raw)))
        if path in ("/ping", "/health", "/health_generate"):
            return 200, b""
        if path == "/_sim/stats":
            return 200, dumps(self.stats())
        body = loads(raw) if raw else {}
        return 200, dumps(engine.control(path, body))

    async def serve_connection(self, engine: SimEngine, reader: asyncio.StreamReader, writer: Any) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, target, _ = lines[0].split(b" ", 2)
                length = 0
                for line in lines[1:]:
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                raw = await reader.readexactly(length) if length else b""
                path = target.split(b"?", 1)[0].decode()
                status, payload = await self.route(engine, method, path, raw)
                kind = b"application/json" if payload else b"text/plain"
                writer.write(
                    b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                    % (status, kind, len(payload), payload)
                )
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


async def serve(args: argparse.Namespace) -> None:
    model = LatencyModel(
        prefill_s_per_token=args.prefill_s_per_token,
        decode_s_per_step=args.decode_s_per_step,
        decode_s_per_seq=args.decode_s_per_seq,
        max_batch=args.max_batch,
        out_tokens=args.out_tokens,
        tool_rate=args.tool_rate,
    )
    vocab = Vocabulary.from_tokenizer(args.model)
    fleet = SimFleet([SimEngine(args.first_index + i, model, vocab) for i in range(args.count)])
    servers = []
    for i, engine in enumerate(fleet.engines):

        async def handler(reader: asyncio.StreamReader, writer: Any, engine: SimEngine = engine) -> None:
            await fleet.serve_connection(engine, reader, writer)

        servers.append(await asyncio.start_server(handler, args.host, args.base_port + i, backlog=1024))
    if args.ready_file:
        ports = json.dumps({"ports": [args.base_port, args.base_port + args.count - 1]})
        await asyncio.to_thread(Path(args.ready_file).write_text, ports)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--base-port", type=int, required=True)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--first-index", type=int, default=0, help="seed offset of this process's engines")
    p.add_argument("--model", required=True, help="folder with the tokenizer (token ids of the replies)")
    p.add_argument("--ready-file", default="")
    for name, value in asdict(LatencyModel()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args))
    else:
        uvloop.run(serve(args))


if __name__ == "__main__":
    main()
