"""Fuzzing the embedded engine's HTTP border: ``/generate`` bodies and the control bodies.

Properties: any request body gives either a valid request or a 400 whose message names the
offending field, never a 500 and never a crash of the scheduler thread; the engine keeps
serving afterwards. The pure parsers (``decode_body``, ``parse_generate``,
``parse_sampling_params``, ``parse_control``) get many examples in-process; a smaller number
of bodies goes over HTTP: ``/generate`` to a shared engine (stateless: nothing there changes),
control bodies to an engine of this module's own, which is checked (``/health`` and a normal
``/generate``) and put back (continued, out of any weight-update session) after each one.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from agentrl.engine.native_api import (
    GENERATE_FIELDS,
    SAMPLING_DEFAULTS,
    TOP_K_ALL,
    GenerateCall,
    RequestError,
    decode_body,
    parse_generate,
)
from agentrl.engine.server import CONTROL_BODIES, parse_control
from tests._fuzz import fuzz, json_values, mostly, nested, texts

VOCAB, CONTEXT = 300, 160
# Where SGLang's own context-length messages do not name a field, they say "context length".
FIELD_WORDS = (*GENERATE_FIELDS, "sampling_params", "request body", "context length")


def encode(text: str) -> list[int]:
    """Stands in for the tokenizer (one id per UTF-8 byte); raises on lone surrogates as tokenizers do."""
    return list(text.encode("utf-8"))


# ------------------------------------------------------------------------------ strategies

surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2)
strings = st.one_of(texts, texts, texts, texts, texts, surrogates)
numbers = (
    st.integers(-3, 300)
    | st.integers()
    | st.floats()
    | st.sampled_from([0, 1, -1, 1e-7, 2**63, -(2**63) - 1, 10**400, 1 << 30])
)
good_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
token_ids = good_ids | st.lists(st.integers(-2, VOCAB + 2) | numbers, max_size=4)
wild = numbers | st.booleans() | st.none() | strings | st.lists(strings, max_size=3) | token_ids | json_values


def _mostly(plausible: st.SearchStrategy) -> st.SearchStrategy:
    return mostly(plausible, wild)


SAMPLING_VALUES = {
    "max_new_tokens": st.integers(0, 160) | st.none(),
    "temperature": st.floats(0, 3) | st.integers(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-2, 400),
    "min_p": st.floats(0, 1),
    "stop": strings | st.lists(strings, max_size=3),
    "stop_token_ids": token_ids,
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "sampling_seed": st.integers(),
    "stream_interval": st.integers(-1, 4),
    "n": st.sampled_from([1, 2]),
    "min_new_tokens": st.sampled_from([0, 1]),
    "logit_bias": st.just({}),
}
sampling_params = st.one_of(
    st.lists(st.sampled_from(list(SAMPLING_DEFAULTS)), max_size=4, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: _mostly(SAMPLING_VALUES.get(k, st.none())) for k in keys})
    ),
    st.dictionaries(st.sampled_from(list(SAMPLING_DEFAULTS)) | strings, wild, max_size=3),
    wild,
)
prompts = st.one_of(
    st.fixed_dictionaries({"input_ids": good_ids}),
    st.fixed_dictionaries({"input_ids": st.lists(good_ids, min_size=1, max_size=3)}),
    st.fixed_dictionaries({"text": strings | st.lists(strings, min_size=1, max_size=3)}),
    st.fixed_dictionaries({}, optional={"input_ids": wild, "text": wild}),
)
GENERATE_VALUES = {
    "sampling_params": _mostly(sampling_params | st.lists(sampling_params, max_size=3)),
    "rid": _mostly(strings | st.lists(strings, max_size=3)),
    "return_logprob": _mostly(st.booleans() | st.lists(st.booleans(), max_size=3)),
    "return_text_in_logprobs": _mostly(st.booleans()),
    "stream": _mostly(st.booleans()),
    "top_logprobs_num": _mostly(st.sampled_from([0, None, 0, 1])),
    "logprob_start_len": _mostly(st.sampled_from([-1, None, -1, 0])),
    "image_data": _mostly(st.none()),
    "lora_path": _mostly(st.none() | strings),
}
generate_bodies = st.builds(
    lambda prompt, known, extra: {**extra, **prompt, **known},
    prompts,
    st.fixed_dictionaries({}, optional=GENERATE_VALUES),
    st.dictionaries(strings, json_values, max_size=2),
)


def as_bytes(body: dict) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # lone surrogates go out as \udXXX escapes


raw_bodies = st.one_of(
    st.binary(max_size=40),
    json_values.map(lambda v: json.dumps(v, allow_nan=True).encode()),
    st.sampled_from(
        [
            b"",
            b"  ",
            b"{",
            b'{"input_ids": [1,',
            b"[" * 100_000,
            nested(5000).encode(),
            b'{"input_ids": [1], "rid": "\\ud800"}',
            b'{"\\udfff": 1}',
            b"\xff\xfe",
            b'{"input_ids": [' + b"9" * 5000 + b"]}",
        ]
    ),
)


def check_valid(call: GenerateCall, body: dict) -> None:
    """What a request that passed validation guarantees to the scheduler."""
    assert call.inputs and all(isinstance(i.rid, str) for i in call.inputs)
    for inp in call.inputs:
        json.dumps(inp.rid, ensure_ascii=False).encode("utf-8")  # echoed in the response
        assert inp.input_ids and all(type(t) is int and 0 <= t < VOCAB for t in inp.input_ids)
        p = inp.params
        assert len(inp.input_ids) < CONTEXT
        assert p.max_new_tokens is None or 0 <= p.max_new_tokens < CONTEXT - len(inp.input_ids)
        assert math.isfinite(p.temperature) and p.temperature > 0
        assert 0 < p.top_p <= 1 and 0 <= p.min_p <= 1 and 1 <= p.top_k <= TOP_K_ALL
        assert p.sampling_seed is None or -(2**63) <= p.sampling_seed < 2**63
        assert all(isinstance(s, str) and s for s in p.stop)
        assert all(0 <= t < VOCAB for t in p.stop_token_ids)
        for s in p.stop:
            s.encode("utf-8")  # the scheduler tokenizes stop strings


def check_rejection(e: RequestError, body: dict) -> None:
    """The message names a field of /generate, or the body's own key that is at fault."""
    message = str(e)
    keys = [repr(k)[:40] for k in body] if isinstance(body, dict) else []
    assert any(word in message for word in (*FIELD_WORDS, *keys)), message
    assert len(message) < 1500, message[:300]


