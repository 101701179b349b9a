"""``/v1/chat/completions`` and ``/v1/models`` over any token-in/token-out engine: one implementation,
two hosts (docs/agents.md).

* The **agent endpoint** (:mod:`agentrl.agents.endpoint`) serves it over an
  :class:`agentrl.engine.client.EngineClient`, with an :class:`agentrl.agents.recording.Episode` as the
  session: prompts are stitched onto the episode's earlier calls and every call is recorded.
* The **embedded engine** (:mod:`agentrl.engine.server`) serves it over its own scheduler, with
  :class:`FreshPrompts` as the session (each request rendered on its own, nothing recorded).

A call: validate (:func:`agentrl.agents.openai_api.parse_chat_request`), ask the session for the ``n``
prompts (:class:`agentrl.episode.chat.TokenChat` at the generation prompt), generate the ``n`` completions
concurrently, each one model turn of :func:`agentrl.episode.turn.generate_turn` (the actors' own: aborted
parts continued, ``"default"`` versions waited for when ``versioned``), parse tool calls from each
completion's text, let the session commit the call, answer with JSON or server-sent events. The engine
host returns an abort at once instead (``continue_aborts=False``), as SGLang does.

**Sampling.** ``forced_sampling`` (training) replaces the client's ``temperature``/``top_p``/``top_k``
with the run's: the learner recomputes logprobs at ``actors.temperature``. ``max_tokens_cap`` bounds
every choice (the client's ``max_tokens``, when smaller, wins); ``default_max_tokens`` applies when the
client gives none; ``max_model_len`` keeps a completion inside the context (it ends with ``length``).

**Reasoning** (``reasoning=True``) returns ``<think>...</think>`` as ``reasoning_content`` and parses tool
calls from the text after it only. ``tool_parser`` and ``reasoning`` are defaults a session's
:class:`CallPlan` may override. **Streaming** sends the finished completion as chunks.

Invariants: an engine refusal is the client's 400, any other engine failure a 503; one failed choice
ends the call (the others stop generating); a client that goes away cancels the generation and
nothing is committed.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentrl.agents.openai_api import (
    ChatRequest,
    ChoiceOut,
    OpenAIRequestError,
    chat_completion,
    chat_completion_chunks,
    completion_id,
    finish_reason_of,
    model_list,
    parse_chat_request,
    retrieve_model,
    split_reasoning,
    split_tool_calls,
    sse,
    token_logprobs,
    usage,
)
from agentrl.engine.client import EngineRequestError
from agentrl.engine.native_api import RequestError
from agentrl.episode.chat import ChatCodec, TokenChat
from agentrl.episode.turn import EngineClientLike, EpisodeFailed, TurnOptions, generate_turn
from agentrl.images import ImageError
from agentrl.tools.parsing import ToolCallParser, get_parser

log = logging.getLogger(__name__)

SAMPLING_FORCED_KEYS = ("temperature", "top_p", "top_k", "min_p")


@dataclass
class ChoiceResult:
    """One generated choice: its chat (prompt + completion tokens) and how generation went."""

    chat: TokenChat
    finish: dict  # the engine's finish_reason of the last part
    out: ChoiceOut | None = None
    num_generate_calls: int = 0
    num_aborts: int = 0
    generation_latency_s: float = 0.0
    prompt_len: int = 0
    weight_version: str = ""  # as the engine reported it on the last part


@dataclass
class CallPlan:
    """The prompts of one call (one TokenChat per choice, at the generation prompt) and what the
    session needs to commit it."""

    request: ChatRequest
    chats: list[TokenChat]
    affinity_key: str
    rid: str
    state: Any = None  # the session's own (episodes: which sequence the call extends)
    max_len: int | None = None  # the session's own bound on prompt + completion tokens (an episode's limit)
    tool_parser: ToolCallParser | None = None  # the session's own parser; None: the service's
    reasoning: bool | None = None  # the session's own reasoning split; None: the service's
    results: list[ChoiceResult] = field(default_factory=list)


class PromptSession(Protocol):
    """Where a call's prompts come from and where its results go."""

    def plan(self, request: ChatRequest, codec: ChatCodec) -> CallPlan: ...

    def commit(self, plan: CallPlan) -> None: ...


class FreshPrompts:
    """Each request rendered with the chat template on its own; nothing recorded (the engine host)."""

    def plan(self, request: ChatRequest, codec: ChatCodec) -> CallPlan:
        chat = TokenChat.start(codec, request.messages, request.tools)
        rid = completion_id()
        return CallPlan(request, clone_chats(chat, request.n), affinity_key=rid, rid=rid)

    def commit(self, plan: CallPlan) -> None:
        pass


