"""Token-in/token-out with the chat templates real models ship (tests/data/chat_templates):
Qwen2.5, Qwen3 (thinking; its template drops earlier reasoning from history), Llama 3.1 and 3.2
(``ipython`` tool results, JSON tool calls, ``<|eot_id|>``).

For each: the tokens decode to the chat, masked-in tokens are exactly the model's, the non-model
text is the template's text for those messages (written out here from the families' documented
formats), the text equals a full rendering where the template is prefix-stable, the agent loop
produces such episodes over HTTP (every request is a prefix of the trajectory), and SFT tokenizes
the episode's messages into the very same tokens and mask.
"""

from __future__ import annotations

import json

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.envs.base import Task
from agentrl.episode.chat import ChatCodec, TemplateMismatch, TokenChat, codec_for
from agentrl.episode.rollout import run_episode, toolbox_for
from agentrl.episode.turn import EpisodeLimits
from agentrl.learner.sft import tokenize_conversation
from agentrl.tools.parsing import get_parser
from tests._actors_helpers import HttpEngineClient, Reply, ScriptedEngine
from tests._actors_user_env import AddEnv
from tests._chat_templates import REAL_FAMILIES, family_tokenizer

FAMILIES = ["qwen2_5", "qwen3", "qwen3_initial", "llama3_1", "llama3_2", *REAL_FAMILIES]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
START = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 2 + 3?"}]


def llama(family: str) -> bool:
    return family.startswith("llama")


def thinks(family: str) -> bool:
    return family.startswith("qwen3")


# ------------------------------------------------------------------ the families' formats, written out