def parse_raw(raw: bytes) -> GenerateCall:
    return parse_generate(decode_body(raw), vocab_size=VOCAB, context_len=CONTEXT, encode=encode)


# ---------------------------------------------------------------------------- in-process


@fuzz(300)
@given(generate_bodies)
@example({"input_ids": [1], "sampling_params": {"sampling_seed": 2**70}})  # crashed the scheduler thread
@example({"input_ids": [1], "sampling_params": {"top_k": 2**70}})  # overflowed a tensor: every running request aborted
@example({"input_ids": [1], "sampling_params": {"temperature": 10**400}})  # OverflowError: a 500
@example({"input_ids": [1], "sampling_params": {"top_p": 10**400}})
@example({"text": "\ud800"})  # the tokenizer raised: a 500
@example({"input_ids": [1], "sampling_params": {"stop": ["\udc80"]}})  # raised in the scheduler thread
@example({"input_ids": [1], "rid": "\ud800"})  # the response could not be encoded: a 500
@example({"text": ""})  # said "input_ids is empty"
@example({"input_ids": [1], "sampling_params": {"temperature": list(range(10_000))}})
def test_any_generate_body_is_a_valid_request_or_a_400_naming_the_field(body):
    try:
        call = parse_raw(as_bytes(body))
    except RequestError as e:
        check_rejection(e, body)
    else:
        check_valid(call, body)


@fuzz(150)
@given(raw_bodies)
def test_any_raw_body_is_a_valid_request_or_a_400(raw):
    try:
        call = parse_raw(raw)
    except RequestError as e:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = {}
        check_rejection(e, body)
    else:
        check_valid(call, {})


@st.composite
def control_bodies(draw) -> tuple[str, dict]:
    path = draw(st.sampled_from(sorted(CONTROL_BODIES)))
    names = list(CONTROL_BODIES[path]) or ["rid"]
    known = draw(st.dictionaries(st.sampled_from(names), wild, max_size=len(names)))
    return path, {**draw(st.dictionaries(strings, json_values, max_size=2)), **known}


@fuzz(250)
@given(control_bodies())
@example(("/update_weight_version", {"new_version": "\ud800"}))  # every later response failed to encode
@example(("/pause_generation", {"mode": list(range(10_000))}))
def test_any_control_body_is_its_fields_or_a_400_naming_the_route_and_field(case):
    path, body = case
    try:
        decoded = decode_body(as_bytes(body))
        fields = parse_control(path, decoded)
    except RequestError as e:
        message = str(e)
        assert path in message or "lone surrogate" in message, message
        assert any(name in message for name in CONTROL_BODIES[path]) or "lone surrogate" in message, message
        assert len(message) < 1500, message[:300]
    else:
        assert set(fields) == set(CONTROL_BODIES[path])
        for name, spec in CONTROL_BODIES[path].items():
            value = fields[name]
            assert value == spec.default if name not in decoded else value is decoded[name]
            if isinstance(value, str):
                value.encode("utf-8")


# ---------------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def tokenizer(engine_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine_model)


@pytest.fixture(scope="module")
def own_engine(engine_model, tmp_path_factory):
    """An engine of this module's own, for the bodies that change an engine's state."""
    from tests.conftest_engine import start_engines

    (proc,) = start_engines(engine_model, 1, tmp_path_factory.mktemp("fuzz_engine"))
    yield proc.url
    proc.stop()


def _server_error(url: str) -> str | None:
    return httpx.get(f"{url}/server_info", timeout=10).json()["last_error"]


