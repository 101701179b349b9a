"""Test parts for the actor tests: a scripted SGLang-style engine served over real HTTP, a small
HTTP client with the EngineClient interface, and in-memory transport doubles (subclasses of
the transport's interfaces, so they follow its contract).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from agentrl.protocol import Progress, TrajectoryGroup, decode, encode
from agentrl.transport.base import GroupSink, ProgressSource

_TINY: dict[str, Path] = {}


def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny model (random weights) and its tokenizer, built once per test session."""
    if "model" not in _TINY:
        from agentrl.models.builder import init_model

        _TINY["model"] = init_model(tmp_path_factory.mktemp("actors-tiny") / "tiny", "tiny")
    return _TINY["model"]


def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny model's tokenizer alone (no torch, no weights: seconds faster), built once per session."""
    if "tokenizer" not in _TINY:
        from agentrl.models.builder import SIZES, build_tokenizer

        path = tmp_path_factory.mktemp("actors-tokenizer") / "tiny"
        build_tokenizer(SIZES["tiny"]["vocab_target"], seed=0).save_pretrained(path)
        _TINY["tokenizer"] = path
    return _TINY["tokenizer"]


_TOKENIZERS: dict[Path, Any] = {}


def load_tokenizer(path: Path):
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[path]


def fake_logprob(token_id: int, position: int) -> float:
    """Deterministic per-token logprobs, so alignment can be checked exactly."""
    return -((token_id * 31 + position * 7) % 97) / 50.0 - 0.01


# ----------------------------------------------------------------------------- engine


@dataclass
class Reply:
    ids: list[int]
    finish: str  # stop | length
    logprobs: list[float] | None = None


