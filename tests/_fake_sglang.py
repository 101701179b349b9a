"""A stand-in for an SGLang 0.5.23 server's control surface, for tests of the weight push where
the embedded engine lacks a feature (TP ranks, data parallelism, an older build without
begin/end, bearer keys). Real HTTP (starlette/uvicorn) and real torch.distributed ranks: one
per TP rank (rank 0 in the server process, the others in child processes), each joining the
weight group as ``rank_offset + tp_rank`` and receiving every broadcast, as SGLang's
``model_runner_components/weight_updater.py`` does. It does not generate text: ``/generate``
answers one token so that keys and versions can be checked. A bucket with a name containing
``refuse`` is received and then refused (HTTP 400), as a failed load would be.

Mirrored from SGLang's source (``sglang/srt/``): auth levels and rules (``utils/auth.py``;
``/health*`` open, NORMAL routes want the api key, ADMIN_OPTIONAL routes the admin key when
set, else the api key); ``flush_cache`` defaulting to true and ``weight_version`` optional
(``managers/io_struct.py``); updates refused outside a begin/end session, and begin refused
while one is open (``managers/scheduler_components/weight_updater.py``); a server without
``--weight-version`` reporting ``"default"``; ``/update_weight_version`` with ``new_version``
and ``abort_all_requests`` (default true); ``init_weights_update_group`` asserting
``dp_size == 1`` (``managers/tokenizer_control_mixin.py``); ``/server_info`` with the server
args (``tp_size``, ``dp_size``).

``GET /_fake/state`` (test-only, open) reports what the server saw. Run:
``python -m tests._fake_sglang --port P [--tp-size N] [--dp-size N] [--no-begin-end]
[--weight-version V] [--api-key K] [--admin-api-key K]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import secrets
from typing import Any

ADMIN_OPTIONAL = {
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/flush_cache",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_distributed",
    "/update_weight_version",
}


def allowed(path: str, authorization: str | None, api_key: str, admin_api_key: str, admin_routes: set[str]) -> bool:
    """SGLang's ``decide_request_auth``; a path without a route is a NORMAL one (SGLang's
    ``_get_auth_level_from_app_and_scope``), so it wants the api key before it can answer 404."""
    if path.startswith(("/health", "/_fake/")):
        return True

    def matches(expected: str) -> bool:
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token, expected)

    if path in admin_routes:
        key = admin_api_key or api_key
        return matches(key) if key else True
    return matches(api_key) if api_key else True


# ------------------------------------------------------------------------------ TP ranks


def _receive(group, spec: list, load_format: str | None) -> dict[str, float]:
    """Receive one bucket (SGLang's wire formats); return a checksum per tensor."""
    import math

    import torch
    import torch.distributed as dist

    from agentrl.weight_group import parse_dtype

    tensors = [(n, parse_dtype(d), tuple(s)) for n, d, s in spec]
    if load_format == "flattened_bucket":
        sizes = [math.prod(s) * d.itemsize for _, d, s in tensors]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=group)
        out, offset = {}, 0
        for (name, dtype, _shape), size in zip(tensors, sizes):
            out[name] = float(flat[offset : offset + size].clone().view(dtype).double().sum())
            offset += size
        return out
    bufs = [(n, torch.empty(s, dtype=d)) for n, d, s in tensors]
    for w in [dist.broadcast(b, src=0, group=group, async_op=True) for _, b in bufs]:
        w.wait()
    return {n: float(b.double().sum()) for n, b in bufs}


class Rank:
    """One TP rank's end of the weight group."""

    def __init__(self) -> None:
        self.group = None

    def handle(self, op: str, args: dict) -> Any:
        from agentrl.weight_group import destroy_weight_group, init_weight_group

        if op == "init":
            destroy_weight_group(self.group)
            self.group = init_weight_group(
                args["backend"],
                args["master_address"],
                args["master_port"],
                args["world_size"],
                args["rank"],
                args["group_name"],
                60.0,
            )
            return None
        if op == "receive":
            return _receive(self.group, args["spec"], args["load_format"])
        if op == "destroy":
            destroy_weight_group(self.group)
            self.group = None
            return None
        raise ValueError(op)


def _child_main(conn) -> None:
    import torch

    torch.set_num_threads(1)
    rank = Rank()
    while True:
        op, args = conn.recv()
        if op == "exit":
            return
        try:
            conn.send(("ok", rank.handle(op, args)))
        except Exception as e:  # reported to the server, which answers the HTTP call with it
            conn.send(("error", f"{type(e).__name__}: {e}"))


class Ranks:
    """Rank 0 in this process (in a thread), the others in child processes."""

    def __init__(self, tp_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.local = Rank()
        self.children = []
        for _ in range(tp_size - 1):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_child_main, args=(child,), daemon=True)
            proc.start()
            self.children.append((parent, proc))

    async def all(self, op: str, args_for) -> list:
        def child_call(i: int, conn) -> Any:
            conn.send((op, args_for(i)))
            status, value = conn.recv()
            if status != "ok":
                raise RuntimeError(value)
            return value

        calls = [asyncio.to_thread(self.local.handle, op, args_for(0))]
        calls += [asyncio.to_thread(child_call, i + 1, conn) for i, (conn, _) in enumerate(self.children)]
        return list(await asyncio.gather(*calls))

    def close(self) -> None:
        for conn, proc in self.children:
            try:
                conn.send(("exit", None))
            except OSError:
                pass
            proc.join(5)
            if proc.is_alive():
                proc.kill()


