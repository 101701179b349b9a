"""Async client for a fleet of SGLang-compatible servers (real SGLang or the embedded engine).

One :class:`EngineClient` (trio or asyncio) spreads ``/generate`` calls over the servers: least
outstanding requests, episode affinity (an episode's turns go to the server that holds its prefix,
while it is healthy), retries with backoff on connection errors and 5xx (a 4xx raises
:class:`EngineRequestError` at once), and health probes on ``/ping``, never ``/health``, which
generates a token. A result with ``finish_reason.type == "abort"`` is a result, never retried;
when no server is healthy a call waits (re-probing) up to ``timeout_s``. With ``router_url``,
generation goes through sglang-router and control calls still go to each engine.

Request ids: SGLang aborts by rid prefix and refuses a live rid, so the rid a caller passes is a
base, and each attempt sends :func:`attempt_rid` of it: the base with ``%`` and ``#`` escaped, then
``#`` and 16 hex digits. No such rid is a proper prefix of another, and aborting the base aborts
every attempt.

Keys follow SGLang: the api key on ``/generate``, ``/model_info`` and ``/ping``, the admin key (else
the api key) on control calls; a 401/403 names the variable to set, and keys never appear in
messages or logs. See docs/engine.md.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from agentrl.secrets import bearer

log = logging.getLogger(__name__)


RID_SUFFIX_HEX = 16  # hex digits after the '#' of an attempt's rid


def attempt_rid(base: str) -> str:
    """The rid of one attempt of request ``base`` (module docstring): prefix-free and fresh each call."""
    escaped = base.replace("%", "%25").replace("#", "%23")
    return f"{escaped}#{uuid.uuid4().hex[:RID_SUFFIX_HEX]}"


class EngineError(RuntimeError):
    """Base class of the client's errors."""


class EngineRequestError(EngineError):
    """The server rejected the request (HTTP 4xx); retrying would not help."""

    def __init__(self, status: int, message: str, url: str = ""):
        super().__init__(f"{url} answered HTTP {status}: {message}")
        self.status, self.message, self.url = status, message, url


class EngineUnavailableError(EngineError):
    """No server could serve the call within the retries and the time limit."""


@dataclass
class GenerateResult:
    output_ids: list[int]  # generated token ids, INCLUDING the stop token when it stopped on one
    output_logprobs: list[float]  # one per output id (sampling distribution, temperature-scaled)
    text: str
    finish_reason: dict  # SGLang shape: {"type": "stop"|"length"|"abort", ...}
    weight_version: str  # the engine's weight_version when the request finished
    prompt_tokens: int
    meta_info: dict  # the raw meta_info
    url: str = ""  # the server (or router) that answered

    # The /generate response fields read below (tests/test_engine_conformance.py: SGLang writes them).
    FIELDS_READ = ("meta_info", "output_ids", "text")
    META_INFO_FIELDS_READ = ("output_token_logprobs", "finish_reason", "weight_version", "prompt_tokens")

    @classmethod
    def from_response(cls, body: dict, url: str = "") -> GenerateResult:
        meta = body.get("meta_info") or {}
        lps = meta.get("output_token_logprobs") or []
        return cls(
            output_ids=list(body.get("output_ids") or []),
            output_logprobs=[float(x[0]) if x[0] is not None else float("nan") for x in lps],
            text=body.get("text", ""),
            finish_reason=meta.get("finish_reason") or {},
            weight_version=str(meta.get("weight_version", "")),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            meta_info=meta,
            url=url,
        )


SHARD_REQUESTS = 16
SERVERS_PER_HTTP_CLIENT = 16  # servers whose probes and control calls share one httpx client (see _http_for)


@dataclass(eq=False)
class _Shard:
    http: httpx.AsyncClient
    in_flight: int = 0


