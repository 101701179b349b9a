"""The agent endpoint: OpenAI's chat-completions API in front of the engines, recording every call of
every episode.

Routes (starlette, served by :mod:`agentrl.agents.agent_runner`): ``POST /v1/chat/completions`` and
``GET /v1/models[/{model}]`` with ``Authorization: Bearer <episode key>``; the same under
``/episodes/<episode key>/v1/...`` for clients that take a base URL (the key in the path wins); and
an open ``GET /health``.

Invariant, keys are the border: recorded calls become training data, so only a call carrying the key
of an open episode is served; anything else is a 401 (``invalid_api_key``) and nothing is recorded.
Keys are 32 random bytes looked up by their SHA-256 digest; closing an episode stops its key and
drops a call still generating. The endpoint listens on loopback by default; keys never appear in
logs or trajectories. See docs/agents.md.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentrl.agents.chat_service import ChatService
from agentrl.agents.openai_api import error_body
from agentrl.agents.recording import Episode
from agentrl.tools.parsing import ToolCallParser

KEY_PREFIX = "agentrl-ep-"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _unauthorized(why: str) -> JSONResponse:
    return JSONResponse(
        error_body(
            f"{why}: calls need the key of an open agentrl episode (as the API key, or in "
            "the base URL /episodes/<key>/v1)",
            code="invalid_api_key",
        ),
        status_code=401,
    )


class AgentEndpoint:
    """Episodes by key, and the app that serves them (see the module docstring). Not thread-safe: open
    and close episodes on the event loop that serves the app."""

    def __init__(self, service: ChatService):
        self.service = service
        self._episodes: dict[bytes, Episode] = {}
        self.app = self._build_app()

    def open_episode(
        self,
        episode_id: str,
        *,
        max_calls: int | None = None,
        max_len: int | None = None,
        tool_parser: ToolCallParser | None = None,
        reasoning: bool | None = None,
    ) -> tuple[str, Episode]:
        """A new episode (with its limits and how its completions are read,
        :class:`agentrl.agents.recording.Episode`) and its key."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        episode = Episode(
            episode_id, max_calls=max_calls, max_len=max_len, tool_parser=tool_parser, reasoning=reasoning
        )
        self._episodes[_digest(key)] = episode
        return key, episode

    def close_episode(self, key: str) -> Episode | None:
        """Stop accepting the key's calls (those still generating are not recorded)."""
        episode = self._episodes.pop(_digest(key), None)
        if episode is not None:
            episode.closed = True
        return episode

    def _episode(self, request: Request) -> Episode | str:
        key = request.path_params.get("key")
        if key is None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return "no API key"
            key = token.strip()
        episode = self._episodes.get(_digest(key))
        return episode if episode is not None else "unknown or finished episode key"

    def _build_app(self) -> Starlette:
        service = self.service

        async def chat_completions(request: Request) -> Response:
            episode = self._episode(request)
            if isinstance(episode, str):
                return _unauthorized(episode)
            return await service.handle(request, episode)

        async def models(request: Request) -> Response:
            episode = self._episode(request)
            return _unauthorized(episode) if isinstance(episode, str) else JSONResponse(service.models())

        async def model(request: Request) -> Response:
            episode = self._episode(request)
            return _unauthorized(episode) if isinstance(episode, str) else service.model(request.path_params["model"])

        async def health(request: Request) -> Response:
            return Response(status_code=200)

        routes: list[Any] = [Route("/health", health, methods=["GET"])]
        for prefix in ("", "/episodes/{key}"):
            routes += [
                Route(f"{prefix}/v1/chat/completions", chat_completions, methods=["POST"]),
                Route(f"{prefix}/v1/models", models, methods=["GET"]),
                Route(f"{prefix}/v1/models/{{model:path}}", model, methods=["GET"]),
            ]

        async def not_found(request: Request, exc: Exception) -> Response:
            return JSONResponse(
                error_body(f"no route {request.method} {request.url.path}", code="not_found"), status_code=404
            )

        return Starlette(routes=routes, exception_handlers={404: not_found})
