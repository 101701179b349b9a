"""The embedded engine's OpenAI-compatible routes: ``/v1/chat/completions`` and ``/v1/models``.

The agent endpoint's :class:`~agentrl.agents.chat_service.ChatService` over the engine's own
scheduler, each request rendered fresh with the model's chat template and nothing recorded. The
engine does not import this: the engine process mounts these routes
(:mod:`agentrl.run.engine_process`). See docs/agents.md.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentrl.agents.chat_service import ChatService, FreshPrompts
from agentrl.agents.openai_api import error_body, model_list, retrieve_model
from agentrl.episode.chat import ChatCodec


def openai_routes(server: Any) -> list[Route]:
    """``/v1`` routes over ``server`` (an :class:`agentrl.engine.server.EngineServer`); the chat service is
    built on the first request (a model without a chat template answers 400 then)."""
    services: list[ChatService] = []

    def chat_service() -> ChatService:
        if not services:
            services.append(
                ChatService(
                    ChatCodec(server.tokenizer),
                    server,
                    server.model_path,
                    max_model_len=server.runner.max_context_tokens,
                    continue_aborts=False,
                )
            )
        return services[0]

    async def chat_completions(request: Request) -> Response:
        if not server.scheduler.alive:
            return JSONResponse(error_body("the engine scheduler is not running", kind="server_error"), status_code=503)
        try:
            service = chat_service()
        except ValueError as e:  # no chat template
            return JSONResponse(error_body(str(e)), status_code=400)
        return await service.handle(request, FreshPrompts())

    async def v1_models(request: Request) -> Response:
        return JSONResponse(model_list(server.model_path, server.runner.max_context_tokens))

    async def v1_model(request: Request) -> Response:
        status, body = retrieve_model(request.path_params["model"], server.model_path, server.runner.max_context_tokens)
        return JSONResponse(body, status_code=status)

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", v1_models, methods=["GET"]),
        Route("/v1/models/{model:path}", v1_model, methods=["GET"]),
    ]
