"""The embedded engine's HTTP server: SGLang's native API over a :class:`Scheduler`.

Started by :mod:`agentrl.run.engine_process` (``agentrl serve-engine``), which mounts the ``/v1``
routes. Starlette + uvicorn on the main thread, the model in the scheduler thread; control calls
run in the scheduler thread between forward steps, while the weight group's rendezvous and
checkpoint reads run in worker threads.

Strict where SGLang 0.5.23 is: control bodies are SGLang's request structs (:data:`CONTROL_BODIES`),
a weight update keeps the prefix cache unless ``flush_cache`` asks, distributed updates run between
``/begin_weight_update`` and ``/end_weight_update``, ``--tp-size N`` joins the weight group as N
ranks, keys follow SGLang's bearer rules (``agentrl.http_auth``). A live rid is refused,
``/abort_request`` aborts every live request whose rid starts with the one named, and a client
that disconnects aborts its requests.

Images: ``/generate`` takes SGLang's ``image_data`` with ``input_ids`` when the model is a
vision-language model (:meth:`EngineServer.parse`, in a worker thread); a text model refuses it.

Probes: ``/health`` (= ``/health_generate``) submits a one-token request and answers 200 once the
engine produces anything, 503 after 20 s, marking the engine unhealthy until a later one succeeds;
``/ping`` answers from that flag (200 while paused); ``/ready`` is 200 when healthy and not paused.

LoRA: one adapter at a time, merged into the weights, the prefix cache emptied on each load and
unload. Every request runs on the weights of the moment, so a request without ``lora_path`` gets
the merged adapter too; :meth:`EngineServer.check_lora` accepts the merged adapter, or while paused
with none merged one loaded before (the learner swaps under a pause). See docs/engine.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from agentrl.engine.native_api import (
    Completion,
    GenerateCall,
    GenerateInput,
    RequestError,
    build_response,
    decode_body,
    error_body,
    output_text_ids,
    parse_generate,
    show,
    trim_stop_str,
)
from agentrl.http_auth import AuthLevel, BearerAuthMiddleware, auth_level

log = logging.getLogger("agentrl.engine")

API_KEY_ENV = "AGENTRL_ENGINE_API_KEY"  # the defaults of engine.api_key_env / engine.admin_api_key_env
ADMIN_API_KEY_ENV = "AGENTRL_ENGINE_ADMIN_API_KEY"

# SGLang's messages (managers/tokenizer_control_mixin.py, scheduler_components/weight_updater.py).
DP_REFUSAL = "data-parallel replicas are not supported for update weights from distributed"
DP_REFUSAL_DESTROY = "data-parallel replicas are not supported for destroy parameter update group"
DP_REFUSAL_LORA = "data-parallel replicas are not supported for dynamic lora loading"
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)
NO_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
SESSION_CLOSED = "no weight-update session is open; call begin_weight_update() first"
DUPLICATE_RID = "Duplicate request ID detected: {}"  # managers/tokenizer_manager.py, answered with a 400
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang/srt/constants.py


def health_check_timeout() -> float:
    """SGLang's ``HEALTH_CHECK_TIMEOUT``: ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds, default 20."""
    return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))


FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
    "requests, the operation will not be performed.)\n"
)


# ------------------------------------------------------------------------- control bodies

REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()
NONE = type(None)


@dataclass(frozen=True)
class BodyField:
    """One field of an SGLang request struct, as the embedded engine reads it."""

    kinds: tuple[type, ...]  # JSON types allowed (int excludes bool; float accepts int)
    default: Any = REQUIRED
    supported: tuple | None = None  # the values this engine implements (None: any value of the kinds)


def _f(kinds: type | tuple[type, ...], default: Any = REQUIRED, supported: tuple | None = None) -> BodyField:
    return BodyField(kinds if isinstance(kinds, tuple) else (kinds,), default, supported)


