"""The embedded engine's HTTP server: SGLang's native API over a :class:`Scheduler`.

``python -m agentrl.engine.server --model PATH --port N`` (or ``agentrl serve-engine``).

Starlette + uvicorn on the main thread; the model runs in the scheduler thread. A handler
turns the JSON body into scheduler requests (validation and error messages live in
``agentrl.engine.api``), and the scheduler hands results back through
``loop.call_soon_threadsafe``. Control calls (pause, abort, weight updates) run inside the
scheduler thread between forward steps (``Scheduler.call``), so they never race a forward.
The weight group's rendezvous runs in a worker thread (it blocks until the trainer joins)
while generation continues; checkpoint files are read off the scheduler thread too, and only
the copy into the parameters happens between steps.

A client that disconnects aborts its requests (as SGLang does), so abandoned generations do
not hold batch slots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from agentrl.engine.api import (
    Completion, GenerateCall, GenerateInput, RequestError, build_response, error_body, output_text_ids,
    parse_generate, trim_stop_str,
)

log = logging.getLogger("agentrl.engine")


class EngineServer:
    """Holds the runner, scheduler and weight receiver behind the HTTP routes."""

    def __init__(self, model_path: str, *, device: str = "auto", dtype: str = "auto", max_running_requests: int = 64,
                 max_context_tokens: int = 2048, max_prefill_tokens: int = 8192, weight_version: str = "0",
                 seed: int = 0, prefix_cache_tokens: int = 65536):
        from agentrl.engine.runner import ModelRunner
        from agentrl.engine.scheduler import Scheduler
        from agentrl.engine.weights import EngineWeightReceiver

        self.model_path = model_path
        self.runner = ModelRunner(model_path, device=device, dtype=dtype, max_running_requests=max_running_requests,
                                  max_context_tokens=max_context_tokens, seed=seed,
                                  prefix_cache_tokens=prefix_cache_tokens)
        self.scheduler = Scheduler(self.runner, weight_version=weight_version, max_prefill_tokens=max_prefill_tokens)
        self.receiver = EngineWeightReceiver(self.runner)
        self.tokenizer = self.runner.tokenizer
        self.started = time.time()

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

    def render(self, c: Completion, inp: GenerateInput) -> dict:
        p = inp.params
        text = self.tokenizer.decode(output_text_ids(c, p), skip_special_tokens=p.skip_special_tokens)
        text = trim_stop_str(text, c, p)
        token_texts = None
        if inp.return_logprob and inp.return_text_in_logprobs:
            token_texts = [self.tokenizer.decode([t]) for t in c.output_ids]
        return build_response(c, inp, text, token_texts)

    def submit(self, call: GenerateCall, on_update: Callable[[int, Completion], None]) -> None:
        from agentrl.engine.scheduler import Request

        for i, inp in enumerate(call.inputs):
            sink = lambda req, c, i=i: on_update(i, c)  # noqa: E731
            self.scheduler.submit(Request(inp, sink, stream=call.stream))

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.scheduler.call(lambda rid=rid: self.scheduler.abort(rid, "client disconnected"))

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
        }

    def server_info(self) -> dict:
        return {
            **self.model_info(),
            "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
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
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


async def _wait_disconnect(request: HttpRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(server: EngineServer) -> Starlette:
    sched = server.scheduler

    async def generate(request: HttpRequest) -> Response:
        try:
            body = await _body(request)
            call = parse_generate(body, vocab_size=server.runner.vocab_size,
                                  context_len=server.runner.max_context_tokens, encode=server.encode)
        except RequestError as e:
            return _error(str(e))
        if not sched.alive:
            return _error("the engine scheduler is not running", 503)
        loop = asyncio.get_running_loop()
        rids = [inp.rid for inp in call.inputs]
        if call.stream:
            return _stream(server, call, loop, rids)
        futures = [loop.create_future() for _ in call.inputs]

        def on_update(i: int, c: Completion) -> None:
            if c.finish_reason is not None:
                loop.call_soon_threadsafe(_resolve, futures[i], c)

        server.submit(call, on_update)
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

    async def health(request: HttpRequest) -> Response:
        return Response(status_code=200 if sched.alive else 503)

    async def health_generate(request: HttpRequest) -> Response:
        if not sched.alive:
            return Response(status_code=503)
        call = parse_generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                               "rid": f"HEALTH_CHECK_{time.time()}"},
                              vocab_size=server.runner.vocab_size, context_len=server.runner.max_context_tokens)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        server.submit(call, lambda i, c: c.finish_reason is not None and loop.call_soon_threadsafe(_resolve, fut, c))
        try:
            await asyncio.wait_for(fut, 20.0)
        except asyncio.TimeoutError:
            server.abort([call.inputs[0].rid])
            return Response(status_code=503)
        return Response(status_code=200)

    async def model_info(request: HttpRequest) -> Response:
        return JSONResponse(server.model_info())

    async def server_info(request: HttpRequest) -> Response:
        return JSONResponse(server.server_info())

    async def weight_version(request: HttpRequest) -> Response:
        return JSONResponse({"weight_version": sched.weight_version})

    async def flush_cache(request: HttpRequest) -> Response:
        ok = await server.call(sched.flush_cache)
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
            "requests, the operation will not be performed.)\n", status_code=200 if ok else 400)

    async def abort_request(request: HttpRequest) -> Response:
        try:
            body = await _body(request)
        except RequestError as e:
            return _error(str(e))
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all", False))
        if abort_all:
            await server.call(lambda: sched.abort(None, "aborted by /abort_request"))
        elif rid:
            await server.call(lambda: sched.abort(rid, "aborted by /abort_request"))
        return Response(status_code=200)

    async def pause_generation(request: HttpRequest) -> Response:
        try:
            mode = (await _body(request)).get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                raise RequestError(f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        except RequestError as e:
            return _error(str(e))
        await server.call(lambda: sched.pause(mode))
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request: HttpRequest) -> Response:
        await server.call(sched.resume)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    # -- weights ----------------------------------------------------------------------------
    async def init_weights_update_group(request: HttpRequest) -> Response:
        try:
            b = await _body(request)
            default_backend = "nccl" if server.runner.device.type == "cuda" else "gloo"
            args = dict(master_address=str(b["master_address"]), master_port=int(b["master_port"]),
                        rank_offset=int(b["rank_offset"]), world_size=int(b["world_size"]),
                        group_name=str(b.get("group_name", "weight_update_group")),
                        backend=str(b.get("backend") or default_backend))
        except (RequestError, KeyError, TypeError, ValueError) as e:
            return _result(False, f"bad /init_weights_update_group request: {e!r}")
        try:
            await asyncio.to_thread(server.receiver.init_group, **args)
        except Exception as e:
            return _result(False, f"Failed to init parameter update group: {e}")
        return _result(True, "Succeeded to initialize custom process group.")

    async def destroy_weights_update_group(request: HttpRequest) -> Response:
        await server.call(server.receiver.destroy_group)
        return _result(True, "Succeeded to destroy custom process group.")

    async def begin_weight_update(request: HttpRequest) -> Response:
        await server.call(lambda: setattr(sched, "updating", True))
        return _result(True, "Weight update started: generation holds until /end_weight_update.")

    async def end_weight_update(request: HttpRequest) -> Response:
        await server.call(lambda: setattr(sched, "updating", False))
        return _result(True, "Weight update ended.")

    def _set_version(version: Any) -> str:
        if version is not None:
            sched.weight_version = str(version)
            return f" Weight version updated to {version}."
        return ""

    async def update_weights_from_distributed(request: HttpRequest) -> Response:
        try:
            b = await _body(request)
            if b.get("load_format") not in (None, "flattened_bucket"):
                raise RequestError(f"load_format {b['load_format']!r} is not supported by the embedded engine")
            group = b.get("group_name")
            if group is not None and group != server.receiver.group_name:
                raise RequestError(f"unknown weight update group {group!r} (this engine has {server.receiver.group_name!r})")
            spec = server.receiver.check_spec(b.get("names"), b.get("dtypes"), b.get("shapes"))
        except (RequestError, ValueError) as e:
            return _result(False, str(e))

        def run() -> tuple[list[str], str]:
            if b.get("abort_all_requests"):
                sched.abort(None, "aborted by a weight update")
            problems = server.receiver.receive(spec, flattened=b.get("load_format") == "flattened_bucket")
            return problems, ("" if problems else _set_version(b.get("weight_version")))

        try:
            problems, note = await server.call(run)
        except Exception as e:
            return _result(False, f"Failed to update weights: {e}")
        if problems:
            return _result(False, "Failed to update weights: " + "; ".join(problems))
        return _result(True, "Succeeded to update parameter online." + note)

    async def update_weights_from_disk(request: HttpRequest) -> Response:
        try:
            b = await _body(request)
            path = b.get("model_path")
            if not isinstance(path, str) or not path:
                raise RequestError("model_path is required")
            if b.get("load_format") not in (None, "auto", "safetensors"):
                raise RequestError(f"load_format {b['load_format']!r} is not supported by the embedded engine")
            tensors = await asyncio.to_thread(server.receiver.load_from_disk, path)
        except (RequestError, ValueError, OSError) as e:
            return _result(False, f"Failed to update weights from disk: {e}", num_paused_requests=0)

        def run() -> str:
            if b.get("abort_all_requests"):
                sched.abort(None, "aborted by a weight update")
            server.receiver.apply(tensors)
            return _set_version(b.get("weight_version"))

        note = await server.call(run)
        return _result(True, f"Succeeded to update model weights from {path}." + note, num_paused_requests=0)

    async def update_weight_version(request: HttpRequest) -> Response:
        try:
            b = await _body(request)
        except RequestError as e:
            return _error(str(e))
        version = b.get("new_version")
        if version is None:
            return _result(False, "new_version is required")

        def run() -> None:
            if b.get("abort_all_requests"):
                sched.abort(None, "aborted by /update_weight_version")
            _set_version(version)

        await server.call(run)
        return JSONResponse({"success": True, "message": f"Weight version updated to {version}",
                             "new_version": str(version)})

    any_method = ["GET", "POST"]
    routes = [
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/health", health, methods=any_method),
        Route("/health_generate", health_generate, methods=any_method),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/get_weight_version", weight_version, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=any_method),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/pause_generation", pause_generation, methods=["POST"]),
        Route("/continue_generation", continue_generation, methods=["POST"]),
        Route("/init_weights_update_group", init_weights_update_group, methods=["POST"]),
        Route("/destroy_weights_update_group", destroy_weights_update_group, methods=["POST"]),
        Route("/begin_weight_update", begin_weight_update, methods=["POST"]),
        Route("/end_weight_update", end_weight_update, methods=["POST"]),
        Route("/update_weights_from_distributed", update_weights_from_distributed, methods=["POST"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/update_weight_version", update_weight_version, methods=["POST"]),
    ]
    return Starlette(routes=routes)


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
    ap = argparse.ArgumentParser(prog="python -m agentrl.engine.server", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="local Hugging Face model folder")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16 | float16")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--max-context-tokens", type=int, default=2048)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--weight-version", default="0")
    ap.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-cache-tokens", type=int, default=65536,
                    help="K/V of finished requests kept for the next turn of their episode (tokens; 0: off)")
    ap.add_argument("--log-level", default="warning")
    return ap.parse_args(argv)


def serve(args: argparse.Namespace) -> None:
    import torch
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    server = EngineServer(args.model, device=args.device, dtype=args.dtype,
                          max_running_requests=args.max_running_requests, max_context_tokens=args.max_context_tokens,
                          max_prefill_tokens=args.max_prefill_tokens, weight_version=str(args.weight_version),
                          seed=args.seed, prefix_cache_tokens=args.prefix_cache_tokens)
    server.start()
    config = uvicorn.Config(build_app(server), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_keep_alive=30, timeout_graceful_shutdown=5, lifespan="off")
    print(f"agentrl engine serving {args.model} on http://{args.host}:{args.port} "
          f"(device {server.runner.device}, dtype {str(server.runner.dtype).removeprefix('torch.')})",
          file=sys.stderr, flush=True)
    try:
        uvicorn.Server(config).run()
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    serve(parse_args(argv))


if __name__ == "__main__":
    main()