@dataclass(eq=False)
class _Server:
    url: str
    healthy: bool = True
    probe_path: str = "/ping"  # "/health" for the router, or an engine without /ping
    outstanding: int = 0
    served: int = 0
    last_error: str = ""
    answered_at: float = 0.0  # monotonic time of its last answer (a reply or a probe): it was alive then
    http_index: int = 0  # which httpx client sends its probes and control calls (EngineClient._http_for)


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]


class EngineClient:
    def __init__(
        self,
        urls: list[str],
        *,
        router_url: str = "",
        max_retries: int = 5,
        health_check_interval_s: float = 2.0,
        timeout_s: float = 600.0,
        health_timeout_s: float = 5.0,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        max_affinity_keys: int = 100_000,
        api_key: str = "",
        admin_api_key: str = "",
        key_hints: tuple[str, str] = ("pass api_key", "pass admin_api_key"),
        lora_path: str = "",
    ):
        if not urls and not router_url:
            raise ValueError("EngineClient needs engine urls, a router_url, or both")
        self.engines = [_Server(u.rstrip("/")) for u in urls]
        self.router = _Server(router_url.rstrip("/"), probe_path="/health") if router_url else None
        for i, server in enumerate(self.servers):
            server.http_index = i // SERVERS_PER_HTTP_CLIENT
        self.max_retries, self.timeout_s = max_retries, timeout_s
        self.health_check_interval_s, self.health_timeout_s = health_check_interval_s, health_timeout_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.max_affinity_keys = max_affinity_keys
        self._affinity: OrderedDict[str, _Server] = OrderedDict()
        self._turn = 0
        self._control_https: dict[int, httpx.AsyncClient] = {}  # health and control calls (see _http_for)
        self._shards: list[_Shard] = []  # /generate calls (see _shard)
        self._tg: Any = None
        self._last_probe = 0.0
        self._probe_lock: anyio.Lock | None = None
        self._api_headers = bearer(api_key)
        self._admin_headers = bearer(admin_api_key or api_key)
        self._key_hints = key_hints  # what to set when /generate, or a control call, is refused
        self._attempts: dict[str, set[str]] = {}  # rid base -> the rids of its attempts (calls in progress)
        self.lora_path = lora_path  # the LoRA adapter every /generate names ("": none)

    @classmethod
    def from_config(cls, engine, urls: list[str] | None = None, **kwargs: Any) -> EngineClient:
        """From an ``[engine]`` config section; ``urls`` overrides ``engine.urls`` (e.g. engines just
        started); keys from the variables ``engine.api_key_env`` / ``engine.admin_api_key_env`` name."""
        from agentrl.secrets import read_secret

        hints = (
            f"set {engine.api_key_env} (engine.api_key_env) to the engines' --api-key",
            f"set {engine.admin_api_key_env} (engine.admin_api_key_env) to the engines' --admin-api-key, "
            f"or {engine.api_key_env} to their --api-key when they have no admin key",
        )
        return cls(
            list(urls if urls is not None else engine.urls),
            router_url=engine.router_url,
            max_retries=engine.request_retries,
            health_check_interval_s=engine.health_check_interval_s,
            api_key=read_secret(engine.api_key_env),
            admin_api_key=read_secret(engine.admin_api_key_env),
            key_hints=hints,
            **kwargs,
        )

    # -- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> EngineClient:
        await self.check_health()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._health_loop)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._tg = None
        await self.aclose()

    async def aclose(self) -> None:
        clients = [s.http for s in self._shards] + list(self._control_https.values())
        self._control_https, self._shards = {}, []
        for http in clients:
            await http.aclose()

    def _new_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout_s, connect=min(10.0, self.timeout_s)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
        )

    def _http_for(self, server: _Server) -> httpx.AsyncClient:
        """The httpx client of ``server``'s probes and control calls: one per ``SERVERS_PER_HTTP_CLIENT``
        servers. A pool's CPU per request grows with its connections: one round of probes cost 3.6 s
        of CPU at 256 engines through one client, 0.2 s through pools of 16 (docs/scaling.md)."""
        http = self._control_https.get(server.http_index)
        if http is None:
            http = self._control_https[server.http_index] = self._new_http()
        return http

    def _shard(self) -> _Shard:
        """The httpx client for the next ``/generate``: the least busy one, or a new one when all
        have ``SHARD_REQUESTS`` calls in flight. httpx's connection pool spends time proportional
        to (requests x connections) on every request; with 128 calls in one pool that was 70% of
        an actor process's CPU, with pools of 16 it is negligible."""
        shard = min(self._shards, key=lambda s: s.in_flight, default=None)
        if shard is None or shard.in_flight >= SHARD_REQUESTS:
            shard = _Shard(self._new_http())
            self._shards.append(shard)
        return shard

    @property
    def _pool(self) -> list[_Server]:
        return [self.router] if self.router is not None else self.engines

    @property
    def servers(self) -> list[_Server]:
        return self._pool + (self.engines if self.router is not None else [])

    # -- health -------------------------------------------------------------------------------
    async def _probe(self, server: _Server) -> None:
        try:
            r = await self._get_probe(server)
            if r.status_code == 404 and server.probe_path == "/ping":
                log.info("engine %s has no /ping: probing its /health, which generates a token", server.url)
                server.probe_path = "/health"
                r = await self._get_probe(server)
            ok, why = r.status_code in (200, 401, 403), f"HTTP {r.status_code}"  # a refusal is an answer
        except httpx.HTTPError as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        if ok and not server.healthy:
            log.info("engine %s is healthy again", server.url)
        elif not ok and server.healthy:
            log.warning("engine %s dropped: %s failed (%s)", server.url, server.probe_path, why)
        server.healthy = ok
        if ok:
            server.answered_at = time.monotonic()
        else:
            server.last_error = why

    async def _get_probe(self, server: _Server) -> httpx.Response:
        headers = self._api_headers if server.probe_path == "/ping" else None  # /ping is a normal route
        return await self._http_for(server).get(
            server.url + server.probe_path, headers=headers, timeout=self.health_timeout_s
        )

    async def check_health(self, only_unhealthy: bool = False, answered_within_s: float = 0.0) -> None:
        """Probe every server once, concurrently; or only the dropped ones; and never a healthy one that
        answered within ``answered_within_s`` (the background loop: an engine that just replied is alive,
        and probing each of hundreds every interval cost an idle actor half a core, docs/scaling.md)."""
        now = time.monotonic()
        targets = [
            s for s in self.servers if not (s.healthy and (only_unhealthy or now - s.answered_at < answered_within_s))
        ]
        async with anyio.create_task_group() as tg:
            for s in targets:
                tg.start_soon(self._probe, s)

    async def _health_loop(self) -> None:
        while True:
            await anyio.sleep(self.health_check_interval_s)
            await self.check_health(answered_within_s=self.health_check_interval_s)

    def _mark_down(self, server: _Server, why: str) -> None:
        if server.healthy:
            log.warning("engine %s dropped: %s", server.url, why)
        server.healthy, server.last_error = False, why

    async def _wait_for_healthy(self, deadline: float) -> None:
        """No server is healthy: re-probe the dropped ones (at most every 0.2 s) until one is back."""
        if self._probe_lock is None:
            self._probe_lock = anyio.Lock()
        while not any(s.healthy for s in self._pool):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                errors = ", ".join(f"{s.url}: {s.last_error or 'unhealthy'}" for s in self._pool)
                raise EngineUnavailableError(f"no healthy engine within {self.timeout_s:.0f} s ({errors})")
            async with self._probe_lock:
                if time.monotonic() - self._last_probe >= 0.2:
                    self._last_probe = time.monotonic()
                    with anyio.move_on_after(remaining):
                        await self.check_health(only_unhealthy=True)
            if not any(s.healthy for s in self._pool):
                await anyio.sleep(min(0.2 + random.random() * 0.1, max(0.0, deadline - time.monotonic())))

    # -- routing ------------------------------------------------------------------------------
    def _choose(self, affinity_key: str | None, avoid: _Server | None) -> _Server | None:
        healthy = [s for s in self._pool if s.healthy]
        if not healthy:
            return None
        if affinity_key is not None and self.router is None:
            s = self._affinity.get(affinity_key)
            if s is not None and s.healthy and s is not avoid:
                self._affinity.move_to_end(affinity_key)
                return s
        candidates = [s for s in healthy if s is not avoid] or healthy
        fewest = min(s.outstanding for s in candidates)
        best = [s for s in candidates if s.outstanding == fewest]
        self._turn += 1
        s = best[self._turn % len(best)]
        if affinity_key is not None and self.router is None:
            self._affinity[affinity_key] = s
            self._affinity.move_to_end(affinity_key)
            while len(self._affinity) > self.max_affinity_keys:
                self._affinity.popitem(last=False)
        return s

    # -- calls --------------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        *,
        affinity_key: str | None = None,
        rid: str | None = None,
        return_logprob: bool = True,
        image_data: list[str] | None = None,
    ) -> GenerateResult:
        """One ``/generate`` call (a single prompt), balanced, retried and health-aware. ``rid`` is the
        request's base id (module docstring): each attempt sends a fresh :func:`attempt_rid` of it.
        ``image_data``: SGLang's field, one item (a data URL) per image pad run of ``input_ids``."""
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "return_logprob": return_logprob,
        }
        if image_data is not None:
            payload["image_data"] = list(image_data)
        if self.lora_path:
            payload["lora_path"] = self.lora_path
        body, url = await self._request("/generate", payload, affinity_key, rid_base=rid or uuid.uuid4().hex)
        return GenerateResult.from_response(body, url)

    async def _request(
        self, path: str, payload: dict, affinity_key: str | None, rid_base: str | None = None
    ) -> tuple[Any, str]:
        """POST with balancing, retries and health handling; returns (JSON body, server url). With
        ``rid_base`` every attempt carries a fresh rid of it, each registered until the call ends (an
        attempt whose connection dropped may still run on its server: :meth:`abort` reaches it too)."""
        sent: list[str] = []
        try:
            return await self._attempts_until_answered(path, payload, affinity_key, rid_base, sent)
        finally:
            for rid in sent:
                self._forget_attempt(rid_base or "", rid)

    async def _attempts_until_answered(
        self, path: str, payload: dict, affinity_key: str | None, rid_base: str | None, sent: list[str]
    ) -> tuple[Any, str]:
        deadline = time.monotonic() + self.timeout_s
        attempt, avoid = 0, None
        while True:
            server = self._choose(affinity_key, avoid)
            if server is None:
                await self._wait_for_healthy(deadline)
                continue
            if rid_base is not None:
                payload = {**payload, "rid": attempt_rid(rid_base)}
                sent.append(payload["rid"])
                self._attempts.setdefault(rid_base, set()).add(payload["rid"])
            server.outstanding += 1
            shard = self._shard()
            shard.in_flight += 1
            try:
                resp = await shard.http.post(
                    server.url + path,
                    json=payload,
                    headers=self._api_headers,
                    timeout=max(1.0, deadline - time.monotonic()),
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self._mark_down(server, f"{type(e).__name__}: {e}")
                why = f"{server.url}: cannot connect ({type(e).__name__})"
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as e:
                self._mark_down(server, f"{type(e).__name__}: {e}")
                why = f"{server.url}: connection lost ({type(e).__name__})"
            except httpx.TimeoutException as e:
                raise EngineUnavailableError(f"{server.url}{path}: no answer within {self.timeout_s:.0f} s") from e
            else:
                if resp.status_code < 400:
                    server.served += 1
                    server.answered_at = time.monotonic()
                    return resp.json(), server.url
                if resp.status_code < 500:
                    raise self._refusal(resp, server.url + path)
                why = f"{server.url}: HTTP {resp.status_code}: {_error_message(resp)}"
            finally:
                server.outstanding -= 1
                shard.in_flight -= 1
            attempt += 1
            avoid = server
            if attempt > self.max_retries:
                raise EngineUnavailableError(f"{path} failed after {attempt} attempts; last: {why}")
            delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s) * (0.5 + random.random())
            if time.monotonic() + delay > deadline:
                raise EngineUnavailableError(f"{path} failed and the time limit is reached; last: {why}")
            log.info("retrying %s in %.2f s (attempt %d): %s", path, delay, attempt, why)
            await anyio.sleep(delay)

    def _forget_attempt(self, base: str, rid: str) -> None:
        live = self._attempts.get(base)
        if live is not None:
            live.discard(rid)
            if not live:
                del self._attempts[base]

    def _refusal(self, resp: httpx.Response, where: str, admin: bool = False) -> EngineRequestError:
        message = _error_message(resp)
        if resp.status_code in (401, 403):
            message = f"{message or 'Unauthorized'}: the engine wants an API key ({self._key_hints[admin]})"
        return EngineRequestError(resp.status_code, message, where)

    async def model_info(self) -> dict:
        """``/model_info`` of an engine (``/get_model_info`` on older SGLang)."""
        servers = sorted(self.engines or self._pool, key=lambda s: not s.healthy)
        last = ""
        for s in servers:
            for path in ("/model_info", "/get_model_info"):
                try:
                    r = await self._http_for(s).get(
                        s.url + path, headers=self._api_headers, timeout=self.health_timeout_s
                    )
                except httpx.HTTPError as e:
                    last = f"{s.url}: {type(e).__name__}"
                    break
                if r.status_code == 200:
                    return r.json()
                if r.status_code in (401, 403):
                    raise self._refusal(r, s.url + path)
                last = f"{s.url}{path}: HTTP {r.status_code}"
        raise EngineUnavailableError(f"no engine answered /model_info ({last})")

    async def _broadcast(self, path: str, body: dict | None = None) -> list[Any]:
        """POST to every engine directly (the router does not fan control calls out)."""
        targets = self.engines or self._pool
        results: list[Any] = [None] * len(targets)
        refusals: list[EngineRequestError] = []

        async def one(i: int, s: _Server) -> None:
            r = await self._http_for(s).post(
                s.url + path, json=body or {}, headers=self._admin_headers, timeout=self.timeout_s
            )
            if r.status_code >= 400:  # collected, so that the caller gets the error, not an exception group
                refusals.append(self._refusal(r, s.url + path, admin=True))
                return
            results[i] = (
                r.json() if r.content and r.headers.get("content-type", "").startswith("application/json") else None
            )

        async with anyio.create_task_group() as tg:
            for i, s in enumerate(targets):
                tg.start_soon(one, i, s)
        if len(refusals) == 1:
            raise refusals[0]
        if refusals:
            raise EngineError("; ".join(str(e) for e in refusals))
        return results

    async def pause(self, mode: str = "abort") -> None:
        await self._broadcast("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._broadcast("/continue_generation")

    async def abort(self, rid: str | None = None) -> None:
        """Abort request ``rid`` (a base, as :meth:`generate` takes it: every attempt of it in flight),
        or everything when None, on every engine."""
        if rid is None:
            await self._broadcast("/abort_request", {"rid": "", "abort_all": True})
            return
        for one in sorted(self._attempts.get(rid, ())) or [rid]:  # no call in progress: SGLang ignores it
            await self._broadcast("/abort_request", {"rid": one, "abort_all": False})

    MODEL_INFO_FIELDS_READ = ("weight_version",)  # read by weight_versions() (checked like the above)

    async def weight_versions(self) -> list[str]:
        out = []
        for s in self.engines or self._pool:
            r = await self._http_for(s).get(
                s.url + "/model_info", headers=self._api_headers, timeout=self.health_timeout_s
            )
            if r.status_code >= 400:
                raise self._refusal(r, s.url + "/model_info")
            out.append(str(r.json().get("weight_version")))
        return out