GROUP = "weight_update_group"
# Request bodies of the control routes: SGLang's fields (managers/io_struct.py) with SGLang's
# defaults. tests/test_engine_conformance.py checks this table against SGLang's source.
CONTROL_BODIES: dict[str, dict[str, BodyField]] = {
    "/abort_request": {"rid": _f((str, NONE), None), "abort_all": _f(bool, False)},
    "/pause_generation": {"mode": _f(str, "abort", ("abort", "retract", "in_place"))},
    "/continue_generation": {"torch_empty_cache": _f(bool, True)},
    "/init_weights_update_group": {
        "master_address": _f(str),
        "master_port": _f(int),
        "rank_offset": _f(int),
        "world_size": _f(int),
        "group_name": _f(str, GROUP),
        "backend": _f(str, "nccl", ("nccl", "gloo")),
    },
    "/destroy_weights_update_group": {"group_name": _f(str, GROUP)},
    "/begin_weight_update": {"selector": _f(str, "all", ("all", "target"))},  # no draft model here
    "/end_weight_update": {},
    "/update_weights_from_distributed": {
        "names": _f(list),
        "dtypes": _f(list),
        "shapes": _f(list),
        "group_name": _f(str, GROUP),
        "flush_cache": _f(bool, True),
        "abort_all_requests": _f(bool, False),
        "weight_version": _f((str, NONE), None),
        "load_format": _f((str, NONE), None, (None, "flattened_bucket")),
        "selector": _f(str, "all", ("all", "target")),
        "torch_empty_cache": _f(bool, False),
    },
    "/update_weights_from_disk": {
        "model_path": _f(str),
        "load_format": _f((str, NONE), None, (None, "auto", "safetensors")),
        "abort_all_requests": _f(bool, False),
        "weight_version": _f((str, NONE), None),
        "is_async": _f(bool, False, (False,)),
        "torch_empty_cache": _f(bool, False),
        "keep_pause": _f(bool, False, (False,)),
        "recapture_cuda_graph": _f(bool, False),
        "token_step": _f(int, 0),
        "flush_cache": _f(bool, True),
        "manifest": _f((dict, NONE), None, (None,)),
    },
    "/update_weight_version": {"new_version": _f(str), "abort_all_requests": _f(bool, True)},
    "/load_lora_adapter": {
        "lora_name": _f(str),
        "lora_path": _f(str),
        "pinned": _f(bool, False),
        "lora_id": _f((str, NONE), None),
    },
    "/unload_lora_adapter": {"lora_name": _f(str), "lora_id": _f((str, NONE), None)},
}

_KIND_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    list: "a list",
    dict: "an object",
    NONE: "null",
}


def _is_kind(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def parse_control(path: str, body: dict) -> dict[str, Any]:
    """The fields of ``path``'s body with SGLang's defaults filled in; RequestError names a bad one."""
    out = {}
    for name, spec in CONTROL_BODIES[path].items():
        if name not in body:
            if spec.default is REQUIRED:
                raise RequestError(f"{path}: field {name!r} is required")
            out[name] = spec.default
            continue
        value = body[name]
        if not any(_is_kind(value, k) for k in spec.kinds):
            wanted = " or ".join(_KIND_NAMES[k] for k in spec.kinds)
            raise RequestError(f"{path}: {name} must be {wanted}, got {show(value)}")
        if spec.supported is not None and value not in spec.supported:
            raise RequestError(
                f"{path}: {name} = {show(value)} is not supported by the embedded engine "
                f"(supported: {', '.join(repr(v) for v in spec.supported)})"
            )
        out[name] = value
    return out


def bad_request(message: str) -> JSONResponse:
    """SGLang's answer to a body that fails its request struct (``ErrorResponse``, HTTP 400)."""
    return JSONResponse(
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}, status_code=400
    )


# --------------------------------------------------------------------------------- server


