"""Token-in/token-out bookkeeping with the tiny model's (prefix-stable) template: tokens always
decode to the chat-template rendering of the messages, and masked-in tokens are exactly the
model's. The codec's own checks also run with Qwen3's real tokenizer (tests/_real_tokenizer.py). The
templates real models ship (history-rewriting Qwen3 included) are in test_chat_templates.py."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.episode.chat import TokenChat, codec_for
from tests._chat_templates import family_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
START = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tokenizer():
    from agentrl.models.builder import build_tokenizer

    return build_tokenizer(512, seed=0)


@pytest.fixture(scope="module", params=["tiny", "qwen3_real"])
def any_tokenizer(request, tokenizer):
    """The tiny tokenizer, then Qwen3's own vocabulary and template, for the checks any template passes."""
    return tokenizer if request.param == "tiny" else family_tokenizer("qwen3_real")


def check(chat: TokenChat, generation_prompt: bool) -> None:
    codec = chat.codec
    rendered = codec.render(chat.messages, chat.tools, add_generation_prompt=generation_prompt)
    assert codec.decode(chat.tokens) == rendered
    assert chat.text == rendered
    assert len(chat.tokens) == len(chat.loss_mask) == len(chat.logprobs) == len(chat.versions)


def test_codec_matches_transformers(any_tokenizer):
    tokenizer = any_tokenizer
    codec = codec_for(tokenizer)
    assert codec._fast is not None  # the compiled-template path is in use, and renders as transformers does
    chat = START + [
        {"role": "assistant", "content": "<tool_call>x</tool_call>"},
        {"role": "tool", "content": "1"},
        {"role": "tool", "name": "add", "content": "2"},
        {"role": "user", "content": "ok"},
    ]
    for tools in (None, TOOLS):
        for gen in (True, False):
            assert codec.render(chat, tools, gen) == tokenizer.apply_chat_template(
                chat, tools=tools, add_generation_prompt=gen, tokenize=False
            )
    assert codec_for(tokenizer) is codec
    for text in [
        "plain",
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        'émoji 🙂 and <tool_call>{"a": 1}</tool_call>',
        "<|endoftext|><|im_end|>",
        "",
    ]:
        assert codec.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    ids = list(range(len(tokenizer)))
    assert codec.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert codec.assistant_suffix == "<|im_end|>\n"
    assert codec.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert codec.reserve_tokens == 2


def test_prompt_is_apply_chat_template(any_tokenizer):
    tokenizer = any_tokenizer
    chat = TokenChat.start(codec_for(tokenizer), START, TOOLS)
    assert chat.tokens == tokenizer.apply_chat_template(
        START, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert set(chat.loss_mask) == {0} and set(chat.versions) == {-1}
    check(chat, True)


def test_scripted_turns_keep_the_invariant(tokenizer):
    codec = codec_for(tokenizer)
    chat = TokenChat.start(codec, START, TOOLS)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    ids = codec.encode(call) + [codec.end_of_turn_id]
    chat.append_model(ids, [-0.5] * len(ids), [3] * len(ids))
    assert chat.turn_content() == call
    assert chat.close_turn_and_add([{"role": "tool", "name": "add", "content": "5"}])
    check(chat, True)
    assert chat.messages[-2] == {"role": "assistant", "content": call}
    # a model turn that hits the length limit: the template's closing is appended as non-model text
    cut = codec.encode("The answer is")
    chat.append_model(cut, [-0.1] * len(cut), [4] * len(cut))
    assert chat.close_turn_and_add([{"role": "user", "content": "Go on."}])
    check(chat, True)
    answer = codec.encode("5.") + [codec.end_of_turn_id]
    chat.append_model(answer, [-0.2] * len(answer), [4] * len(answer))
    assert chat.close_turn_and_add([])
    check(chat, False)
    model = [t for t, m in zip(chat.tokens, chat.loss_mask) if m]
    assert model == ids + cut + answer
    assert [v for v, m in zip(chat.versions, chat.loss_mask) if m] == [3] * len(ids) + [4] * (len(cut) + len(answer))
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(chat.versions, chat.logprobs, chat.loss_mask) if not m)


def test_observation_that_does_not_fit_is_left_out(tokenizer):
    codec = codec_for(tokenizer)
    chat = TokenChat.start(codec, START, TOOLS)
    ids = codec.encode("hi") + [codec.end_of_turn_id]
    chat.append_model(ids, [0.0] * len(ids), [0] * len(ids))
    fits = chat.close_turn_and_add([{"role": "tool", "content": "x" * 500}], max_len=len(chat) + 20)
    assert not fits
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant"]
    check(chat, False)


texts = st.lists(
    st.sampled_from(
        list('ab 7\n{}"é🙂') + ["<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>", "<tool_response>"]
    ),
    max_size=12,
).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_model_tokens_keep_the_invariant(tokenizer, data):
    """Any token ids at all (special tokens, half UTF-8 characters...) as model output."""
    codec = codec_for(tokenizer)
    chat = TokenChat.start(codec, START, TOOLS if data.draw(st.booleans()) else None)
    model: list[int] = []
    for turn in range(data.draw(st.integers(1, 4))):
        ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=12))
        if data.draw(st.booleans()):
            ids = ids + [codec.end_of_turn_id]
        chat.append_model(ids, [-1.0] * len(ids), [turn] * len(ids))
        model += ids
        kind = data.draw(st.sampled_from(["tool", "user", "end"]))
        if kind == "end":
            chat.close_turn_and_add([])
            check(chat, False)
            break
        if kind == "tool":
            new = [{"role": "tool", "content": data.draw(texts)} for _ in range(data.draw(st.integers(1, 3)))]
        else:
            new = [{"role": "user", "content": data.draw(texts)}]
        chat.close_turn_and_add(new)
        check(chat, True)
    assert [t for t, m in zip(chat.tokens, chat.loss_mask) if m] == model
