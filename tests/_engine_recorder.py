"""Test helper: the embedded engine behind a recording ASGI middleware (test code only).

``python -m tests._engine_recorder RECORD.jsonl <engine flags>`` serves like
``python -m agentrl.run.engine_process`` and appends, for each HTTP request, one JSON line:
``{"method", "path", "query", "body" (parsed JSON or null), "status"}``. The conformance test
drives agentrl's real client and weight updater against it and checks every line against
SGLang's contract. The engine runs in its own process because the trainer joins the weight
group from the test process, and torch allows one group of a given name per process.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any


class Recorder:
    def __init__(self, app: Any, path: str):
        self.app, self.path = app, path

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        status: dict[str, int] = {}

        async def recording_receive() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def recording_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, recording_receive, recording_send)
        finally:
            raw = b"".join(chunks)
            try:
                body = json.loads(raw) if raw.strip() else None
            except ValueError:
                body = {"<not JSON>": raw.decode(errors="replace")}
            line = {
                "method": scope["method"],
                "path": scope["path"],
                "query": scope["query_string"].decode(),
                "body": body,
                "status": status.get("code"),
            }
            with open(self.path, "a") as f:  # noqa: ASYNC230 (one short line per request, in a test helper)
                f.write(json.dumps(line) + "\n")


def main(argv: list[str]) -> None:
    import torch
    import uvicorn

    from agentrl.agents.engine_routes import openai_routes
    from agentrl.engine.server import EngineServer, build_app, parse_args

    record, args = argv[0], parse_args(argv[1:])
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    server = EngineServer(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_running_requests=args.max_running_requests,
        max_context_tokens=args.max_context_tokens,
        weight_version=args.weight_version,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        weight_update_bracket=not args.disable_weight_update_bracket,
    )
    server.start()
    try:
        uvicorn.run(
            Recorder(build_app(server, extra_routes=openai_routes(server)), record),
            host=args.host,
            port=args.port,
            log_level="warning",
            lifespan="off",
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