class ScriptedEngine:
    """SGLang's ``POST /generate`` (input_ids in; output_ids, logprobs, finish_reason and
    weight_version out), answering from ``policy(input_ids, sampling_params) -> Reply``.

    ``abort_plan``: for each of the next requests, the number of tokens after which the request
    is aborted (``finish_reason.type == "abort"`` with the partial output), each followed by a
    weight-version bump, as a weight update with ``pause_generation(mode="abort")`` does.
    """

    def __init__(self, policy: Callable[[list[int], dict], Reply], *, version: int = 0, delay_s: float = 0.0):
        self.policy = policy
        self.version = version
        self.delay_s = delay_s
        self.abort_plan: list[int] = []
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None
        self.url = ""

    async def _app(self, scope, receive, send) -> None:  # a bare ASGI app: /generate and /health
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await _respond(send, 200, b"{}")
            return
        if scope["path"] in ("/model_info", "/get_model_info"):
            body = {"model_path": "scripted", "weight_version": str(self.version), "is_generation": True}
            await _respond(send, 200, json.dumps(body).encode())
            return
        if scope["path"] != "/generate":
            await _respond(send, 404, b'{"error": "not found"}')
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        req = json.loads(body)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        with self.lock:
            self.requests.append(req)
            try:
                out = self._generate(req)
            except Exception as e:  # a failing policy is an engine error: HTTP 500
                await _respond(send, 500, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
                return
        await _respond(send, 200, json.dumps(out).encode())

    def _generate(self, req: dict) -> dict:
        ids_in = req["input_ids"]
        params = req.get("sampling_params", {})
        max_new = params.get("max_new_tokens", 128)
        reply = self.policy(ids_in, params)
        ids, finish = list(reply.ids), reply.finish
        logprobs = reply.logprobs or [fake_logprob(t, len(ids_in) + i) for i, t in enumerate(ids)]
        if len(ids) > max_new:
            ids, logprobs, finish = ids[:max_new], logprobs[:max_new], "length"
        version = self.version
        if self.abort_plan:
            k = self.abort_plan.pop(0)
            if k < len(ids) or finish != "stop":
                ids, logprobs, finish = ids[:k], logprobs[:k], "abort"
                self.version += 1  # the weight update that paused us
        reason = {
            "stop": {"type": "stop", "matched": ids[-1] if ids else None},
            "length": {"type": "length", "length": len(ids)},
            "abort": {"type": "abort", "message": "paused for a weight update"},
        }[finish]
        return {
            "text": "",
            "output_ids": ids,
            "meta_info": {
                "id": req.get("rid", ""),
                "prompt_tokens": len(ids_in),
                "completion_tokens": len(ids),
                "finish_reason": reason,
                "weight_version": str(version),
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)],
            },
        }

    def __enter__(self) -> ScriptedEngine:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self._app, log_level="warning", lifespan="off", access_log=False, interface="asgi3")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("scripted engine did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


async def _respond(send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class TurnScript:
    """A policy that answers each assistant turn with scripted text.

    ``script(turn_index, prompt_text) -> str | None``: the turn's text; the end-of-turn token is
    appended unless the text ends with ``NO_STOP`` (then the model "never stops"). Continuations
    after an abort are handled: tokens of the turn already in the prompt are skipped.
    """

    NO_STOP = "\x00nostop"

    def __init__(self, tokenizer, script: Callable[[int, str], str]):
        from agentrl.episode.chat import codec_for

        self.codec = codec_for(tokenizer)
        self.script = script
        self.header = self.codec.encode("<|im_start|>assistant\n")

    def __call__(self, ids: list[int], params: dict) -> Reply:
        h = self.header
        starts = [i for i in range(len(ids) - len(h) + 1) if ids[i : i + len(h)] == h]
        turn_start = starts[-1] + len(h)
        text = self.script(len(starts) - 1, self.codec.decode(ids))
        stop = not text.endswith(self.NO_STOP)
        text = text.removesuffix(self.NO_STOP)
        full = self.codec.encode(text) + ([self.codec.end_of_turn_id] if stop else [])
        if not stop:
            full = full * 50  # keep "generating"
        done = ids[turn_start:]
        assert full[: len(done)] == done, "the continuation does not extend the scripted turn"
        return Reply(full[len(done) :], "stop" if stop else "length")


class ModelPolicy:
    """Sample from a real (tiny, random) causal LM: garbage that fuzzes the token bookkeeping."""

    def __init__(self, model_path: Path, seed: int = 0):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, ids: list[int], params: dict) -> Reply:
        torch = self.torch
        stop_ids = set(params.get("stop_token_ids") or [])
        max_new = params.get("max_new_tokens", 16)
        temperature = params.get("temperature", 1.0) or 1.0
        out: list[int] = []
        logprobs: list[float] = []
        with torch.no_grad():
            for _ in range(max_new):
                logits = self.model(input_ids=torch.tensor([ids + out])).logits
                lp = torch.log_softmax(logits[0, -1].float() / temperature, -1)
                tok = int(torch.multinomial(lp.exp(), 1, generator=self.gen))
                out.append(tok)
                logprobs.append(float(lp[tok]))
                if tok in stop_ids:
                    return Reply(out, "stop", logprobs)
        return Reply(out, "length", logprobs)


@dataclass
class GenerateResult:
    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: dict
    weight_version: str
    prompt_tokens: int
    meta_info: dict
    url: str = ""


class HttpEngineClient:
    """The EngineClient interface over httpx (no retries, no health checks): a test double."""

    def __init__(
        self,
        urls: list[str],
        *,
        router_url: str = "",
        max_retries: int = 0,
        health_check_interval_s: float = 2.0,
        timeout_s: float = 60.0,
    ):
        self.urls = [router_url] if router_url else list(urls)
        self.timeout_s = timeout_s
        self._http: httpx.AsyncClient | None = None
        self.calls = 0

    async def __aenter__(self) -> HttpEngineClient:
        self._client()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=self.timeout_s, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
            )
        return self._http

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        *,
        affinity_key: str | None = None,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        self.calls += 1
        url = self.urls[hash(affinity_key) % len(self.urls)]
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        if rid:
            body["rid"] = rid
        r = await self._client().post(url + "/generate", json=body)
        r.raise_for_status()
        d = r.json()
        mi = d["meta_info"]
        return GenerateResult(
            d["output_ids"],
            [e[0] for e in mi["output_token_logprobs"]],
            d.get("text", ""),
            mi["finish_reason"],
            str(mi["weight_version"]),
            mi["prompt_tokens"],
            mi,
            url,
        )


# ----------------------------------------------------------------------------- transport doubles


class MemorySender(GroupSink):
    """Collects groups; ``blocked`` makes ``send`` wait (a learner that stopped reading)."""

    def __init__(self) -> None:
        self.groups: list[TrajectoryGroup] = []
        self.blocked = False
        self._unblocked = trio.Event()

    async def send(self, group: TrajectoryGroup) -> None:
        while self.blocked:
            await self._unblocked.wait()
        decode(encode(group))  # what goes on the wire must encode
        self.groups.append(group)

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()

    def unblock(self) -> None:
        self.blocked = False
        self._unblocked.set()
        self._unblocked = trio.Event()


class MemoryProgress(ProgressSource):
    """A progress source fed by the test."""

    def __init__(self) -> None:
        self.send_ch, self.recv_ch = trio.open_memory_channel[Progress](math.inf)
        self.latest: Progress | None = None

    def publish(self, p: Progress) -> None:
        self.send_ch.send_nowait(p)

    async def receive(self) -> Progress:
        self.latest = await self.recv_ch.receive()
        return self.latest

    async def aclose(self) -> None:
        await self.recv_ch.aclose()