class EngineServer:
    """Holds the runner, scheduler and weight receiver behind the HTTP routes."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_running_requests: int = 64,
        max_context_tokens: int = 2048,
        max_prefill_tokens: int = 8192,
        weight_version: str = "default",
        seed: int = 0,
        prefix_cache_tokens: int = 65536,
        tp_size: int = 1,
        dp_size: int = 1,
        weight_update_bracket: bool = True,
    ):
        from agentrl.engine.model_runner import ModelRunner
        from agentrl.engine.scheduler import Scheduler
        from agentrl.engine.weights import EngineWeightReceiver

        if tp_size < 1 or dp_size < 1:
            raise ValueError(f"tp_size and dp_size must be at least 1, got {tp_size} and {dp_size}")
        self.model_path = model_path
        self.tp_size, self.dp_size = tp_size, dp_size
        self.weight_update_bracket = weight_update_bracket
        self.runner = ModelRunner(
            model_path,
            device=device,
            dtype=dtype,
            max_running_requests=max_running_requests,
            max_context_tokens=max_context_tokens,
            seed=seed,
            prefix_cache_tokens=prefix_cache_tokens,
        )
        self.scheduler = Scheduler(self.runner, weight_version=weight_version, max_prefill_tokens=max_prefill_tokens)
        self.receiver = EngineWeightReceiver(self.runner, tp_size=tp_size)
        self.tokenizer = self.runner.tokenizer
        self.started = time.time()
        self.live_rids: set[str] = set()  # rids submitted and not finished (SGLang's rid_to_state)
        self.healthy = True  # SGLang's server_status == Up: cleared by a failed /health, set by a passed one

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        self.receiver.destroy_group()

    async def call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn))

    # -- /generate --------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def parse(self, body: Any) -> GenerateCall:
        """A ``/generate`` body as a call; the images of a vision-language model's prompts are decoded,
        expanded and prepared for the forward here (CPU work kept off the scheduler thread)."""
        runner = self.runner
        call = parse_generate(
            body,
            vocab_size=runner.vocab_size,
            context_len=runner.max_context_tokens,
            encode=self.encode,
            vision=runner.vision,
        )
        from agentrl.images import ImageError

        for i, inp in enumerate(call.inputs):
            if inp.images:
                try:
                    inp.vision = runner.prepare_images(inp.input_ids, inp.images)
                except ImageError as e:
                    raise RequestError(f"image_data{f'[{i}]' if call.batched else ''}: {e}") from None
        return call

    async def parse_async(self, body: Any) -> GenerateCall:
        """:meth:`parse`, in a worker thread when the body carries images (decoding them takes a while)."""
        if isinstance(body, dict) and body.get("image_data") is not None:
            return await asyncio.to_thread(self.parse, body)
        return self.parse(body)

    def render(self, c: Completion, inp: GenerateInput) -> dict:
        p = inp.params
        text = self.tokenizer.decode(output_text_ids(c, p), skip_special_tokens=p.skip_special_tokens)
        text = trim_stop_str(text, c, p)
        token_texts = None
        if inp.return_logprob and inp.return_text_in_logprobs:
            token_texts = [self.tokenizer.decode([t]) for t in c.output_ids]
        return build_response(c, inp, text, token_texts)

    def submit(self, call: GenerateCall, on_update: Callable[[int, Completion], object]) -> None:
        """Hand ``call`` to the scheduler; RequestError (nothing submitted) when one of its rids is live."""
        from agentrl.engine.scheduler import Request

        live = [inp.rid for inp in call.inputs if inp.rid in self.live_rids]
        if live:
            raise RequestError(DUPLICATE_RID.format(live[0]))
        self.live_rids.update(inp.rid for inp in call.inputs)
        for i, inp in enumerate(call.inputs):
            self.scheduler.submit(
                Request(inp, lambda req, c, i=i: self._update(req.rid, c, i, on_update), stream=call.stream)
            )

    def _update(self, rid: str, c: Completion, i: int, on_update: Callable[[int, Completion], object]) -> None:
        if c.finish_reason is not None:
            self.live_rids.discard(rid)
        on_update(i, c)

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        *,
        affinity_key: str | None = None,
        rid: str | None = None,
        return_logprob: bool = True,
        image_data: list[str] | None = None,
    ) -> Any:
        """One ``/generate`` on token ids, in process: the engine behind this server's ``/v1/chat/completions``
        (the ``EngineClient.generate`` interface). RequestError for a request /generate would refuse;
        cancelling the call aborts the request."""
        from agentrl.engine.client import GenerateResult, attempt_rid

        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
            "rid": attempt_rid(rid or uuid.uuid4().hex),
        }
        if image_data is not None:
            body["image_data"] = list(image_data)
        call = await self.parse_async(body)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.submit(call, lambda i, c: c.finish_reason is not None and loop.call_soon_threadsafe(_resolve, done, c))
        try:
            completion = await done
        except asyncio.CancelledError:
            self.abort([call.inputs[0].rid])
            raise
        return GenerateResult.from_response(self.render(completion, call.inputs[0]), url="embedded")

    def check_lora(self, call: GenerateCall) -> None:
        """RequestError unless every ``lora_path`` of ``call`` can be served (module docstring)."""
        receiver = self.receiver
        merged = receiver.adapter.name if receiver.adapter is not None else None
        for inp in call.inputs:
            name = inp.lora_path
            if name is None or name == merged:
                continue
            if name not in receiver.adapters_seen:  # SGLang's message, with the field named
                loaded = [merged] if merged else []
                raise RequestError(
                    f"lora_path: Got LoRA adapter that has never been loaded: {show(name)}\n"
                    f"All loaded adapters: {loaded}."
                )
            if merged is not None:
                raise RequestError(
                    f"lora_path: LoRA adapter {show(name)} is not loaded: the embedded engine serves "
                    f"one adapter, merged into its weights, and {merged!r} is merged now"
                )
            if not self.scheduler.paused:
                raise RequestError(
                    f"lora_path: LoRA adapter {show(name)} is not loaded (it was unloaded; the embedded "
                    "engine does not load it again implicitly as SGLang does)"
                )

    def lora_status(self) -> dict:
        """``loaded_adapters`` of SGLang's LoRA answers: name -> folder."""
        a = self.receiver.adapter
        return {a.name: a.path} if a is not None else {}

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.scheduler.call(lambda rid=rid: self.scheduler.abort(rid, "client disconnected"))

    # -- weight updates (run in the scheduler thread) ---------------------------------------
    def after_update(self, weight_version: str | None, flush_cache: bool) -> tuple[bool, str]:
        """SGLang's order: record the new version, then flush if asked; a refused flush fails the call."""
        if weight_version is not None:
            self.scheduler.weight_version = weight_version
        if flush_cache and not self.scheduler.flush_cache():
            return False, NOT_FLUSHED
        return True, ""

    def model_info(self) -> dict:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,
            "engine": "agentrl-embedded",
            "vocab_size": self.runner.vocab_size,
            "max_context_tokens": self.runner.max_context_tokens,
            "eos_token_ids": sorted(self.runner.eos_token_ids),
            "has_image_understanding": self.runner.vision is not None,
        }

    def server_info(self) -> dict:
        return {
            **self.model_info(),
            "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "pp_size": 1,
            "max_running_requests": self.runner.max_running_requests,
            "context_length": self.runner.max_context_tokens,
            "paused": self.scheduler.paused,
            "updating_weights": self.scheduler.updating,
            "weight_group": self.receiver.group_name,
            "num_steps": self.scheduler.num_steps,
            "num_generated_tokens": self.scheduler.num_generated,
            "prefix_cache_tokens": self.runner.prefix_cache.tokens,
            "prefix_cache_hit_tokens": self.runner.prefix_cache.hit_tokens,
            "uptime_s": time.time() - self.started,
            "last_error": self.scheduler.error,
            **self.scheduler.load(),
        }


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(error_body(message), status_code=status)


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


