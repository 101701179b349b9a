"""OpenAI's chat-completions wire format: request validation, messages for the chat template,
tool calls out, responses and stream chunks. No I/O, no torch, no engine.

Shared by both hosts of ``/v1/chat/completions``: the agent endpoint (which records calls) and the
embedded engine (which does not). Shapes follow OpenAI's API reference and SGLang 0.5.23
(``sglang/srt/entrypoints/openai/protocol.py``); ``tests/test_agents_conformance.py`` checks every
response key against SGLang's models.

Requests: every field of ``chat.completions.create`` is used, accepted and ignored (labels such as
``user``, ``metadata``), accepted at its default only (penalties, ``logit_bias``, ``response_format``
other than text, ``tool_choice`` ``required`` ...; a 400 naming the field otherwise), or refused as
``Unrecognized request argument supplied: <name>``. Any ``model`` name is accepted. ``seed`` gives
choice *i* the seed ``seed + i``. Errors use OpenAI's shape, which the SDK raises as
``BadRequestError`` and friends.

Messages are normalised as SGLang does (text parts joined, ``developer`` as ``system``, tool-call
arguments parsed). Each message has a *view*, a canonical JSON string of what it says (without
``reasoning_content`` or server-made tool-call ids), used to recognise a conversation that extends
an earlier call's (:mod:`agentrl.agents.recording`).

Completions, as in SGLang: a ``<think>`` block becomes ``reasoning_content`` when the host enables
it; tool calls are parsed from the text after it (:mod:`agentrl.tools.parsing`), the content is the
text before the first call, calls to undeclared tools are dropped, and ``tool_choice: "none"`` or
no tools parses nothing. See docs/agents.md.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from agentrl.tools.parsing import HermesToolCallParser, ToolCallParser

MAX_N = 128

USED_FIELDS = frozenset(
    {
        "messages",
        "model",
        "n",
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "seed",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "logprobs",
        "top_k",
        "min_p",
    }
)
IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "service_tier",
    }
)
# field -> the values accepted (they all mean "the default"); anything else is a 400 naming the field
DEFAULT_ONLY_FIELDS: dict[str, tuple] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "top_logprobs": (None, 0),
    "parallel_tool_calls": (None, True),
    "response_format": (None, {"type": "text"}),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "functions": (None,),
    "function_call": (None,),
}
WHY_UNSUPPORTED = {
    "response_format": "structured output needs constrained decoding",
    "parallel_tool_calls": "the model may emit several calls in one turn and all of them are returned",
    "top_logprobs": "only the sampled token's logprob is returned",
    "functions": "use tools",
    "function_call": "use tool_choice",
}
ALL_FIELDS = USED_FIELDS | IGNORED_FIELDS | frozenset(DEFAULT_ONLY_FIELDS)
ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIRequestError(ValueError):
    """A request OpenAI's API would refuse; answered as ``error_body`` with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict:
        return error_body(self.message, param=self.param, code=self.code, kind=self.kind)


def error_body(
    message: str, *, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"
) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _unsupported(name: str, value: Any) -> OpenAIRequestError:
    why = WHY_UNSUPPORTED.get(name, "agentrl does not implement it")
    return OpenAIRequestError(
        f"Unsupported parameter: '{name}' = {json.dumps(value)[:200]} is not supported ({why}); "
        f"leave it out or use its default",
        param=name,
        code="unsupported_parameter",
    )


# ----------------------------------------------------------------------------- messages