def _check_serving(url: str) -> None:
    """The engine answers /health and a normal /generate (its scheduler thread is alive)."""
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    r = httpx.post(
        f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}, timeout=60
    )
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text


def _capped(body: dict) -> dict:
    """A valid body with at most 2 new tokens per prompt (the fuzz is about parsing, not generating)."""
    params = body.get("sampling_params")
    cap = lambda p: {**(p or {}), "max_new_tokens": 2}  # noqa: E731
    return {**body, "sampling_params": [cap(p) for p in params] if isinstance(params, list) else cap(params)}


@fuzz(20)
@given(generate_bodies.map(as_bytes) | raw_bodies)
@example(as_bytes({"input_ids": [1], "sampling_params": {"sampling_seed": 2**70}}))
@example(as_bytes({"input_ids": [1], "sampling_params": {"stop": ["\udc80"]}}))
@example(as_bytes({"input_ids": [1], "rid": "\ud800"}))
@example(as_bytes({"text": "\ud800"}))
@example(b"[" * 100_000)
def test_generate_bodies_over_http_are_answered_200_or_400_and_the_engine_keeps_serving(engine_urls, tokenizer, raw):
    url = engine_urls[0]  # shared: only /generate goes there, which changes nothing on it
    info = httpx.get(f"{url}/model_info", timeout=10).json()
    before = _server_error(url)

    def parse(body: bytes) -> GenerateCall:
        return parse_generate(
            decode_body(body),
            vocab_size=info["vocab_size"],
            context_len=info["max_context_tokens"],
            encode=lambda t: tokenizer.encode(t, add_special_tokens=False),
        )

    try:
        call = parse(raw)
    except RequestError as e:
        r = httpx.post(f"{url}/generate", content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert (r.status_code, r.json()) == (400, {"error": {"message": str(e)}})
    else:
        raw = as_bytes(_capped(decode_body(raw)))
        call = parse(raw)
        r = httpx.post(f"{url}/generate", content=raw, headers={"content-type": "application/json"}, timeout=60)
        if any(inp.lora_path for inp in call.inputs):  # this engine holds no LoRA adapter: refused by field
            assert r.status_code == 400 and r.json()["error"]["message"].startswith("lora_path"), r.text
            return
        assert r.status_code == 200, r.text
        if call.stream:
            assert r.text.endswith("data: [DONE]\n\n")
        else:
            out = r.json() if call.batched else [r.json()]
            assert len(out) == len(call.inputs) and all(len(o["output_ids"]) <= 2 for o in out)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert _server_error(url) == before  # no forward step failed


RESTORE = {"/pause_generation": ["/continue_generation"], "/begin_weight_update": ["/end_weight_update"]}


def _would_block(path: str, fields: dict) -> bool:
    """A well-formed group init waits (minutes) for a trainer that never comes: not sent."""
    from agentrl.engine.weights import check_group_args

    if path != "/init_weights_update_group":
        return False
    try:
        check_group_args(fields["master_port"], fields["rank_offset"], fields["world_size"])
    except ValueError:
        return False
    return True


@fuzz(20)
@given(control_bodies())
@example(("/update_weight_version", {"new_version": "\ud800"}))  # every later response failed to encode
@example(
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 10**30, "rank_offset": 0, "world_size": 1, "backend": "gloo"},
    )
)  # torch's TypeError, no field named
@example(
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 3, "world_size": 2, "backend": "gloo"},
    )
)  # would have waited 600 s
@example(("/pause_generation", {"mode": "retract"}))
@example(("/begin_weight_update", {}))
@example(("/end_weight_update", {"\ud800": None}))  # this route did not read its body: accepted
def test_control_bodies_over_http_are_answered_200_or_400_and_the_engine_keeps_serving(own_engine, case):
    path, body = case
    raw = as_bytes(body)
    try:
        expected = None
        fields = parse_control(path, decode_body(raw))
    except RequestError as e:
        expected = str(e)
    else:
        assume(not _would_block(path, fields))
    r = httpx.post(f"{own_engine}{path}", content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code in (200, 400), r.text
    if expected is not None:
        assert (r.status_code, r.json()["message"]) == (400, expected)
    elif r.status_code == 400:  # the LoRA routes answer with SGLang's error_message
        assert r.json()["success"] is False and (r.json().get("message") or r.json().get("error_message"))
    if path == "/init_weights_update_group" and r.status_code == 400:
        assert any(
            name in r.json()["message"]
            for name in (
                "master_port",
                "rank_offset",
                "world_size",
                "backend",
                "master_address",
                "group_name",
                "lone surrogate",
            )
        )
    for undo in RESTORE.get(path, []):  # out of any weight-update session, generating
        httpx.post(f"{own_engine}{undo}", timeout=10)
    _check_serving(own_engine)
    assert _server_error(own_engine) is None


def test_the_shared_engines_serve_after_the_fuzz(engine_urls):
    for url in engine_urls:
        _check_serving(url)
        assert httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"] == "0"
