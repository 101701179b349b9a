"""The OpenAI wire format (agentrl/agents/openai_api.py) and the stitching rule (agentrl/agents/recording.py),
without engines: what is accepted, refused and how; messages for the template; tool calls out; how
calls become sequences. The endpoint over real engines and real clients is tests/test_agents_endpoint.py."""

from __future__ import annotations

import json

import pytest

from agentrl.agents.chat_service import ChoiceResult
from agentrl.agents.openai_api import (
    ALL_FIELDS,
    DEFAULT_ONLY_FIELDS,
    ChoiceOut,
    OpenAIRequestError,
    chat_completion_chunks,
    convert_message,
    message_view,
    parse_chat_request,
    split_reasoning,
    split_tool_calls,
)
from agentrl.agents.recording import Episode
from agentrl.episode.chat import ChatCodec
from agentrl.tools.parsing import HermesToolCallParser
from tests._actors_helpers import load_tokenizer, tiny_tokenizer_dir

USER = [{"role": "user", "content": "What is 2 + 3?"}]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> ChatCodec:
    return ChatCodec(load_tokenizer(tiny_tokenizer_dir(tmp_path_factory)))


def refused(body: dict) -> OpenAIRequestError:
    with pytest.raises(OpenAIRequestError) as info:
        parse_chat_request(body)
    return info.value


# ----------------------------------------------------------------------------- requests


def test_a_request_with_every_used_field_is_parsed_into_sglang_sampling_params():
    req = parse_chat_request(
        {
            "model": "gpt-4o",
            "messages": USER,
            "n": 3,
            "temperature": 0.7,
            "top_p": 0.9,
            "max_completion_tokens": 12,
            "max_tokens": 99,
            "stop": "END",
            "seed": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
            "tools": [ADD],
            "tool_choice": "auto",
            "logprobs": True,
            "top_k": 20,
            "min_p": 0.05,
            "user": "u1",
            "metadata": {"a": "b"},
            "store": False,
            "frequency_penalty": 0,
            "parallel_tool_calls": True,
            "response_format": {"type": "text"},
            "top_logprobs": 0,
        }
    )
    assert (req.model, req.n, req.max_tokens, req.seed, req.stream, req.include_usage, req.logprobs) == (
        "gpt-4o",
        3,
        12,
        5,
        True,
        True,
        True,
    )  # max_completion_tokens wins over the deprecated max_tokens
    assert req.sampling == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "stop": ["END"]}
    assert req.tools == [ADD] and req.tool_names == {"add"}
    assert parse_chat_request({"messages": USER, "max_tokens": 7}).max_tokens == 7


@pytest.mark.parametrize(
    "name,value",
    [
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
        ("logit_bias", {"5": 10}),
        ("top_logprobs", 3),
        ("parallel_tool_calls", False),
        ("response_format", {"type": "json_object"}),
        ("reasoning_effort", "low"),
        ("audio", {"voice": "x"}),
        ("modalities", ["text", "audio"]),
        ("functions", [{"name": "f"}]),
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "add"}}),
    ],
)
def test_an_unsupported_value_is_a_400_naming_the_field(name, value):
    err = refused({"messages": USER, "tools": [ADD], name: value})
    assert (err.status, err.param, err.code) == (400, name, "unsupported_parameter")
    assert f"'{name}'" in err.message
    assert err.body() == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": name,
            "code": "unsupported_parameter",
        }
    }