# ------------------------------------------------------------------------------ the server


def build_app(args: argparse.Namespace):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    ranks = Ranks(args.tp_size)
    state: dict[str, Any] = {
        "weight_version": args.weight_version,
        "session": False,
        "paused": None,
        "calls": [],
        "updates": [],
        "flushes": 0,
        "version_updates": [],
        "init": None,
        "generate_calls": 0,
    }

    def result(success: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        return (await request.json()) if raw else {}

    async def health(request: Request):
        return PlainTextResponse("")

    async def server_info(request: Request):
        return JSONResponse(
            {
                "tp_size": args.tp_size,
                "dp_size": args.dp_size,
                "pp_size": 1,
                "model_path": "fake",
                "version": "0.5.23-fake",
            }
        )

    async def model_info(request: Request):
        return JSONResponse({"model_path": "fake", "weight_version": state["weight_version"], "is_generation": True})

    async def generate(request: Request):
        b = await body_of(request)
        state["generate_calls"] += 1
        return JSONResponse(
            {
                "text": "",
                "output_ids": [1],
                "meta_info": {
                    "id": b.get("rid", ""),
                    "prompt_tokens": len(b.get("input_ids") or []),
                    "completion_tokens": 1,
                    "finish_reason": {"type": "length", "length": 1},
                    "weight_version": state["weight_version"],
                    "output_token_logprobs": [[-0.5, 1, None]],
                },
            }
        )

    async def pause(request: Request):
        state["paused"] = (await body_of(request)).get("mode", "abort")
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(request: Request):
        state["paused"] = None
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(request: Request):
        return PlainTextResponse("")

    async def flush_cache(request: Request):
        state["flushes"] += 1
        return PlainTextResponse("Cache flushed.\n")

    async def init_group(request: Request):
        b = await body_of(request)
        if args.dp_size != 1:  # SGLang: assert get_parallel().dp_size == 1 -> HTTP 500
            return PlainTextResponse("Internal Server Error", status_code=500)
        state["init"] = {k: b[k] for k in ("rank_offset", "world_size", "group_name", "backend")}
        try:
            await ranks.all("init", lambda r: {**b, "rank": b["rank_offset"] + r})
        except Exception as e:
            return result(False, f"Failed to init parameter update group: {e}")
        return result(True, "Succeeded to initialize custom process group.")

    async def destroy_group(request: Request):
        await ranks.all("destroy", lambda r: {})
        return result(True, "Succeeded to destroy custom process group.")

    async def begin(request: Request):
        if state["session"]:
            return result(False, "a weight-update session is already open; call end_weight_update() first")
        state["session"] = True
        return result(True, "Success")

    async def end(request: Request):
        if not state["session"]:
            return result(False, "no weight-update session is open; call begin_weight_update() first")
        state["session"] = False
        return result(True, "Success")

    async def update_distributed(request: Request):
        b = await body_of(request)
        if not args.no_begin_end and not state["session"]:
            return result(
                False, "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        spec = list(zip(b["names"], b["dtypes"], b["shapes"]))
        try:
            checksums = await ranks.all("receive", lambda r: {"spec": spec, "load_format": b.get("load_format")})
        except Exception as e:
            return result(False, f"Failed to receive weights: {e}")
        if any("refuse" in name for name in b["names"]):  # a test's way to make one bucket fail
            return result(False, "Failed to load weights: refused by the test")
        if b.get("weight_version") is not None:
            state["weight_version"] = b["weight_version"]
        state["updates"].append(
            {
                "names": b["names"],
                "flush_cache": b.get("flush_cache", True),
                "weight_version": b.get("weight_version"),
                "load_format": b.get("load_format"),
                "checksums": checksums,
                "paused": state["paused"],
            }
        )
        return result(True, "Succeeded to update parameter online.")

    async def update_weight_version(request: Request):
        b = await body_of(request)
        state["version_updates"].append(
            {"new_version": b["new_version"], "abort_all_requests": b.get("abort_all_requests", True)}
        )
        state["weight_version"] = b["new_version"]
        return JSONResponse(
            {
                "success": True,
                "message": f"Weight version updated to {b['new_version']}",
                "new_version": b["new_version"],
            }
        )

    async def fake_state(request: Request):
        return JSONResponse(state)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/pause_generation", pause, methods=["POST"]),
        Route("/continue_generation", resume, methods=["POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/init_weights_update_group", init_group, methods=["POST"]),
        Route("/destroy_weights_update_group", destroy_group, methods=["POST"]),
        Route("/update_weights_from_distributed", update_distributed, methods=["POST"]),
        Route("/update_weight_version", update_weight_version, methods=["POST"]),
        Route("/_fake/state", fake_state, methods=["GET"]),
    ]
    if not args.no_begin_end:
        routes += [
            Route("/begin_weight_update", begin, methods=["POST"]),
            Route("/end_weight_update", end, methods=["POST"]),
        ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        ranks.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    admin_routes = {r.path for r in routes} & ADMIN_OPTIONAL

    async def with_auth(scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"").decode() or None
            state["calls"].append([scope["path"], auth is not None])
            if not allowed(scope["path"], auth, args.api_key, args.admin_api_key, admin_routes):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await app(scope, receive, send)

    return with_auth


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--no-begin-end", action="store_true", help="an SGLang build before 0.5.23 (404 there)")
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--admin-api-key", default="")
    args = ap.parse_args()
    uvicorn.run(build_app(args), host="127.0.0.1", port=args.port, log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()
