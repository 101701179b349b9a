"""``/v1/chat/completions`` and ``/v1/models`` (agentrl/agents/openai_api.py) against SGLang's own OpenAI
protocol module (``sglang/srt/entrypoints/openai/protocol.py`` in the pinned wheel, parsed with ``ast`` by
tests/sglang_spec.py): every key agentrl answers with is a field of SGLang's pydantic model for that object,
with a value its annotation allows; the request fields agentrl acts on are SGLang's, and the values it
accepts for the fields it leaves at their default include SGLang's default. (The requests agentrl sends to
these routes are checked in tests/test_engine_conformance.py, with the engine's routes and the snapshot.)

Deliberate difference: errors use OpenAI's shape ``{"error": {...}}``, not SGLang's flat ``ErrorResponse``
(the OpenAI SDK reads both).
"""

from __future__ import annotations

import ast
from typing import Any

import pytest

from agentrl.agents.openai_api import (
    DEFAULT_ONLY_FIELDS,
    IGNORED_FIELDS,
    USED_FIELDS,
    ChoiceOut,
    chat_completion,
    chat_completion_chunks,
    model_list,
    retrieve_model,
    split_tool_calls,
    token_logprobs,
    usage,
)
from agentrl.tools.parsing import HermesToolCallParser
from tests import sglang_spec

# (model, field) -> the model of the nested object(s)
NESTED = {
    ("ChatCompletionResponse", "choices"): "ChatCompletionResponseChoice",
    ("ChatCompletionResponse", "usage"): "UsageInfo",
    ("ChatCompletionResponseChoice", "message"): "ChatMessage",
    ("ChatCompletionResponseChoice", "logprobs"): "ChoiceLogprobs",
    ("ChatMessage", "tool_calls"): "ToolCall",
    ("ToolCall", "function"): "FunctionResponse",
    ("ChoiceLogprobs", "content"): "ChatCompletionTokenLogprob",
    ("ChatCompletionStreamResponse", "choices"): "ChatCompletionResponseStreamChoice",
    ("ChatCompletionStreamResponse", "usage"): "UsageInfo",
    ("ChatCompletionResponseStreamChoice", "delta"): "DeltaMessage",
    ("ChatCompletionResponseStreamChoice", "logprobs"): "ChoiceLogprobs",
    ("DeltaMessage", "tool_calls"): "ToolCall",
    ("ModelList", "data"): "ModelCard",
}
# OpenAI's request fields that SGLang 0.5.23's ChatCompletionRequest does not have (it ignores them too)
OPENAI_ONLY = {
    "audio",
    "function_call",
    "functions",
    "metadata",
    "modalities",
    "prediction",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "service_tier",
    "store",
    "verbosity",
    "web_search_options",
}


@pytest.fixture(scope="module")
def spec() -> sglang_spec.Spec:
    try:
        wheel = sglang_spec.fetch_wheel()
    except RuntimeError as e:
        pytest.fail(str(e))
    return sglang_spec.load_spec(sglang_spec.read_sources(wheel))


def shape_errors(value: Any, model: str, spec: sglang_spec.Spec, where: str) -> list[str]:
    """Why ``value`` is not an object SGLang's ``model`` would serialise (keys, values, nested models)."""
    if not isinstance(value, dict):
        return [f"{where} must be an object ({model}), got {value!r}"]
    fields = spec.openai_structs[model]
    errors = [f"{where}.{k} is not a field of SGLang's {model}" for k in value if k not in fields]
    for k, v in value.items():
        if k not in fields:
            continue
        nested = NESTED.get((model, k))
        if nested is not None and v is not None:
            for i, item in enumerate(v if isinstance(v, list) else [v]):
                errors += shape_errors(
                    item, nested, spec, f"{where}.{k}[{i}]" if isinstance(v, list) else f"{where}.{k}"
                )
            continue
        err = sglang_spec.conformance_error(v, spec.openai_annotations[f"{model}.{k}"], spec, f"{where}.{k}")
        errors += [err] if err else []
    return errors


def example_choices() -> list[ChoiceOut]:
    text = 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    content, calls = split_tool_calls(text, HermesToolCallParser(), {"add"})
    return [
        ChoiceOut(content, calls, "tool_calls", logprobs=token_logprobs(["Add", "ing"], [-0.5, -1.25])),
        ChoiceOut("5", None, "stop", matched_stop=7),
        ChoiceOut("55", None, "length"),
    ]


def test_chat_completions_are_sglangs_response_objects(spec):
    body = chat_completion("chatcmpl-1", "m", example_choices(), usage(10, 7))
    assert shape_errors(body, "ChatCompletionResponse", spec, "response") == []
    assert [c["finish_reason"] for c in body["choices"]] == ["tool_calls", "stop", "length"]


def test_stream_chunks_are_sglangs_chunk_objects(spec):
    chunks = chat_completion_chunks("chatcmpl-1", "m", example_choices(), usage(10, 7))
    errors = [
        e for i, c in enumerate(chunks) for e in shape_errors(c, "ChatCompletionStreamResponse", spec, f"chunk{i}")
    ]
    assert errors == []
    assert len(chunks) == 11  # role, content, call, finish; role, content, finish (twice); usage


def test_model_cards_are_sglangs(spec):
    assert shape_errors(model_list("tiny", 1024), "ModelList", spec, "models") == []
    status, card = retrieve_model("tiny", "tiny", 1024)
    assert status == 200 and shape_errors(card, "ModelCard", spec, "model") == []


def test_the_checker_itself_rejects_what_sglang_would_not_send(spec):
    bad = chat_completion("chatcmpl-1", "m", example_choices(), usage(1, 1))
    bad["choices"][0]["message"]["refusal"] = None
    bad["choices"][1]["finish_reason"] = "done"
    bad["usage"]["prompt_tokens"] = "10"
    errors = shape_errors(bad, "ChatCompletionResponse", spec, "response")
    assert any("message.refusal is not a field of SGLang's ChatMessage" in e for e in errors), errors
    assert any("finish_reason must be one of" in e for e in errors), errors
    assert any("usage.prompt_tokens must be int" in e for e in errors), errors


def test_request_fields_agentrl_acts_on_are_sglangs_with_sglangs_defaults(spec):
    request = spec.openai_structs["ChatCompletionRequest"]
    assert USED_FIELDS <= set(request), USED_FIELDS - set(request)
    assert (set(DEFAULT_ONLY_FIELDS) | IGNORED_FIELDS) - set(request) == OPENAI_ONLY
    for name, accepted in DEFAULT_ONLY_FIELDS.items():
        if name not in request:
            continue
        default = ast.literal_eval(request[name].default)
        assert default in accepted, f"{name}: SGLang's default {default!r} is refused by agentrl ({accepted})"
        annotation = spec.openai_annotations[f"ChatCompletionRequest.{name}"]
        for value in accepted:
            if value is None:  # null means "the default" in OpenAI's API (SGLang refuses it for some fields)
                continue
            err = sglang_spec.conformance_error(value, annotation, spec, name)
            assert err is None, err
    choice = spec.openai_annotations["ChatCompletionRequest.tool_choice"]
    for value in ("auto", "none"):  # the tool_choice values agentrl serves
        assert sglang_spec.conformance_error(value, choice, spec, "tool_choice") is None