async def _body(request: HttpRequest) -> dict:
    return decode_body(await request.body())


async def _control(request: HttpRequest) -> dict[str, Any]:
    return parse_control(request.url.path, await _body(request))


async def _wait_disconnect(request: HttpRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(
    server: EngineServer, *, api_key: str = "", admin_api_key: str = "", extra_routes: Sequence[Route] = ()
) -> Starlette:
    sched = server.scheduler

    async def generate(request: HttpRequest) -> Response:
        try:
            call = await server.parse_async(await _body(request))
            server.check_lora(call)
        except RequestError as e:
            return _error(str(e))
        if not sched.alive:
            return _error("the engine scheduler is not running", 503)
        loop = asyncio.get_running_loop()
        rids = [inp.rid for inp in call.inputs]
        futures = [loop.create_future() for _ in call.inputs]

        def on_update(i: int, c: Completion) -> None:
            if c.finish_reason is not None:
                loop.call_soon_threadsafe(_resolve, futures[i], c)

        try:
            if call.stream:
                return _stream(server, call, loop, rids)
            server.submit(call, on_update)
        except RequestError as e:  # a live rid
            return _error(str(e))
        gathered = asyncio.ensure_future(asyncio.gather(*futures))
        disconnect = asyncio.ensure_future(_wait_disconnect(request))
        await asyncio.wait({gathered, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not gathered.done():
            server.abort(rids)
            await gathered
            return Response(status_code=499)
        disconnect.cancel()
        out = [server.render(c, inp) for c, inp in zip(gathered.result(), call.inputs)]
        return JSONResponse(out if call.batched else out[0])

    async def health_generate(request: HttpRequest) -> Response:
        """``/health`` and ``/health_generate``: SGLang's one-token check (module docstring)."""
        if not sched.alive:
            return Response(status_code=503)
        rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
        call = parse_generate(
            {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "rid": rid},
            vocab_size=server.runner.vocab_size,
            context_len=server.runner.max_context_tokens,
        )
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        steps = sched.num_steps
        server.submit(call, lambda i, c: c.finish_reason is not None and loop.call_soon_threadsafe(_resolve, fut, c))
        deadline = loop.time() + health_check_timeout()
        while loop.time() < deadline:
            await asyncio.wait({fut}, timeout=min(0.05, max(0.0, deadline - loop.time())))
            if fut.done() or sched.num_steps > steps:  # the engine produced something since the check began
                if not fut.done():
                    server.abort([rid])
                server.healthy = True
                return Response(status_code=200)
        server.abort([rid])
        log.error("Health check failed: no progress in %.0f s", health_check_timeout())
        server.healthy = False
        return Response(status_code=503)

    async def ping(request: HttpRequest) -> Response:
        """SGLang's ``/ping`` (SageMaker's liveness check): the health flag only, 200 while paused."""
        return Response(status_code=200 if sched.alive and server.healthy else 503)

    async def ready(request: HttpRequest) -> Response:
        return Response(status_code=200 if sched.alive and server.healthy and not sched.paused else 503)

    async def model_info(request: HttpRequest) -> Response:
        return JSONResponse(server.model_info())

    async def server_info(request: HttpRequest) -> Response:
        return JSONResponse(server.server_info())

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def flush_cache(request: HttpRequest) -> Response:
        ok = await server.call(sched.flush_cache)
        return PlainTextResponse(FLUSHED if ok else "Flush cache failed.\n", status_code=200 if ok else 400)

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def abort_request(request: HttpRequest) -> Response:
        b = await _control(request)
        if b["abort_all"]:
            await server.call(lambda: sched.abort(None))
        elif b["rid"]:  # SGLang ignores an empty rid without abort_all
            await server.call(lambda: sched.abort(b["rid"]))
        return Response(status_code=200)

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def pause_generation(request: HttpRequest) -> Response:
        mode = (await _control(request))["mode"]
        await server.call(lambda: sched.pause(mode))
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def continue_generation(request: HttpRequest) -> Response:
        b = await _control(request)

        def run() -> None:
            sched.resume()
            if b["torch_empty_cache"] and server.runner.device.type == "cuda":
                import torch

                torch.cuda.empty_cache()

        await server.call(run)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    # -- weights ----------------------------------------------------------------------------
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def init_weights_update_group(request: HttpRequest) -> Response:
        if server.dp_size > 1:  # SGLang asserts dp_size == 1: an internal server error
            return JSONResponse({"success": False, "message": DP_REFUSAL}, status_code=500)
        raw = await _body(request)
        b = parse_control(request.url.path, raw)
        # Deliberately not SGLang's default: nccl needs a GPU, so a CPU engine defaults to gloo.
        backend = b["backend"] if "backend" in raw or server.runner.device.type == "cuda" else "gloo"
        try:
            await asyncio.to_thread(
                server.receiver.init_group,
                master_address=b["master_address"],
                master_port=b["master_port"],
                rank_offset=b["rank_offset"],
                world_size=b["world_size"],
                group_name=b["group_name"],
                backend=backend,
            )
        except Exception as e:
            return _result(False, f"Failed to init parameter update group: {e}")
        return _result(True, "Succeeded to initialize custom process group.")

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def destroy_weights_update_group(request: HttpRequest) -> Response:
        if server.dp_size > 1:
            return JSONResponse({"success": False, "message": DP_REFUSAL_DESTROY}, status_code=500)
        b = await _control(request)
        if b["group_name"] != server.receiver.group_name:
            return _result(False, f"Failed to destroy parameter update group: no group named {show(b['group_name'])}")
        await server.call(server.receiver.destroy_group)
        return _result(True, "Succeeded to destroy custom process group.")

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def begin_weight_update(request: HttpRequest) -> Response:
        await _control(request)

        def run() -> bool:
            if sched.updating:
                return False
            sched.updating = True  # generation holds until /end_weight_update (SGLang relies on the pause)
            return True

        return _result(True, "Success") if await server.call(run) else _result(False, SESSION_OPEN)

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def end_weight_update(request: HttpRequest) -> Response:
        await _control(request)  # no fields, but a body that is not a JSON object is refused as elsewhere

        def run() -> bool:
            if not sched.updating:
                return False
            sched.updating = False
            return True

        return _result(True, "Success") if await server.call(run) else _result(False, SESSION_CLOSED)

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def update_weights_from_distributed(request: HttpRequest) -> Response:
        if server.dp_size > 1:
            return JSONResponse({"success": False, "message": DP_REFUSAL}, status_code=500)
        b = await _control(request)
        try:
            spec = server.receiver.check_spec(b["names"], b["dtypes"], b["shapes"])
        except ValueError as e:
            return _result(False, f"Failed to receive weights: {e}")

        def run() -> tuple[bool, str]:
            if server.weight_update_bracket and not sched.updating:
                return False, NO_SESSION
            if b["group_name"] != server.receiver.group_name:
                return False, f"Failed to receive weights: no weight update group {show(b['group_name'])}"
            if b["abort_all_requests"]:
                sched.abort(None, "aborted by a weight update")
            problems = server.receiver.receive(spec, flattened=b["load_format"] == "flattened_bucket")
            if problems:
                return False, "Failed to update weights: " + "; ".join(problems)
            ok, message = server.after_update(b["weight_version"], b["flush_cache"])
            return ok, message or "Succeeded to update parameter online."

        try:
            ok, message = await server.call(run)
        except Exception as e:
            return _result(False, f"Failed to receive weights: {e}")
        return _result(ok, message)

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def update_weights_from_disk(request: HttpRequest) -> Response:
        b = await _control(request)
        try:
            tensors = await asyncio.to_thread(server.receiver.load_from_disk, b["model_path"])
        except (ValueError, OSError) as e:
            return _result(False, f"Failed to update weights from disk: {e}", num_paused_requests=0)

        def run() -> tuple[bool, str]:
            if b["abort_all_requests"]:
                sched.abort(None, "aborted by a weight update")
            server.receiver.apply(tensors)
            ok, message = server.after_update(b["weight_version"], b["flush_cache"])
            return ok, message or "Succeeded to update model weights."

        ok, message = await server.call(run)
        return _result(ok, message, num_paused_requests=0)

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def update_weight_version(request: HttpRequest) -> Response:
        b = await _control(request)
        version = b["new_version"]

        def run() -> None:
            if b["abort_all_requests"]:
                sched.abort(None, "aborted by /update_weight_version")
            sched.weight_version = version

        await server.call(run)
        return JSONResponse(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    # -- LoRA adapters (module docstring) ----------------------------------------------------
    def _lora_result(success: bool, error: str | None = None) -> JSONResponse:
        return JSONResponse(
            {"success": success, "error_message": error, "loaded_adapters": server.lora_status()},
            status_code=200 if success else 400,
        )

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def load_lora_adapter(request: HttpRequest) -> Response:
        if server.dp_size > 1:  # SGLang asserts dp_size == 1 here too
            return JSONResponse({"success": False, "message": DP_REFUSAL_LORA}, status_code=500)
        b = await _control(request)
        try:  # reading and checking the folder happens off the scheduler thread
            adapter = await asyncio.to_thread(server.receiver.read_adapter, b["lora_name"], b["lora_path"])
        except (ValueError, OSError) as e:
            return _lora_result(False, f"Failed to load LoRA adapter {b['lora_name']}: {e}")

        def run() -> None:
            server.receiver.load_adapter(adapter)
            server.runner.prefix_cache.clear()  # K/V of other weights

        try:
            await server.call(run)
        except ValueError as e:
            return _lora_result(False, str(e))
        return _lora_result(True)

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def unload_lora_adapter(request: HttpRequest) -> Response:
        if server.dp_size > 1:
            return JSONResponse({"success": False, "message": DP_REFUSAL_LORA}, status_code=500)
        b = await _control(request)

        def run() -> None:
            server.receiver.unload_adapter(b["lora_name"])
            server.runner.prefix_cache.clear()

        try:
            await server.call(run)
        except ValueError as e:
            return _lora_result(False, str(e))
        return _lora_result(True)

    routes = [
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/health", health_generate, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/ping", ping, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),  # deprecated in SGLang
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),  # deprecated in SGLang
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/pause_generation", pause_generation, methods=["POST"]),
        Route("/continue_generation", continue_generation, methods=["POST"]),
        Route("/init_weights_update_group", init_weights_update_group, methods=["POST"]),
        Route("/destroy_weights_update_group", destroy_weights_update_group, methods=["POST"]),
        Route("/update_weights_from_distributed", update_weights_from_distributed, methods=["POST"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/update_weight_version", update_weight_version, methods=["POST"]),
        Route("/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
    ]
    routes += list(extra_routes)
    if server.weight_update_bracket:
        routes += [
            Route("/begin_weight_update", begin_weight_update, methods=["POST"]),
            Route("/end_weight_update", end_weight_update, methods=["POST"]),
        ]

    async def not_found(request: HttpRequest, exc: Exception) -> Response:  # FastAPI's bodies, as SGLang sends
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    async def not_allowed(request: HttpRequest, exc: Exception) -> Response:
        return JSONResponse({"detail": "Method Not Allowed"}, status_code=405)

    async def refused(request: HttpRequest, exc: Exception) -> Response:  # a control body parse_control refuses
        return bad_request(str(exc))

    auth = Middleware(BearerAuthMiddleware, routes=routes, api_key=api_key, admin_api_key=admin_api_key)
    return Starlette(
        routes=routes, middleware=[auth], exception_handlers={404: not_found, 405: not_allowed, RequestError: refused}
    )


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _stream(server: EngineServer, call: GenerateCall, loop: asyncio.AbstractEventLoop, rids: list[str]) -> Response:
    """SSE: ``data: {...}`` per update (cumulative, SGLang's default), then ``data: [DONE]``."""
    updates: asyncio.Queue = asyncio.Queue()
    server.submit(call, lambda i, c: loop.call_soon_threadsafe(updates.put_nowait, (i, c)))

    async def events():
        pending = set(range(len(call.inputs)))
        try:
            while pending:
                i, c = await updates.get()
                out = server.render(c, call.inputs[i])
                if call.batched:
                    out["index"] = i
                yield b"data: " + json.dumps(out).encode() + b"\n\n"
                if c.finish_reason is not None:
                    pending.discard(i)
            yield b"data: [DONE]\n\n"
        finally:
            if pending:  # the client went away
                server.abort([rids[i] for i in pending])

    return StreamingResponse(events(), media_type="text/event-stream")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m agentrl.run.engine_process", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument("--model", required=True, help="local Hugging Face model folder")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16 | float16"
    )
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--max-context-tokens", type=int, default=2048)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--weight-version", default="default", help="reported until the first update (SGLang's default)")
    ap.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=65536,
        help="K/V of finished requests kept for the next turn of their episode (tokens; 0: off)",
    )
    ap.add_argument(
        "--api-key", default=None, help=f"bearer key of the normal routes (default: ${API_KEY_ENV}, see --api-key-env)"
    )
    ap.add_argument(
        "--admin-api-key",
        default=None,
        help=f"bearer key of the admin routes (default: ${ADMIN_API_KEY_ENV}, see --admin-api-key-env)",
    )
    ap.add_argument(
        "--api-key-env",
        default=API_KEY_ENV,
        help="environment variable (or <NAME>_FILE) holding the api key when --api-key is not given",
    )
    ap.add_argument(
        "--admin-api-key-env",
        default=ADMIN_API_KEY_ENV,
        help="environment variable (or <NAME>_FILE) holding the admin key when --admin-api-key is not given",
    )
    ap.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="report this TP size and join the weight group as this many ranks (extra ones receive and drop)",
    )
    ap.add_argument(
        "--dp-size", type=int, default=1, help="report this DP size; > 1 refuses the weight group, as SGLang does"
    )
    ap.add_argument(
        "--disable-weight-update-bracket",
        action="store_true",
        help="serve no /begin_weight_update and /end_weight_update (404), like SGLang builds without "
        "them; weight updates then need no bracket",
    )
    ap.add_argument("--log-level", default="warning")
    return ap.parse_args(argv)


def serve(args: argparse.Namespace, routes_for: Callable[[EngineServer], list[Route]] | None = None) -> None:
    """Serve until stopped; ``routes_for(server)`` adds routes (the process that starts the engine mounts ``/v1``)."""
    import torch
    import uvicorn

    from agentrl.secrets import SecretError, read_secret

    try:
        api_key = args.api_key if args.api_key is not None else read_secret(args.api_key_env)
        admin_api_key = args.admin_api_key if args.admin_api_key is not None else read_secret(args.admin_api_key_env)
    except SecretError as e:
        sys.exit(f"agentrl engine: {e}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    server = EngineServer(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_running_requests=args.max_running_requests,
        max_context_tokens=args.max_context_tokens,
        max_prefill_tokens=args.max_prefill_tokens,
        weight_version=str(args.weight_version),
        seed=args.seed,
        prefix_cache_tokens=args.prefix_cache_tokens,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        weight_update_bracket=not args.disable_weight_update_bracket,
    )
    server.start()
    app = build_app(
        server, api_key=api_key, admin_api_key=admin_api_key, extra_routes=routes_for(server) if routes_for else ()
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
        lifespan="off",
    )
    auth = (
        "admin and api keys"
        if api_key and admin_api_key
        else "admin key"
        if admin_api_key
        else "api key"
        if api_key
        else "no key"
    )
    print(
        f"agentrl engine serving {args.model} on http://{args.host}:{args.port} "
        f"(device {server.runner.device}, dtype {str(server.runner.dtype).removeprefix('torch.')}, {auth})",
        file=sys.stderr,
        flush=True,
    )
    try:
        uvicorn.Server(config).run()
    finally:
        server.stop()