def test_unknown_fields_are_refused_with_openais_words():
    err = refused({"messages": USER, "regex": "a+", "frobnicate": 1})
    assert err.message == "Unrecognized request argument supplied: frobnicate, regex"
    assert err.param == "frobnicate"
    assert set(DEFAULT_ONLY_FIELDS) <= ALL_FIELDS


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be one of"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]},
            "messages[0].content[0] of type 'input_audio' is not supported",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments must be a JSON object",
        ),
        ({"messages": USER, "n": 0}, "'n' must be an integer >= 1"),
        ({"messages": USER, "temperature": 3}, "'temperature' must be a number in [0.0, 2.0]"),
        ({"messages": USER, "top_p": 0}, "'top_p' must be a number in (0.0, 1.0]"),
        ({"messages": USER, "max_tokens": 0}, "'max_tokens' must be an integer >= 1"),
        ({"messages": USER, "stop": [1]}, "'stop' must be a string or a list of strings"),
        ({"messages": USER, "seed": "7"}, "'seed' must be an integer"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "only allowed with stream: true"),
        ({"messages": USER, "tools": [{"type": "web_search"}]}, "tools[0] must be a function tool"),
        ({"messages": USER, "tool_choice": "sometimes"}, "'tool_choice' must be"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_malformed_requests_are_400s_that_say_what_is_wrong(body, needle):
    err = refused(body)
    assert err.status == 400 and needle in err.message, err.message


def test_messages_become_what_templates_take_and_views_ignore_server_made_ids():
    assistant = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    }
    out, view = convert_message(assistant, 1)
    assert out == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
        ],
    }
    renumbered = {
        **assistant,
        "tool_calls": [
            {
                **assistant["tool_calls"][0],
                "id": "call_XYZ",
                "function": {"name": "add", "arguments": '{"b": 3, "a": 2}'},
            }
        ],
    }
    assert message_view(renumbered) == view  # ids and key order do not matter
    assert message_view({**assistant, "content": "thinking"}) != view
    parts = {"role": "developer", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]}
    assert convert_message(parts, 0)[0] == {"role": "system", "content": "be brief"}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "5"}]}
    assert convert_message(tool, 2)[0] == {"role": "tool", "content": "5", "tool_call_id": "call_1"}


def test_tool_choice_none_hides_the_tools_from_the_template():
    assert parse_chat_request({"messages": USER, "tools": [ADD], "tool_choice": "none"}).tools is None
    assert parse_chat_request({"messages": USER, "tools": [ADD]}).tools == [ADD]


# ----------------------------------------------------------------------------- tool calls out


def test_tool_calls_are_parsed_as_sglang_does():
    parser = HermesToolCallParser()
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "mul", "arguments": {"a": 1}}\n</tool_call>'
    )
    content, calls = split_tool_calls(text, parser, {"add"})
    assert content == "Let me add."
    assert [(c["index"], c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "function", "add", {"a": 2, "b": 3})
    ]  # a tool the request did not declare is dropped
    assert calls[0]["id"].startswith("call_")
    assert split_tool_calls("no calls here", parser, {"add"}) == ("no calls here", [])
    broken = 'x <tool_call>{"name": "add", "arguments": {"a": </tool_call>'
    assert split_tool_calls(broken, parser, {"add"}) == ("x", [])


def test_reasoning_is_split_as_sglangs_reasoning_parser_does_and_left_out_of_views():
    assert split_reasoning("<think>\nadd 2 and 3\n</think>\n\nIt is 5.") == ("add 2 and 3", "It is 5.")
    assert split_reasoning("add them</think>\n\nIt is 5.") == ("add them", "It is 5.")  # the template opened it
    assert split_reasoning("<think>still thinking") == ("still thinking", "")
    assert split_reasoning("no reasoning") == (None, "no reasoning")
    with_reasoning = {"role": "assistant", "content": "It is 5.", "reasoning_content": "add them"}
    assert convert_message(with_reasoning, 0)[0]["reasoning_content"] == "add them"  # templates may render it
    assert message_view(with_reasoning) == message_view({"role": "assistant", "content": "It is 5."})