def _content(content: Any, where: str) -> str | list[dict]:
    """A message's content: a string, or (when it holds images) a list of text and ``image_url`` parts, which
    the chat takes apart (agentrl/images.py; an image that cannot be read is a 400 there)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIRequestError(f"{where}.content must be a string, a list of content parts or null", param=where)
    parts: list[dict] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and isinstance(_image_url(part), str):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(part)}})
        else:
            raise OpenAIRequestError(
                f"{where}.content[{j}] of type {kind!r} is not supported: agentrl's endpoint takes text and "
                'image_url parts ({"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}})',
                param=f"{where}.content",
                code="unsupported_value",
            )
    if all(p["type"] == "text" for p in parts):
        return " ".join(p["text"] for p in parts)
    return parts


def _image_url(part: dict) -> Any:
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url


def _arguments(raw: Any, where: str) -> dict:
    """A tool call's arguments (a JSON string on the wire) as an object, SGLang's strict rule."""
    if isinstance(raw, dict):
        return raw
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    try:
        value = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise OpenAIRequestError(f"{where}.function.arguments must be a JSON object (as a string)", param=where)
    return value


def _tool_calls(raw: Any, where: str) -> list[dict]:
    if not isinstance(raw, list):
        raise OpenAIRequestError(f"{where} must be a list", param=where)
    calls = []
    for k, call in enumerate(raw):
        here = f"{where}[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise OpenAIRequestError(
                f'{here} must be {{"type": "function", "function": {{"name", "arguments"}}}}', param=here
            )
        if call.get("type", "function") != "function":
            raise OpenAIRequestError(f"{here}.type {call.get('type')!r} is not supported (function only)", param=here)
        calls.append({"id": call.get("id"), "name": fn["name"], "arguments": _arguments(fn.get("arguments"), here)})
    return calls


def convert_message(message: Any, i: int) -> tuple[dict, str]:
    """(the message as the chat template takes it, its view); OpenAIRequestError names what is wrong."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise OpenAIRequestError(f"{where} must be an object", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise OpenAIRequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
    text = _content(message.get("content"), where)
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
    view: dict[str, Any] = {"role": role, "content": text}
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise OpenAIRequestError(f"{where}.{key} must be a string", param=f"{where}.{key}")
            out[key] = value
            if key != "reasoning_content":  # agents often drop it; the model's own reasoning is in the tokens
                view[key] = value
    if role == "assistant" and message.get("tool_calls"):
        calls = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]
        if out["tool_calls"] and not any(c["id"] for c in calls):
            for c in out["tool_calls"]:
                del c["id"]
        view["tool_calls"] = [[c["name"], c["arguments"]] for c in calls]
    return out, json.dumps(view, sort_keys=True, ensure_ascii=False)


def message_view(message: dict) -> str:
    """The view of one OpenAI message (what an agent would send back)."""
    return convert_message(message, 0)[1]


# ----------------------------------------------------------------------------- requests


@dataclass
class ChatRequest:
    """A validated ``/v1/chat/completions`` request."""

    messages: list[dict]  # as the chat template takes them
    views: list[str]  # one per message (see message_view)
    tools: list[dict] | None  # shown to the template and parsed for; None with tool_choice "none"
    model: str
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SGLang sampling params (not max_new_tokens)
    seed: int | None = None

    @property
    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools or []}

    @property
    def tools_key(self) -> str:
        """Canonical JSON of the tools shown to the template (part of what the prompt says)."""
        return json.dumps(self.tools, sort_keys=True, ensure_ascii=False)


def _number(body: dict, name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (low < value if low_open else low <= value)
        and value <= high
    )
    if not ok:
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise OpenAIRequestError(
            f"'{name}' must be a number in {bound}, got {value!r}", param=name, code="invalid_value"
        )
    return float(value)


