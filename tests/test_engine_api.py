"""SGLang field semantics of the engine API: validation, defaults, finish reasons and text trimming."""

from __future__ import annotations

import pytest

from agentrl.engine.native_api import (
    TOP_K_ALL,
    Completion,
    GenerateInput,
    RequestError,
    build_response,
    output_text_ids,
    parse_generate,
    parse_sampling_params,
    trim_stop_str,
)

V, CTX = 576, 64


def test_defaults_follow_sglang():
    p = parse_sampling_params({}, V)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, TOP_K_ALL, 0.0)
    assert p.skip_special_tokens and not p.no_stop_trim and not p.ignore_eos and p.stop == ()
    nulls = parse_sampling_params({"temperature": None, "top_k": None, "stop": None, "stop_token_ids": None}, V)
    assert nulls == parse_sampling_params({}, V)  # null means "the default"
    assert parse_sampling_params({"max_new_tokens": None}, V).max_new_tokens is None  # up to the context


def test_greedy_is_top_k_1_at_temperature_1():
    p = parse_sampling_params({"temperature": 0.0, "top_k": 7}, V)
    assert p.greedy and p.temperature == 1.0 and p.top_k == 1


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"max_tokens": 3}, "unknown field 'max_tokens'"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [V]}, "outside"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"regex": "a+"}, "regex"),
    ],
)
def test_bad_sampling_params_name_the_field(params, needle):
    with pytest.raises(RequestError, match=needle):
        parse_sampling_params(params, V)


def test_unsupported_fields_are_accepted_at_their_defaults():
    p = parse_sampling_params({"n": 1, "frequency_penalty": 0.0, "json_schema": None, "min_new_tokens": 0}, V)
    assert p.max_new_tokens == 128


def test_batches_rids_and_per_prompt_values():
    call = parse_generate(
        {
            "input_ids": [[1, 2], [3]],
            "rid": "x",
            "return_logprob": [True, False],
            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
        },
        vocab_size=V,
        context_len=CTX,
    )
    assert call.batched and [i.rid for i in call.inputs] == ["x_0", "x_1"]
    assert [i.return_logprob for i in call.inputs] == [True, False]
    assert [i.params.max_new_tokens for i in call.inputs] == [1, 2]
    single = parse_generate(
        {"input_ids": [1, 2], "rid": "y", "sampling_params": {"max_new_tokens": 4}}, vocab_size=V, context_len=CTX
    )
    assert not single.batched and single.inputs[0].rid == "y"
    with pytest.raises(RequestError, match="2 entries for a batch of 3"):
        parse_generate({"input_ids": [[1], [2], [3]], "sampling_params": [{}, {}]}, vocab_size=V, context_len=CTX)


@pytest.mark.parametrize(
    "body, needle",
    [
        ({}, "exactly one"),
        ({"input_ids": []}, "input_ids is empty"),
        ({"input_ids": [[1], []]}, r"input_ids\[1\] is empty"),
        ({"input_ids": [1, "a"]}, "integers"),
        ({"input_ids": [1] * CTX}, "longer than the model's context length"),
        ({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": CTX - 10}}, "maximum context length of 64"),
        ({"input_ids": [1], "top_logprobs_num": 2}, "top_logprobs_num"),
        ({"input_ids": [1], "stream": "yes"}, "stream"),
        ({"input_ids": [1], "rid": 5}, "rid"),
        ({"text": "hello"}, "tokenizer"),
    ],
)
def test_bad_requests(body, needle):
    with pytest.raises(RequestError, match=needle):
        parse_generate(body, vocab_size=V, context_len=CTX)


def _completion(ids, reason):
    return Completion(
        rid="r",
        prompt_tokens=2,
        output_ids=ids,
        output_logprobs=[-1.0] * len(ids),
        finish_reason=reason,
        weight_version="4",
    )


def test_text_trimming_and_response_shape():
    p = parse_sampling_params({}, V)
    keep = parse_sampling_params({"no_stop_trim": True}, V)
    stop_tok = _completion([5, 6, 2], {"type": "stop", "matched": 2})
    assert output_text_ids(stop_tok, p) == [5, 6] and output_text_ids(stop_tok, keep) == [5, 6, 2]
    length = _completion([5, 6, 2], {"type": "length", "length": 3})
    assert output_text_ids(length, p) == [5, 6, 2]
    stop_str = _completion([5, 6], {"type": "stop", "matched": "##"})
    assert trim_stop_str("ab##cd", stop_str, p) == "ab" and trim_stop_str("ab##cd", stop_str, keep) == "ab##cd"

    inp = GenerateInput("r", [1, 2], p, return_logprob=True)
    body = build_response(stop_tok, inp, "text")
    meta = body["meta_info"]
    assert body["output_ids"] == [5, 6, 2] and body["text"] == "text"
    assert meta["output_token_logprobs"] == [[-1.0, 5, None], [-1.0, 6, None], [-1.0, 2, None]]
    assert (meta["id"], meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == ("r", 2, 3, "4")
    assert "output_token_logprobs" not in build_response(stop_tok, GenerateInput("r", [1], p), "t")["meta_info"]