def test_stream_chunks_carry_role_content_calls_finish_and_usage_in_order():
    call = {"id": "call_1", "index": 0, "type": "function", "function": {"name": "add", "arguments": "{}"}}
    choices = [ChoiceOut("hi", [call], "tool_calls"), ChoiceOut("", None, "length")]
    chunks = chat_completion_chunks(
        "chatcmpl-1", "m", choices, {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    )
    deltas = [
        (c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
        for c in chunks
        if c["choices"]
    ]
    assert deltas == [
        (0, {"role": "assistant", "content": ""}, None),
        (0, {"content": "hi"}, None),
        (0, {"tool_calls": [call]}, None),
        (0, {}, "tool_calls"),
        (1, {"role": "assistant", "content": ""}, None),
        (1, {}, "length"),
    ]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 3
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["id"] for c in chunks} == {"chatcmpl-1"}


# ----------------------------------------------------------------------------- stitching


def generate(codec: ChatCodec, plan, texts: list[str], version: int = 0) -> None:
    """Play the engine for a planned call: choice i says texts[i] and stops on <|im_end|>."""
    plan.results = []
    for chat, text in zip(plan.chats, texts):
        prompt_len = len(chat)
        ids = codec.encode(text) + [codec.end_of_turn_id]
        chat.append_model(ids, [-0.5] * len(ids), [version] * len(ids))
        r = ChoiceResult(
            chat=chat, finish={"type": "stop", "matched": ids[-1]}, prompt_len=prompt_len, num_generate_calls=1
        )
        content, calls = split_tool_calls(text, HermesToolCallParser(), plan.request.tool_names)
        r.out = ChoiceOut(content, calls or None, "tool_calls" if calls else "stop")
        plan.results.append(r)


def call(episode: Episode, codec: ChatCodec, messages: list[dict], texts: list[str], **extra) -> list[dict]:
    plan = episode.plan(parse_chat_request({"messages": messages, **extra}), codec)
    generate(codec, plan, texts)
    episode.commit(plan)
    return [r.out.message() for r in plan.results]


def assistant_as_sent(message: dict) -> dict:
    """What an OpenAI client sends back: the reply's fields, the content null when empty."""
    out = {"role": "assistant", "content": message["content"] or None}
    if message.get("tool_calls"):
        out["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in message["tool_calls"]]
    return out


def test_a_tool_round_trip_is_one_sequence_whose_tokens_are_the_templates_rendering(codec):
    ep = Episode("ep")
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    [reply] = call(ep, codec, USER, [call_text], tools=[ADD])
    assert reply["content"] == "" and reply["tool_calls"][0]["function"]["name"] == "add"
    second = USER + [
        assistant_as_sent(reply),
        {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "5"},
    ]
    call(ep, codec, second, ["The answer is 5."], tools=[ADD])
    assert len(ep.sequences) == 1 and ep.num_stitched == 1
    [traj] = ep.trajectories(1.0, metadata={"env": "e"})
    tok = codec.tokenizer
    raw = USER + [
        {"role": "assistant", "content": call_text},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "The answer is 5."},
    ]
    assert codec.decode(list(traj.tokens)) == tok.apply_chat_template(raw, tools=[ADD], tokenize=False)
    prompt = tok.apply_chat_template(USER, tools=[ADD], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(traj.tokens[: len(prompt)]) == list(prompt)
    model = [codec.decode([int(t)]) for t, m in zip(traj.tokens, traj.loss_mask) if m]
    assert "".join(model) == call_text + "<|im_end|>" + "The answer is 5.<|im_end|>"
    assert set(traj.behavior_logprobs[traj.loss_mask == 1]) == {-0.5}
    assert set(traj.weight_versions[traj.loss_mask == 0]) == {-1}
    md = traj.metadata
    assert (md["num_calls"], md["episode_num_calls"], md["num_sequences"], md["new_sequence_reason"], md["env"]) == (
        2,
        2,
        1,
        "first_call",
        "e",
    )
    assert md["call_finish_reasons"] == ["tool_calls", "stop"]
    spans = [(int(a), int(b)) for a, b in md["call_spans"]]  # each call's completion, where the mask says
    assert spans[0][0] == len(prompt) and all(traj.loss_mask[a:b].all() for a, b in spans)
    assert sum(b - a for a, b in spans) == int(traj.loss_mask.sum())


def test_an_edited_reply_a_rewritten_history_or_new_tools_start_new_sequences(codec):
    ep = Episode("ep")
    [reply] = call(ep, codec, USER, ["It is 5."], tools=[ADD])
    follow = {"role": "user", "content": "Sure?"}
    call(ep, codec, USER + [{"role": "assistant", "content": "It is five."}, follow], ["Yes."], tools=[ADD])
    call(ep, codec, [{"role": "system", "content": "Summary: 5."}, follow], ["Yes."], tools=[ADD])
    call(ep, codec, USER + [assistant_as_sent(reply), follow], ["Yes."])  # same history, no tools
    call(ep, codec, USER + [assistant_as_sent(reply), follow], ["Yes!"], tools=[ADD])  # the real extension
    assert [s.reason for s in ep.sequences] == ["first_call", "reply_edited", "history_differs", "tools_differ"]
    assert [s.num_calls for s in ep.sequences] == [2, 1, 1, 1]
    trajs = ep.trajectories(0.5)
    assert [t.metadata["sequence_index"] for t in trajs] == [0, 1, 2, 3]
    assert all(t.reward == 0.5 and t.metadata["num_sequences"] == 4 for t in trajs)


def test_n_choices_branch_and_a_later_call_extends_the_branch_it_continues(codec):
    ep = Episode("ep")
    replies = call(ep, codec, USER, ["A.", "B.", "C."], n=3)
    assert [s.reason for s in ep.sequences] == ["first_call", "branch", "branch"]
    more = {"role": "user", "content": "And?"}
    call(ep, codec, USER + [assistant_as_sent(replies[2]), more], ["D."])
    assert [s.num_calls for s in ep.sequences] == [1, 1, 2]
    trajs = ep.trajectories(1.0)
    first_prompt = len(
        codec.tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    for t in trajs:  # every branch trains on its own completions only
        assert not t.loss_mask[:first_prompt].any()
    assert codec.decode(list(trajs[2].tokens[trajs[2].loss_mask == 1])) == "C.<|im_end|>D.<|im_end|>"


def test_two_calls_that_extend_the_same_sequence_concurrently_become_a_branch(codec):
    ep = Episode("ep")
    [reply] = call(ep, codec, USER, ["A."])
    a = ep.plan(
        parse_chat_request({"messages": USER + [assistant_as_sent(reply), {"role": "user", "content": "x"}]}), codec
    )
    b = ep.plan(
        parse_chat_request({"messages": USER + [assistant_as_sent(reply), {"role": "user", "content": "y"}]}), codec
    )
    generate(codec, a, ["X."])
    generate(codec, b, ["Y."])
    ep.commit(a)
    ep.commit(b)
    assert [(s.reason, s.num_calls) for s in ep.sequences] == [("first_call", 2), ("branch", 1)]
    branch = ep.trajectories(1.0)[1]
    assert codec.decode(list(branch.tokens[branch.loss_mask == 1])) == "Y.<|im_end|>"  # "A." is trained once


def test_a_closed_episode_refuses_plans_and_commits(codec):
    ep = Episode("ep")
    plan = ep.plan(parse_chat_request({"messages": USER}), codec)
    generate(codec, plan, ["late"])
    ep.closed = True
    for attempt in (lambda: ep.commit(plan), lambda: ep.plan(parse_chat_request({"messages": USER}), codec)):
        with pytest.raises(OpenAIRequestError) as info:
            attempt()
        assert info.value.status == 401
    assert ep.sequences == [] and ep.num_calls == 0


# ----------------------------------------------------------------------------- the templates real models ship


class TextEngine:
    """``generate`` answering each call with the next scripted text (+ the end-of-turn token); keeps the prompts."""

    def __init__(self, codec: ChatCodec, texts: list[str]):
        self.codec, self.texts, self.prompts = codec, list(texts), []

    async def generate(self, input_ids, params, *, affinity_key=None, rid=None):
        from agentrl.engine.client import GenerateResult

        self.prompts.append(list(input_ids))
        text = self.texts.pop(0)
        ids = self.codec.encode(text) + [self.codec.end_of_turn_id]
        return GenerateResult(
            output_ids=ids,
            output_logprobs=[-0.25] * len(ids),
            text=text,
            finish_reason={"type": "stop", "matched": ids[-1]},
            weight_version="3",
            prompt_tokens=len(input_ids),
            meta_info={},
        )


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3", "qwen3_initial", "llama3_1", "llama3_2"])
def test_real_templates_stitch_where_prefix_stable_and_a_rewritten_history_starts_a_sequence(family):
    """Through ChatService and an Episode with each family's shipped template: a tool round trip then a second user
    query. Qwen3's template drops the first query's <think> once a second query follows, so that call starts a new
    sequence of the episode (``template_not_prefix_stable``) whose prompt is the template's rendering of the
    messages; every other template stitches all three calls. Either way each sequence's text is the template's
    rendering of its messages and its model tokens are exactly what the engine returned."""
    import asyncio

    from agentrl.agents.chat_service import ChatService
    from agentrl.tools.parsing import get_parser
    from tests._chat_templates import family_tokenizer
    from tests.test_chat_templates import call_text, llama, think, thinks

    tok = family_tokenizer(family)
    codec = ChatCodec(tok)
    texts = [
        think(family, "I add 2 and 3.") + call_text(family, "add", a=2, b=3),
        think(family, "The tool says 5.") + "The answer is 5.",
        think(family, "Check.") + "Yes, 5.",
    ]
    engine = TextEngine(codec, texts)
    service = ChatService(codec, engine, "m", versioned=True)
    ep = Episode("ep", tool_parser=get_parser("llama3" if llama(family) else "hermes"), reasoning=thinks(family))
    start = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 2 + 3?"}]

    async def send(messages):
        plan = ep.plan(parse_chat_request({"messages": messages, "tools": [ADD]}), codec)
        await service.generate(plan)
        ep.commit(plan)
        return plan.results[0].out.message()

    async def agent():
        first = await send(start)
        assert first["reasoning_content"] == ("I add 2 and 3." if thinks(family) else None)
        [tool_call] = first["tool_calls"]  # parsed in the family's format
        assert json.loads(tool_call["function"]["arguments"]) == {"a": 2, "b": 3}
        history = start + [assistant_as_sent(first), {"role": "tool", "tool_call_id": tool_call["id"], "content": "5"}]
        second = await send(history)
        assert second["content"] == "The answer is 5."
        third = await send(history + [assistant_as_sent(second), {"role": "user", "content": "Sure?"}])
        assert third["content"] == "Yes, 5."
        return history + [assistant_as_sent(second), {"role": "user", "content": "Sure?"}]

    last_request = asyncio.run(agent())
    trajs = ep.trajectories(1.0)
    model_texts = [t + eot for t, eot in zip(texts, [codec.end_of_turn_text] * 3)]
    if thinks(family):
        assert [(s.reason, s.num_calls) for s in ep.sequences] == [("first_call", 2), ("template_not_prefix_stable", 1)]
        assert ep.num_stitched == 1 and dict(ep.new_sequence_reasons) == {
            "first_call": 1,
            "template_not_prefix_stable": 1,
        }
        as_templates_take = parse_chat_request({"messages": last_request, "tools": [ADD]}).messages
        rendered = tok.apply_chat_template(as_templates_take, tools=[ADD], add_generation_prompt=True, tokenize=False)
        assert "I add 2 and 3." not in rendered  # the template rewrote the history: the earlier reasoning is gone
        assert engine.prompts[2] == tok.apply_chat_template(
            as_templates_take, tools=[ADD], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert [t.metadata["new_sequence_reason"] for t in trajs] == ["first_call", "template_not_prefix_stable"]
        per_sequence = [model_texts[:2], model_texts[2:]]
    else:
        assert [(s.reason, s.num_calls) for s in ep.sequences] == [("first_call", 3)] and ep.num_stitched == 2
        per_sequence = [model_texts]
    for traj, expected in zip(trajs, per_sequence, strict=True):
        assert codec.decode(list(traj.tokens)) == tok.apply_chat_template(
            traj.metadata["messages"], tools=[ADD], tokenize=False
        )
        assert codec.decode([int(t) for t in traj.tokens[traj.loss_mask == 1]]) == "".join(expected)
        assert set(traj.weight_versions[traj.loss_mask == 1].tolist()) == {3}
        assert all(t.metadata["episode_id"] == "ep" and t.reward == 1.0 for t in trajs)
    for prompt in engine.prompts[:2]:  # the stitched calls' prompts are prefixes of the first sequence
        assert list(trajs[0].tokens[: len(prompt)]) == prompt