def clone_chats(chat: TokenChat, n: int) -> list[TokenChat]:
    """``chat`` and ``n - 1`` independent copies (the codec is shared, not copied)."""
    return [chat] + [copy.deepcopy(chat, {id(chat.codec): chat.codec}) for _ in range(n - 1)]


class ChatService:
    """Generation and response building behind ``/v1/chat/completions`` (see the module docstring)."""

    def __init__(
        self,
        codec: ChatCodec,
        engine: EngineClientLike,
        model_name: str,
        *,
        max_model_len: int | None = None,
        tool_parser: str | ToolCallParser = "hermes",
        continue_aborts: bool = True,
        versioned: bool = False,
        forced_sampling: dict | None = None,
        default_max_tokens: int | None = None,
        max_tokens_cap: int | None = None,
        max_empty_aborts: int = 20,
        max_version_wait_s: float = 600.0,
        reasoning: bool = False,
    ):
        self.codec, self.engine, self.model_name = codec, engine, model_name
        self.max_model_len = max_model_len
        self.parser = get_parser(tool_parser) if isinstance(tool_parser, str) else tool_parser
        self.forced_sampling = {k: v for k, v in (forced_sampling or {}).items() if k in SAMPLING_FORCED_KEYS}
        self.default_max_tokens, self.max_tokens_cap = default_max_tokens, max_tokens_cap
        self.turn_options = TurnOptions(
            versioned=versioned,
            continue_aborts=continue_aborts,
            max_empty_aborts=max_empty_aborts,
            max_version_wait_s=max_version_wait_s,
            wrap_engine_errors=False,  # generate() answers the engine's refusals and failures itself
        )
        self.reasoning = reasoning  # <think>...</think> returned as reasoning_content (SGLang's --reasoning-parser)
        self._override_logged = False

    # -- routes (host-independent handlers; the host decides the session) ----------------------
    def models(self) -> dict:
        return model_list(self.model_name, self.max_model_len)

    def model(self, name: str) -> Response:
        status, body = retrieve_model(name, self.model_name, self.max_model_len)
        return JSONResponse(body, status_code=status)

    async def handle(self, request: Request, session: PromptSession) -> Response:
        """One ``/v1/chat/completions`` call, start to finish."""
        try:
            req = parse_chat_request(await _json(request))
            plan = session.plan(req, self.codec)
        except OpenAIRequestError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except ImageError as e:  # an image that cannot be read, or images for a text model
            error = OpenAIRequestError(str(e), param="messages", code="invalid_image")
            return JSONResponse(error.body(), status_code=error.status)
        work = asyncio.ensure_future(self.generate(plan))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            gone.cancel()
        if work.cancelled():
            return Response(status_code=499)
        try:
            work.result()
            session.commit(plan)
        except OpenAIRequestError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return self.respond(plan)

    # -- generation ---------------------------------------------------------------------------
    def sampling(self, req: ChatRequest, index: int) -> dict[str, Any]:
        """SGLang sampling params of choice ``index`` (``max_new_tokens`` included)."""
        params = dict(req.sampling)
        if self.forced_sampling:
            changed = {
                k: params[k] for k in self.forced_sampling if k in params and params[k] != self.forced_sampling[k]
            }
            if changed and not self._override_logged:
                self._override_logged = True
                log.warning(
                    "an agent asked for %s; the run samples with %s (behaviour logprobs must be of the "
                    "distribution the learner trains on)",
                    changed,
                    self.forced_sampling,
                )
            params.update(self.forced_sampling)
        if req.seed is not None:
            params["sampling_seed"] = req.seed + index
        if self.codec.end_of_turn_id is not None:
            params["stop_token_ids"] = [self.codec.end_of_turn_id]
        limit = req.max_tokens if req.max_tokens is not None else self.default_max_tokens
        if self.max_tokens_cap is not None:
            limit = self.max_tokens_cap if limit is None else min(limit, self.max_tokens_cap)
        params["max_new_tokens"] = limit
        return params

    async def generate(self, plan: CallPlan) -> None:
        """Generate every choice of ``plan`` concurrently; fills ``plan.results``."""
        req = plan.request
        plan.results = [ChoiceResult(chat=chat, finish={}, prompt_len=len(chat)) for chat in plan.chats]
        tasks = [asyncio.ensure_future(self._choice(plan, i)) for i in range(req.n)]
        try:
            await asyncio.gather(*tasks)
        except OpenAIRequestError:
            raise
        except RequestError as e:  # the embedded engine refused the prompt (too long ...)
            raise _refused(str(e)) from e
        except EngineRequestError as e:  # an engine refused it over HTTP (4xx)
            raise _refused(e.message) from e
        except EpisodeFailed as e:  # the engine broke the protocol, or has no policy version
            raise OpenAIRequestError(str(e), status=503, kind="server_error") from e
        except Exception as e:
            log.warning("generation failed: %s: %s", type(e).__name__, e)
            raise OpenAIRequestError(
                f"the engine could not complete the request: {type(e).__name__}: {e}", status=503, kind="server_error"
            ) from e
        finally:  # one failed choice ends the call: the others stop generating
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        parser = self.parser if plan.tool_parser is None else plan.tool_parser
        reasoning = self.reasoning if plan.reasoning is None else plan.reasoning
        for r in plan.results:
            r.out = self._choice_out(r, req, parser, reasoning)

    async def _choice(self, plan: CallPlan, index: int) -> None:
        result = plan.results[index]
        chat = result.chat
        params = self.sampling(plan.request, index)
        remaining = params["max_new_tokens"]
        if self.max_model_len is not None:  # a completion never runs past the context: it ends with "length"
            room = self.max_model_len - len(chat) - 1 - self.codec.reserve_tokens  # + the turn's closing tokens
            if room < 1:
                raise OpenAIRequestError(
                    f"This model's maximum context length is {self.max_model_len} tokens; the messages take "
                    f"{len(chat)}, which leaves no room for a completion",
                    param="messages",
                    code="context_length_exceeded",
                )
            remaining = room if remaining is None else min(remaining, room)
        if plan.max_len is not None:  # the session's own limit (the session refused a prompt without room)
            room = max(1, plan.max_len - len(chat) - 1 - self.codec.reserve_tokens)
            remaining = room if remaining is None else min(remaining, room)
        turn = await generate_turn(
            self.engine,
            chat,
            params,
            remaining,
            affinity_key=plan.affinity_key,
            rid_prefix=f"{plan.rid}-{index}",
            options=self.turn_options,
        )
        result.finish, result.weight_version = turn.finish, turn.weight_version
        result.num_generate_calls += turn.num_generate_calls
        result.num_aborts += turn.num_aborts
        result.generation_latency_s += turn.generation_latency_s

    def _choice_out(self, r: ChoiceResult, req: ChatRequest, parser: ToolCallParser, reasoning: bool) -> ChoiceOut:
        text = r.chat.turn_content()
        matched = r.finish.get("matched")
        if r.finish.get("type") == "stop" and isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]  # the client never sees the stop string (SGLang trims it)
        thought, text = split_reasoning(text) if reasoning else (None, text)
        content, calls = split_tool_calls(text, parser, req.tool_names) if req.tools else (text, [])
        reason, matched_stop = finish_reason_of(r.finish, bool(calls))
        logprobs = None
        if req.logprobs:
            ids = r.chat.tokens[r.prompt_len :]
            logprobs = token_logprobs([self.codec.decode([t]) for t in ids], list(r.chat.logprobs[r.prompt_len :]))
        return ChoiceOut(
            content=content,
            tool_calls=calls or None,
            finish_reason=reason,
            matched_stop=matched_stop,
            logprobs=logprobs,
            reasoning_content=thought,
        )

    # -- responses ----------------------------------------------------------------------------
    def respond(self, plan: CallPlan) -> Response:
        req = plan.request
        choices: list[ChoiceOut] = []
        for r in plan.results:
            assert r.out is not None, "respond() follows generate()"
            choices.append(r.out)
        use = usage(plan.results[0].prompt_len, sum(len(r.chat) - r.prompt_len for r in plan.results))
        cid = completion_id()
        if req.stream:
            body = sse(chat_completion_chunks(cid, req.model, choices, use if req.include_usage else None))
            return Response(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        metadata = {"weight_version": plan.results[0].weight_version}  # as SGLang reports it
        return JSONResponse(chat_completion(cid, req.model, choices, use, metadata))


def _refused(message: str) -> OpenAIRequestError:
    """The engine's refusal as the client's 400 (OpenAI's code when the context is exceeded)."""
    code = "context_length_exceeded" if "context length" in message else None
    return OpenAIRequestError(message, code=code)


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as e:
        raise OpenAIRequestError(f"the request body is not valid JSON: {e}") from None


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
