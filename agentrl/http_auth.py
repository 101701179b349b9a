"""Bearer-token auth of agentrl's HTTP servers, with SGLang's rules (``sglang/srt/utils/auth.py``).

A route declares its level where its handler is defined (``@auth_level(...)``);
:class:`BearerAuthMiddleware` asks :func:`decide_request_auth`: ``/health*``, ``/ready*``,
``/metrics*`` and ``OPTIONS`` are open; ``NORMAL`` needs the api key when one is set;
``ADMIN_OPTIONAL`` needs the admin key when one is set, else the api key when set; ``ADMIN_FORCE``
needs the admin key and is refused when the server has none. Refusals are SGLang's 401/403
bodies; keys are compared in constant time and come from the environment. See docs/engine.md.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

OPEN_PREFIXES = ("/health", "/ready", "/metrics")


class AuthLevel(str, Enum):
    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"
    ADMIN_FORCE = "admin_force"


@dataclass(frozen=True)
class AuthDecision:
    allowed: bool
    status: int = 401  # meaningful when not allowed


def auth_level(level: AuthLevel) -> Callable[[Callable], Callable]:
    """Mark a route handler with its auth level (unmarked handlers are NORMAL)."""

    def mark(handler: Callable) -> Callable:
        handler.auth_level = level  # type: ignore[attr-defined]
        return handler

    return mark


def level_of(handler: Any) -> AuthLevel:
    level = getattr(handler, "auth_level", None)
    return level if isinstance(level, AuthLevel) else AuthLevel.NORMAL


def bearer_matches(authorization: str | None, expected: str) -> bool:
    """``Authorization: Bearer <expected>`` (scheme case-insensitive), compared in constant time."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return secrets.compare_digest(token.encode(), expected.encode())


def decide_request_auth(
    *, method: str, path: str, authorization: str | None, api_key: str, admin_api_key: str, level: AuthLevel
) -> AuthDecision:
    """SGLang's ``decide_request_auth``; empty keys mean "not configured"."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return AuthDecision(True)
    if level is AuthLevel.ADMIN_FORCE:
        if not admin_api_key:
            return AuthDecision(False, 403)
        return AuthDecision(bearer_matches(authorization, admin_api_key))
    if level is AuthLevel.ADMIN_OPTIONAL:
        key = admin_api_key or api_key
        return AuthDecision(bearer_matches(authorization, key) if key else True)
    return AuthDecision(bearer_matches(authorization, api_key) if api_key else True)


class BearerAuthMiddleware:
    """ASGI middleware: each request is checked against the level of the route (of ``routes``) it matches.

    Pure ASGI (not ``BaseHTTPMiddleware``), so a client's disconnect still reaches the handler."""

    def __init__(self, app: Any, *, routes: list, api_key: str = "", admin_api_key: str = ""):
        self.app, self.routes = app, routes
        self.api_key, self.admin_api_key = api_key or "", admin_api_key or ""

    def _level(self, scope: dict) -> AuthLevel:
        from starlette.routing import Match

        for route in self.routes:
            match, child = route.matches(scope)
            if match is Match.FULL:
                return level_of(child.get("endpoint") or getattr(route, "endpoint", None))
        return AuthLevel.NORMAL

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not (self.api_key or self.admin_api_key):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        raw = headers.get(b"authorization")
        decision = decide_request_auth(
            method=scope["method"],
            path=scope["path"],
            authorization=raw.decode("latin-1") if raw else None,
            api_key=self.api_key,
            admin_api_key=self.admin_api_key,
            level=self._level(scope),
        )
        if decision.allowed:
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": "Unauthorized" if decision.status == 401 else "Forbidden"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": decision.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