def call_text(family: str, name: str, **arguments) -> str:
    """A tool call as the family's models write it."""
    if llama(family):
        return json.dumps({"name": name, "parameters": arguments})
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def think(family: str, reasoning: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n" if thinks(family) else ""


def closing(family: str) -> str:
    """What ends an assistant turn."""
    return "<|eot_id|>" if llama(family) else "<|im_end|>\n"


def after_tools(family: str, results: list[str]) -> str:
    """The template's text after an assistant turn's content: tool results, then the next header."""
    if llama(family):
        return (
            "<|eot_id|>"
            + "".join(f"<|start_header_id|>ipython<|end_header_id|>\n\n{json.dumps(r)}<|eot_id|>" for r in results)
            + "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    return (
        "<|im_end|>\n<|im_start|>user"
        + "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
        + "<|im_end|>\n<|im_start|>assistant\n"
    )


def after_user(family: str, text: str) -> str:
    if llama(family):
        return (
            f"<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{text}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    return f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def eot_text(family: str) -> str:
    return "<|eot_id|>" if llama(family) else "<|im_end|>"


# ------------------------------------------------------------------ helpers


def spans(tokens, mask) -> list[tuple[int, list[int]]]:
    """Runs of equal mask: [(mask, ids), ...]."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(tokens, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


def model_ids(codec: ChatCodec, text: str, stop: bool = True) -> list[int]:
    return codec.encode(text) + ([codec.end_of_turn_id] if stop else [])


def scripted_episode(family: str, cut: bool = True) -> tuple[TokenChat, list[list[int]], list[str]]:
    """A tool call, (a turn cut by the length limit, a user reply,) an answer; returns the chat, each
    turn's model ids and the expected non-model texts."""
    codec = codec_for(family_tokenizer(family))
    chat = TokenChat.start(codec, START, TOOLS)
    turns: list[list[int]] = []
    expected = [
        family_tokenizer(family).apply_chat_template(START, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    ]

    def turn(ids: list[int]) -> None:
        chat.append_model(ids, [-0.5] * len(ids), [len(turns)] * len(ids))
        turns.append(ids)

    turn(model_ids(codec, think(family, "I add with the tool.") + call_text(family, "add", a=2, b=3)))
    assert chat.close_turn_and_add([{"role": "tool", "name": "add", "content": "5"}])
    expected.append(after_tools(family, ["5"])[len(eot_text(family)) :])
    if cut:
        turn(model_ids(codec, think(family, "The tool says 5.") + "The answer", stop=False))
        assert chat.close_turn_and_add([{"role": "user", "content": "Go on."}])
        expected.append(after_user(family, "Go on."))
    turn(model_ids(codec, think(family, "Say it.") + "The answer is 5."))
    assert chat.close_turn_and_add([])
    expected.append(closing(family)[len(eot_text(family)) :])
    return chat, turns, [e for e in expected if e]


# ------------------------------------------------------------------ the real vocabulary


def test_the_real_tokenizer_is_qwen3s():
    """tests/_real_tokenizer.py: Qwen3's tokenizer.json, checksummed; ids as Alibaba's qwen.tiktoken gives them."""
    from tests._real_tokenizer import REGULAR_TOKENS, package_file

    tok = family_tokenizer("qwen3_real")
    assert len(tok) == REGULAR_TOKENS + 26
    for text, ids in [
        ("Hello world", [9707, 1879]),
        ("The answer is 5.\n\n", [785, 4226, 374, 220, 20, 382]),
        ("你好，世界！", [108386, 3837, 99489, 6313]),
        ('émoji 🙂 {"a": 1}', [963, 6355, 7754, 27484, 5212, 64, 788, 220, 16, 92]),
    ]:
        assert tok.encode(text, add_special_tokens=False) == ids
    control = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657}
    control |= {"</tool_call>": 151658, "<tool_response>": 151665, "</tool_response>": 151666}
    control |= {"<think>": 151667, "</think>": 151668}
    assert {t: tok.convert_tokens_to_ids(t) for t in control} == control
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>"} <= set(tok.all_special_tokens)
    assert not {"<tool_call>", "<tool_response>", "<think>"} & set(tok.all_special_tokens)
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    shipped = json.loads(package_file("tokenizer_config.json").read_text())["chat_template"]
    assert shipped == family_tokenizer("qwen3_initial_real").chat_template  # the template it was released with
    assert family_tokenizer("qwen3_real").chat_template != shipped


# ------------------------------------------------------------------ the codec


@pytest.mark.parametrize("family", FAMILIES)
def test_codec_reads_the_template(family):
    tok = family_tokenizer(family)
    codec = codec_for(tok)
    assert codec._fast is not None  # the compiled template renders as apply_chat_template does
    chat = START + [
        {"role": "assistant", "content": call_text(family, "add", a=1, b=2)},
        {"role": "tool", "content": "3"},
        {"role": "user", "content": "ok"},
    ]
    for tools in (None, TOOLS):
        for gen in (True, False):
            assert codec.render(chat, tools, gen) == tok.apply_chat_template(
                chat, tools=tools, add_generation_prompt=gen, tokenize=False
            )
    assert codec.assistant_suffix == closing(family)
    assert codec.end_of_turn_id == tok.convert_tokens_to_ids(eot_text(family)) == tok.eos_token_id
    assert codec.end_of_turn_text == eot_text(family)
    assert codec.reserve_tokens == len(codec.encode(closing(family)))


@pytest.mark.parametrize("family", FAMILIES)
def test_suffix_is_the_templates_text_for_the_new_messages(family):
    codec = codec_for(family_tokenizer(family))
    two = [{"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "add", "content": "7"}]
    for tools in (None, TOOLS):  # the system/tools preamble is never part of it
        assert codec.suffix(two, tools, True) == after_tools(family, ["5", "7"])
        assert codec.suffix([{"role": "user", "content": "Go on."}], tools, True) == after_user(family, "Go on.")
        assert codec.suffix([], tools, False) == closing(family)
    assert codec.context_after_turn(True, two[:1], TOOLS, True) == after_tools(family, ["5"])[len(eot_text(family)) :]
    assert codec.context_after_turn(False, [], TOOLS, False) == closing(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_assistant_text_is_what_the_model_generates(family):
    codec = codec_for(family_tokenizer(family))
    raw = think(family, "Add.") + call_text(family, "add", a=2, b=3)
    assert codec.assistant_text({"role": "assistant", "content": raw}, TOOLS) == raw + eot_text(family)
    structured = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
    }
    if thinks(family):
        structured["reasoning_content"] = "Add."
    assert codec.assistant_text(structured, TOOLS) == raw + eot_text(family)
    if thinks(family):  # Qwen3 writes an empty reasoning block before an answer that has none
        assert codec.assistant_text({"role": "assistant", "content": "5"}, None) == "<think>\n\n</think>\n\n5<|im_end|>"


# ------------------------------------------------------------------ episodes


@pytest.mark.parametrize("family", FAMILIES)
def test_episode_is_token_exact(family):
    chat, turns, expected = scripted_episode(family)
    codec = chat.codec
    assert codec.decode(chat.tokens) == chat.text
    assert len(chat.tokens) == len(chat.loss_mask) == len(chat.logprobs) == len(chat.versions)
    runs = spans(chat.tokens, chat.loss_mask)
    assert [ids for m, ids in runs if m] == turns  # the model's ids, turn by turn, untouched
    assert [codec.decode(ids) for m, ids in runs if not m] == expected  # the template's text for the rest
    assert [v for v, m in zip(chat.versions, chat.loss_mask) if m] == [i for i, t in enumerate(turns) for _ in t]
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(chat.versions, chat.logprobs, chat.loss_mask) if not m)
    assert [m["role"] for m in chat.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assert chat.messages[2]["content"] == think(family, "I add with the tool.") + call_text(family, "add", a=2, b=3)
    full = family_tokenizer(family).apply_chat_template(chat.messages, tools=TOOLS, tokenize=False)
    if thinks(family):
        # the user's reply starts a new query: a full rendering drops the earlier reasoning, which the
        # model saw and generated, and which the tokens keep
        assert full != chat.text and "I add with the tool." in chat.text and "I add with the tool." not in full
        assert full.endswith("<think>\nSay it.\n</think>\n\nThe answer is 5.<|im_end|>\n")
    else:
        assert full == chat.text  # prefix-stable: the same as rendering the whole chat


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_stable_chats_equal_the_full_rendering(family):
    """One query with tool calls (Qwen3 keeps reasoning after the last user query): every step's
    text is the full rendering, with the generation prompt while the chat waits for the model."""
    tok = family_tokenizer(family)
    codec = codec_for(tok)
    chat = TokenChat.start(codec, START, TOOLS)
    for n, (reasoning, text, obs) in enumerate(
        [
            ("Add 2 and 3.", call_text(family, "add", a=2, b=3), [{"role": "tool", "name": "add", "content": "5"}]),
            ("Add 5 and 1.", call_text(family, "add", a=5, b=1), [{"role": "tool", "name": "add", "content": "6"}]),
            ("Done.", "The answer is 6.", []),
        ]
    ):
        ids = model_ids(codec, think(family, reasoning) + text)
        chat.append_model(ids, [0.0] * len(ids), [n] * len(ids))
        chat.close_turn_and_add(obs)
        assert (
            chat.text
            == codec.decode(chat.tokens)
            == tok.apply_chat_template(chat.messages, tools=TOOLS, add_generation_prompt=bool(obs), tokenize=False)
        )


texts = st.lists(
    st.sampled_from(
        list('ab 7\n{}"é🙂')
        + [
            "<tool_call>",
            "</tool_call>",
            "<|im_end|>",
            "<|im_start|>",
            "<tool_response>",
            "<think>",
            "</think>",
            "<|eot_id|>",
            "<|start_header_id|>",
            "<|python_tag|>",
        ]
    ),
    max_size=12,
).map("".join)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_model_tokens_keep_the_invariant(family, data):
    """Any token ids at all as model output, any text as observations."""
    tok = family_tokenizer(family)
    codec = codec_for(tok)
    tools = TOOLS if data.draw(st.booleans()) else None
    chat = TokenChat.start(codec, START, tools)
    model: list[int] = []
    for turn in range(data.draw(st.integers(1, 4))):
        ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=12))
        if data.draw(st.booleans()):
            ids = ids + [codec.end_of_turn_id]
        chat.append_model(ids, [-1.0] * len(ids), [turn] * len(ids))
        model += ids
        kind = data.draw(st.sampled_from(["tool", "user", "end"]))
        new = (
            []
            if kind == "end"
            else [{"role": "tool", "content": data.draw(texts)} for _ in range(data.draw(st.integers(1, 3)))]
            if kind == "tool"
            else [{"role": "user", "content": data.draw(texts)}]
        )
        chat.close_turn_and_add(new)
        assert codec.decode(chat.tokens) == chat.text
        assert chat.text.endswith(codec.suffix(new, tools, bool(new))[len(codec.end_of_turn_text) :])
        if family == "qwen2_5":  # renders content verbatim: prefix-stable for any text
            assert chat.text == tok.apply_chat_template(
                chat.messages, tools=tools, add_generation_prompt=bool(new), tokenize=False
            )
        if not new:
            break
    assert [t for t, m in zip(chat.tokens, chat.loss_mask) if m] == model


def test_a_template_that_drops_assistant_content_is_refused():
    class Dropper(ChatCodec):  # renders no assistant message but the last: nothing marks where a turn ends
        def render(self, messages, tools, add_generation_prompt, plain=None):
            kept = [m for i, m in enumerate(messages) if m["role"] != "assistant" or i == len(messages) - 1]
            return super().render(kept, tools, add_generation_prompt, plain)

    codec = Dropper(family_tokenizer("qwen2_5"))
    with pytest.raises(TemplateMismatch, match="does not render an assistant message's content verbatim"):
        codec.suffix([{"role": "user", "content": "more"}], None, True)


# ------------------------------------------------------------------ SFT


def structured(messages: list[dict], family: str) -> list[dict]:
    """The same conversation the OpenAI way: tool calls as ``tool_calls``, Qwen3's reasoning as
    ``reasoning_content``."""
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant":
            content = m["content"]
            if thinks(family):
                reasoning, content = content.removeprefix("<think>\n").split("\n</think>\n\n", 1)
                m["reasoning_content"] = reasoning
            if llama(family) and content.startswith("{"):
                call = json.loads(content)
                m["tool_calls"] = [
                    {"type": "function", "function": {"name": call["name"], "arguments": call["parameters"]}}
                ]
                content = ""
            elif "<tool_call>" in content:
                call = json.loads(content.split("<tool_call>\n")[1].split("\n</tool_call>")[0])
                m["tool_calls"] = [{"type": "function", "function": call}]
                content = ""
            m["content"] = content
        out.append(m)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_tokenizes_as_the_actor(family):
    chat, _, _ = scripted_episode(family, cut=False)
    tok = family_tokenizer(family)
    for messages in (chat.messages, structured(chat.messages, family)):
        sample = tokenize_conversation(tok, messages, TOOLS)
        assert sample.tokens.tolist() == chat.tokens
        assert sample.loss_mask.tolist() == list(chat.loss_mask)
    masked = [codec_for(tok).decode(ids) for m, ids in spans(sample.tokens.tolist(), sample.loss_mask.tolist()) if m]
    assert masked == [m["content"] + eot_text(family) for m in chat.messages if m["role"] == "assistant"]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_real"])
def test_sft_keeps_each_qwen3_turns_reasoning_across_queries(family):
    """Two user queries: a full rendering drops the first answer's reasoning; SFT trains on it."""
    tok = family_tokenizer(family)
    messages = START + [
        {"role": "assistant", "content": "<think>\nFirst thought.\n</think>\n\n5"},
        {"role": "user", "content": "And 5 + 5?"},
        {"role": "assistant", "content": "10", "reasoning_content": "Second thought."},
    ]
    sample = tokenize_conversation(tok, messages)
    masked = [tok.decode(ids) for m, ids in spans(sample.tokens.tolist(), sample.loss_mask.tolist()) if m]
    assert masked == [
        "<think>\nFirst thought.\n</think>\n\n5<|im_end|>",
        "<think>\nSecond thought.\n</think>\n\n10<|im_end|>",
    ]
    assert "First thought." not in tok.apply_chat_template(messages, tokenize=False)


def test_sft_rejects_a_conversation_without_its_prompt():
    with pytest.raises(ValueError, match="starts with an assistant message"):
        tokenize_conversation(family_tokenizer("qwen3"), [{"role": "assistant", "content": "hi"}])


# ------------------------------------------------------------------ the agent loop over HTTP


class FollowUpEnv(AddEnv):
    """AddEnv whose user asks once more after the first answer."""

    def __init__(self, family: str):
        super().__init__()
        self.tool_parser = get_parser("llama3" if llama(family) else "hermes")

    async def on_text_turn(self, task, state, messages):
        if state.get("asked"):
            return None
        state["asked"] = True
        return "Are you sure?"


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3", "llama3_1", "llama3_2", "qwen3_real"])
def test_agent_loop_episode_is_token_exact(family):
    tok = family_tokenizer(family)
    codec = codec_for(tok)
    env = FollowUpEnv(family)
    task = Task(id="t", data={"a": 12, "b": 30})
    texts = [
        think(family, "Use the add tool.") + call_text(family, "add", a=12, b=30),
        think(family, "The tool says 42.") + "The answer is 42.",
        think(family, "Check: 12 + 30 = 42.") + "Yes, 42.",
    ]
    turns = [model_ids(codec, t) for t in texts]
    inputs: list[list[int]] = []

    def policy(ids: list[int], params: dict) -> Reply:
        assert params["stop_token_ids"] == [codec.end_of_turn_id]
        inputs.append(list(ids))
        return Reply(turns[len(inputs) - 1], "stop")

    async def main():
        async with HttpEngineClient([engine.url]) as client:
            return await run_episode(
                client,
                tok,
                env,
                toolbox_for(env),
                task,
                {"temperature": 1.0},
                EpisodeLimits(max_turns=4, max_total_tokens=4096, max_new_tokens_per_turn=200),
            )

    with ScriptedEngine(policy, version=3) as engine:
        traj = trio.run(main)
    md = traj.metadata
    assert (md["finish_reason"], traj.reward, md["num_tool_calls"], md["num_tool_errors"]) == ("answer", 1.0, 1, 0)
    tokens, mask = traj.tokens.tolist(), traj.loss_mask.tolist()
    assert [ids for m, ids in spans(tokens, mask) if m] == turns
    for request in inputs:  # the engine was given exactly the trajectory's tokens so far
        assert tokens[: len(request)] == request
    tools = toolbox_for(env).schemas()
    prompt = tok.apply_chat_template(md["messages"][:2], tools=tools, add_generation_prompt=True, tokenize=False)
    expected = [
        prompt,
        after_tools(family, ["42"])[len(eot_text(family)) :],
        after_user(family, "Are you sure?")[len(eot_text(family)) :],
        closing(family)[len(eot_text(family)) :],
    ]
    assert [codec.decode(ids) for m, ids in spans(tokens, mask) if not m] == [e for e in expected if e]
    assert [m["content"] for m in md["messages"] if m["role"] == "assistant"] == texts
    sample = tokenize_conversation(tok, md["messages"], tools)  # SFT on the episode: the same tokens
    assert sample.tokens.tolist() == tokens and sample.loss_mask.tolist() == mask


# ------------------------------------------------------------------ Llama 3 tool calls


def test_llama3_parser_reads_what_the_template_writes():
    parser = get_parser("llama3")
    codec = codec_for(family_tokenizer("llama3_1"))
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
    }
    written = codec.assistant_text(message, TOOLS).removesuffix("<|eot_id|>")
    turn = parser.parse(written)
    assert [(c.name, c.arguments, c.raw) for c in turn.calls] == [("add", {"a": 2, "b": 3}, written)]
    assert not turn.errors and not turn.truncated


@pytest.mark.parametrize(
    "text, calls, errors, truncated",
    [
        (
            '<|python_tag|>{"name": "add", "arguments": {"a": 1}}; {"name": "add", "parameters": {"b": 2}}<|eom_id|>',
            [("add", {"a": 1}), ("add", {"b": 2})],
            [],
            False,
        ),
        (' {"name": "add", "parameters": "{\\"a\\": 1}"}', [("add", {"a": 1})], [], False),
        ("The answer is {5}.", [], [], False),
        ('{"name": "add", "parameters": {"a": "1', [], ["cut off"], True),
        ('{"name": add}', [], ["not valid JSON"], False),
        ('{"parameters": {}}', [], ['no "name"'], False),
        ('{"name": "add", "parameters": [1]}', [], ["must be a JSON object"], False),
    ],
)
def test_llama3_parser(text, calls, errors, truncated):
    turn = get_parser("llama3").parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == calls
    assert len(turn.errors) == len(errors) and all(e in got for e, got in zip(errors, turn.errors))
    assert turn.truncated is truncated