def _integer(body: dict, name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise OpenAIRequestError(
            f"'{name}' must be an integer >= {low}, got {value!r}", param=name, code="invalid_value"
        )
    return value


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise OpenAIRequestError("'tools' must be a list", param="tools")
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise OpenAIRequestError(
                f'tools[{k}] must be a function tool ({{"type": "function", ...}})', param=f"tools[{k}]"
            )
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise OpenAIRequestError(f"tools[{k}].function.name must be a non-empty string", param=f"tools[{k}]")
    return tools or None


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body (see the module docstring for what is accepted)."""
    if not isinstance(body, dict):
        raise OpenAIRequestError("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in ALL_FIELDS)
    if unknown:
        raise OpenAIRequestError(f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0])
    for name, allowed in DEFAULT_ONLY_FIELDS.items():
        if name in body and body[name] not in allowed:
            raise _unsupported(name, body[name])

    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise OpenAIRequestError("'messages' must be a non-empty list", param="messages")
    messages, views = [], []
    for i, m in enumerate(raw_messages):
        out, view = convert_message(m, i)
        messages.append(out)
        views.append(view)

    model = body.get("model", "default")
    if not isinstance(model, str):
        raise OpenAIRequestError("'model' must be a string", param="model")
    tools = _tools(body)
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        if choice == "required" or isinstance(choice, dict):
            raise _unsupported("tool_choice", choice)
        raise OpenAIRequestError(
            f"'tool_choice' must be 'auto', 'none', 'required' or a function, got {choice!r}",
            param="tool_choice",
            code="invalid_value",
        )
    if choice == "none":
        tools = None

    n = _integer(body, "n", 1)
    if n is not None and n > MAX_N:
        raise OpenAIRequestError(f"'n' must be at most {MAX_N}, got {n}", param="n", code="invalid_value")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise OpenAIRequestError("'stop' must be a string or a list of strings", param="stop")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise OpenAIRequestError(f"'seed' must be an integer, got {seed!r}", param="seed")
    for name in ("stream", "logprobs"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise OpenAIRequestError(f"'{name}' must be true or false", param=name)
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or not set(options) <= {
            "include_usage",
            "continuous_usage_stats",
            "include_obfuscation",
        }:
            raise OpenAIRequestError("'stream_options' may only hold include_usage", param="stream_options")
        if not stream:
            raise OpenAIRequestError("'stream_options' is only allowed with stream: true", param="stream_options")

    sampling: dict[str, Any] = {}
    for name, low, high, low_open in (
        ("temperature", 0.0, 2.0, False),
        ("top_p", 0.0, 1.0, True),
        ("min_p", 0.0, 1.0, False),
    ):
        value = _number(body, name, low, high, low_open=low_open)
        if value is not None:
            sampling[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or (top_k < 1 and top_k != -1):
            raise OpenAIRequestError(f"'top_k' must be -1 or at least 1, got {top_k!r}", param="top_k")
        sampling["top_k"] = top_k
    if stop:
        sampling["stop"] = stop
    return ChatRequest(
        messages=messages,
        views=views,
        tools=tools,
        model=model,
        n=n or 1,
        stream=stream,
        include_usage=bool((options or {}).get("include_usage")),
        logprobs=bool(body.get("logprobs")),
        max_tokens=max_tokens,
        sampling=sampling,
        seed=seed,
    )


# ----------------------------------------------------------------------------- completions


@dataclass
class ChoiceOut:
    """One choice as the client sees it."""

    content: str
    tool_calls: list[dict] | None  # OpenAI's shape, ids included
    finish_reason: str  # stop | length | tool_calls | abort
    matched_stop: int | str | None = None
    logprobs: list[dict] | None = None  # OpenAI's per-token entries when the request asked
    reasoning_content: str | None = None

    def message(self) -> dict:
        """The assistant message (SGLang's ``ChatMessage``)."""
        out: dict[str, Any] = {
            "role": "assistant",
            "content": self.content,
            "reasoning_content": self.reasoning_content,
        }
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, the rest) of a completion: SGLang's reasoning parser for ``<think>...</think>``. A
    closing tag without an opening one (the template opened it) counts; an unclosed block runs to the end."""
    if THINK_START not in text and THINK_END not in text:
        return None, text
    body = text[text.index(THINK_START) + len(THINK_START) :] if THINK_START in text else text
    reasoning, _, rest = body.partition(THINK_END)
    return reasoning.strip(), rest.lstrip()


def split_tool_calls(text: str, parser: ToolCallParser, tool_names: set[str]) -> tuple[str, list[dict]]:
    """(content, OpenAI tool calls) of a completion's text, SGLang's rules (module docstring)."""
    turn = parser.parse(text)
    starts = [text.find(c.raw) for c in turn.calls if c.raw and c.raw in text]
    if isinstance(parser, HermesToolCallParser) and parser.open_tag in text:
        starts.append(text.index(parser.open_tag))
    if not starts:
        return text, []
    content = text[: min(starts)].strip()
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "index": k,
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for k, c in enumerate(c for c in turn.calls if c.name in tool_names)
    ]
    for k, call in enumerate(calls):
        call["index"] = k
    return content, calls


def finish_reason_of(engine_finish: dict, has_calls: bool) -> tuple[str, int | str | None]:
    """OpenAI's finish_reason and SGLang's ``matched_stop`` from an engine finish_reason."""
    kind = engine_finish.get("type", "stop")
    if kind == "stop" and has_calls:
        return "tool_calls", None
    return kind, engine_finish.get("matched") if kind == "stop" else None


def token_logprobs(token_texts: list[str], logprobs: list[float]) -> list[dict]:
    return [
        {"token": t, "bytes": list(t.encode("utf-8")), "logprob": lp, "top_logprobs": []}
        for t, lp in zip(token_texts, logprobs)
    ]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def chat_completion(cid: str, model: str, choices: list[ChoiceOut], use: dict, metadata: dict | None = None) -> dict:
    """The non-streaming response (``chat.completion``)."""
    out = {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": c.message(),
                "logprobs": {"content": c.logprobs} if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "matched_stop": c.matched_stop,
            }
            for i, c in enumerate(choices)
        ],
        "usage": use,
    }
    if metadata:
        out["metadata"] = metadata
    return out


def chat_completion_chunks(cid: str, model: str, choices: list[ChoiceOut], use: dict | None) -> list[dict]:
    """The streamed response (``chat.completion.chunk`` objects, in order), for a finished completion:
    per choice a role chunk, the reasoning, the content, one chunk per tool call, the finish; then the usage
    when asked."""
    created = int(time.time())

    def chunk(
        index: int,
        delta: dict,
        finish: str | None = None,
        logprobs: list | None = None,
        matched: int | str | None = None,
    ) -> dict:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": {"content": logprobs} if logprobs is not None else None,
            "finish_reason": finish,
        }
        if finish is not None:
            choice["matched_stop"] = matched
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}

    chunks = []
    for i, c in enumerate(choices):
        chunks.append(chunk(i, {"role": "assistant", "content": ""}))
        if c.reasoning_content:
            chunks.append(chunk(i, {"reasoning_content": c.reasoning_content}))
        if c.content or c.logprobs:
            chunks.append(chunk(i, {"content": c.content}, logprobs=c.logprobs))
        for call in c.tool_calls or []:
            chunks.append(chunk(i, {"tool_calls": [call]}))
        chunks.append(chunk(i, {}, finish=c.finish_reason, matched=c.matched_stop))
    if use is not None:
        chunks.append(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": use,
            }
        )
    return chunks


def sse(chunks: list[dict]) -> bytes:
    """Server-sent events: ``data: {json}`` per chunk, then ``data: [DONE]``."""
    return (
        b"".join(b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    )


def model_card(name: str, max_model_len: int | None) -> dict:
    """SGLang's ``ModelCard``."""
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "agentrl",
        "root": name,
        "parent": None,
        "max_model_len": max_model_len,
    }


def model_list(name: str, max_model_len: int | None) -> dict:
    return {"object": "list", "data": [model_card(name, max_model_len)]}


def retrieve_model(name: str, served: str, max_model_len: int | None) -> tuple[int, dict]:
    """(status, body) of ``GET /v1/models/{name}`` (SGLang's 404 for another name)."""
    if name != served:
        return 404, error_body(f"The model '{name}' does not exist", param="model", code="model_not_found")
    return 200, model_card(name, max_model_len)
