"""Fuzzing the border where model text becomes tool calls: the parser, the registry, the ToolBox.

Properties: any text the model writes parses into calls and/or ``Error: ...`` strings, never an
exception, and is scored as a final answer without one; every parsed call, run through a ToolBox of tools that trust their type hints,
gives a result whose failure (if any) is the model's (unknown tool, bad arguments), never a
crash of a tool and never an observation longer than the box's output limit; a well-formed
call rendered by the tiny model's chat template parses back to the same call.
"""

from __future__ import annotations

import enum
import json
from typing import Any, Literal

import pytest
import trio
from hypothesis import example, given
from hypothesis import strategies as st

from agentrl.envs.calculator import CalculatorEnv
from agentrl.envs.rewards import exact_match, final_assistant_text, last_number
from agentrl.tools.base import Tool, ToolBox, ToolCall, tool
from agentrl.tools.parsing import PARSERS, HermesToolCallParser, get_parser
from tests._fuzz import dumps, finite_values, fuzz, json_values, nested, texts

parser = HermesToolCallParser()


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@tool
def typed(
    text: str,
    count: int = 1,
    ratio: float = 0.5,
    flag: bool = False,
    tags: list[str] | None = None,
    mode: Literal["fast", "exact"] = "fast",
    color: Color = Color.RED,
    pair: tuple[int, int] = (0, 0),
    table: dict | None = None,
    extra: Any = None,
) -> str:
    """Use every argument the way its type hint promises."""
    return " ".join(
        [
            text.upper(),
            str(count + 1),
            str(ratio * 2 > 1),
            str(not flag),
            ",".join(t.lower() for t in tags or []),
            {"fast": "F", "exact": "E"}[mode],
            color.value,
            str(pair[0] + pair[1]),
            ",".join(sorted(table or {})),
            type(extra).__name__,
        ]
    )


@tool
def ping() -> str:
    """Answer pong."""
    return "pong"


class Echo(Tool):
    """Take any arguments (``**arguments``) and name them."""

    async def run(self, **arguments: Any) -> str:
        return ",".join(sorted(arguments))


class Counter(Tool):
    """A class tool with typed parameters and the episode state."""

    async def run(self, step: int, state: dict) -> str:
        state["total"] = state.get("total", 0) + step
        return str(state["total"])


BOX = ToolBox([typed, ping, Echo(), Counter()], max_output_chars=300)
NAMES = [t.name for t in BOX.tools]
PARAMS = ["text", "count", "ratio", "flag", "tags", "mode", "color", "pair", "table", "extra", "step", "state", "self"]


def _check_result(call: ToolCall) -> None:
    state: dict = {}
    result = trio.run(BOX.execute, call, state)
    assert isinstance(result.content, str) and result.name == call.name
    assert result.error_kind in ("", "unknown_tool", "bad_arguments"), result.content
    assert result.is_error == bool(result.error_kind)
    if result.is_error:
        assert result.content.startswith("Error: ")
    assert len(result.content) <= BOX.max_output_chars + 100, result.content[:200]


# ------------------------------------------------------------------------- model text


@st.composite
def calls_text(draw) -> str:
    """A ``<tool_call>`` block, well-formed or not: any name, any arguments, bits cut or added."""
    name = draw(st.sampled_from(NAMES) | texts | json_values)
    args = draw(st.dictionaries(st.sampled_from(PARAMS) | texts, json_values, max_size=4) | json_values)
    if draw(st.booleans()):
        args = dumps(args)  # arguments as a JSON string, as some models write them
    body = dumps({"name": name, "arguments": args})
    cut = draw(st.integers(0, len(body)))
    body = draw(st.sampled_from([body, body[:cut], body[cut:], body.replace(":", "", 1), body + body]))
    close = draw(st.sampled_from(["</tool_call>", "\n</tool_call>", "", "</tool_call"]))
    wrapper = draw(st.sampled_from(["<tool_call>\n{}" + close, "<|python_tag|>{}", "{};"]))  # Hermes, Llama 3
    return wrapper.format(body)


model_text = st.lists(texts | calls_text(), max_size=5).map("".join)


@fuzz(250)
@given(model_text)
@example("<tool_call>" + "[" * 100_000 + "</tool_call>")
@example('<tool_call>{"name": "typed", "arguments": {"text": "a", "count": ' + "9" * 5000 + "}}</tool_call>")
@example('<tool_call>{"name": "typed", "arguments": "' + "[" * 5000 + '"}</tool_call>')
@example('<tool_call>{"name": "typed", "arguments": {"text": "a", "ratio": NaN}}</tool_call>')
@example('<tool_call>{"name": "typed", "arguments": {"text": "a", "ratio": 1e999}}</tool_call>')
@example('<tool_call>{"name": "ping", "name": "typed", "arguments": {"text": "a"}}</tool_call>')
@example('<tool_call>{"name": "typed", "arguments": {"text": "a", "text": "b"}}</tool_call>')
@example('<tool_call>{"name": "typed", "arguments": {"text": "a", "tags": [1, 2]}}</tool_call>')
@example('<tool_call>{"name": "typed", "arguments": {"text": "a", "mode": "slow"}}</tool_call>')
@example('<tool_call>{"name": "typed", "arguments": {"text": "a", "color": "blue"}}</tool_call>')
@example('<tool_call>{"name": "typed", "arguments": {"text": "a", "pair": [1]}}</tool_call>')
@example('<tool_call>{"name": "ping", "arguments": {"x": 1}}</tool_call>')
@example('<tool_call>{"name": "echo", "arguments": {"self": 1}}</tool_call>')
@example('<tool_call>{"name": "counter", "arguments": {"step": 1, "state": {}}}</tool_call>')
@example('<tool_call>{"name": "' + "n" * 100_000 + '", "arguments": {}}</tool_call>')
@example(
    '<tool_call>{"name": "typed", "arguments": {' + ", ".join(f'"k{i}": 1' for i in range(5000)) + "}}</tool_call>"
)
@example("<tool_call>" + nested(900) + "</tool_call>")
@example("<|python_tag|>" + "[" * 100_000)  # the same for the formats without tags (Llama 3)
@example('{"name": "typed", "parameters": {"text": "a", "count": ' + "9" * 5000 + "}}")
@example('<|python_tag|>{"name": "typed", "parameters": {"text": "a", "ratio": NaN}}')
@example('{"name": "typed", "name": "ping", "parameters": {}}; {"name": "ping", "parameters": ' + nested(2000) + "}")
def test_any_model_text_gives_calls_or_readable_errors(text):
    for cls in set(PARSERS.values()):  # every registered format
        turn = cls().parse(text)
        assert all(isinstance(e, str) and e.startswith("Error: ") and len(e) < 400 for e in turn.errors)
        assert turn.truncated == any("cut off" in e for e in turn.errors)
        for call in turn.calls:
            assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)
            assert call.raw and call.raw in text
            _check_result(call)


@fuzz(200)
@given(
    st.sampled_from(NAMES) | texts,
    st.dictionaries(st.sampled_from(PARAMS) | texts, json_values, max_size=5) | json_values,
)
@example("typed", {"text": "a", "count": 10**4000})  # as long as JSON text may hold
@example("typed", {"text": "a", "ratio": float("nan")})
@example("typed", {"text": "a", "tags": ["x", 1]})
@example("typed", {"text": "a", "pair": [1, 2, 3]})
@example("echo", {"self": 1})
def test_any_arguments_reach_a_tool_only_when_they_fit_its_schema(name, arguments):
    """ToolCalls built in code (another parser, an OpenAI-style endpoint) take the same path."""
    _check_result(ToolCall(name, arguments))


def test_arguments_that_fit_reach_the_tool_as_its_hints_say():
    result = trio.run(BOX.execute, ToolCall("typed", {"text": "a", "color": "blue", "pair": [1, 2], "mode": "exact"}))
    assert result.content == "A 2 False True  E blue 3  NoneType" and not result.is_error  # Color.BLUE, (1, 2)
    for call, message in [
        (
            ToolCall("typed", {"text": "a", "mode": "slow"}),
            "argument 'mode' of typed must be one of 'fast', 'exact', got 'slow'",
        ),
        (
            ToolCall("typed", {"text": "a", "tags": ["x", 1]}),
            "argument 'tags' of typed must be an array of string items",
        ),
        (
            ToolCall("typed", {"text": "a", "pair": [1]}),
            "argument 'pair' of typed must be an array of 2 integer items, got [1]",
        ),
        (ToolCall("ping", {"x": 1}), "ping cannot take these arguments: got an unexpected keyword argument 'x'"),
        (ToolCall("echo", {"self": 1}), "echo cannot take these arguments: multiple values for argument 'self'"),
        (ToolCall("n" * 5000, {}), "unknown tool '" + "n" * 60 + "...'"),
    ]:
        result = trio.run(BOX.execute, call)
        assert result.error_kind == "unknown_tool" if "unknown" in message else "bad_arguments"
        assert message in result.content, result.content


# ----------------------------------------------------------------- chat template round trip

tool_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,15}", fullmatch=True)


@pytest.fixture(scope="module")
def tokenizer():
    """A transformers tokenizer with the tiny model's chat template (rendering needs no trained BPE)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from agentrl.models.builder import CHAT_TEMPLATE

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), chat_template=CHAT_TEMPLATE
    )


@fuzz(100)
@given(
    st.lists(st.tuples(tool_names, st.dictionaries(texts, finite_values, max_size=4)), min_size=1, max_size=3),
    st.sampled_from(["", "Let me compute.", "x </tool_call"]),
)
@example([("search", {"query": "</tool_call>"})], "")
@example([("search", {"query": "a\n</tool_call>\n<tool_call>"})], "")
def test_a_well_formed_call_round_trips_the_chat_template(tokenizer, calls, content):
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls],
        },
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assistant = rendered.split("<|im_start|>assistant\n", 1)[1]
    turn = parser.parse(assistant)
    assert turn.errors == []
    assert [(c.name, c.arguments) for c in turn.calls] == calls


# ------------------------------------------------------------------------------ registry

# Format names, and import paths that never name a module outside agentrl (no arbitrary imports).
parser_names = (
    texts.filter(lambda t: ":" not in t)
    | st.builds("agentrl.tools.parsing:{}".format, texts)
    | st.builds("{}:HermesToolCallParser".format, st.text(alphabet=". \x00", max_size=4))
    | st.sampled_from(["hermes", "qwen", "agentrl.tools.parsing:HermesToolCallParser"])
)


@fuzz(200)
@given(parser_names)
@example("..:X")  # a relative import: TypeError from importlib
@example("agentrl.tools.parsing:PARSERS")  # not callable
@example("agentrl.tools.parsing:ParsedTurn")  # no parse method
def test_the_parser_registry_gives_a_parser_or_a_value_error_naming_it(name):
    try:
        found = get_parser(name)
    except ValueError as e:
        assert repr(name) in str(e)
    else:
        assert found.parse("<tool_call>{}</tool_call>").errors


def test_strict_json_errors_name_the_problem():
    cases = {
        '{"name": "a", "arguments": {"x": NaN}}': "NaN is not a JSON number",
        '{"name": "a", "arguments": {"x": 1e999}}': "1e999 is too large for a JSON number",
        '{"name": "a", "name": "b"}': "the key 'name' appears twice",
        "[" * 100_000: "nested too deeply",
        '{"name": "a", "arguments": {"x": ' + "9" * 5000 + "}}": "a number has more than 4300 digits",
    }
    for body, message in cases.items():
        turn = parser.parse(f"<tool_call>{body}</tool_call>")
        assert turn.calls == [] and message in turn.errors[0], (body[:40], turn.errors)
    assert json.loads('{"x": NaN}')  # what Python alone would have accepted


# ---------------------------------------------------------------------- final answers

CALCULATOR = CalculatorEnv()
CALCULATOR_TASK = next(CALCULATOR.tasks("test"))
messages_lists = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool"]) | texts, "content": model_text | json_values},
        optional={"tool_calls": json_values},
    ),
    max_size=3,
)


@fuzz(100)
@given(model_text, messages_lists)
@example("The answer is " + "1" * 5000 + ".", [])  # Fraction's ValueError escaped the reward
def test_any_final_answer_is_scored_without_an_exception(text, history):
    episode = [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]
    assert CALCULATOR.score(CALCULATOR_TASK, episode)["correct"] in (0.0, 1.0)
    final = final_assistant_text(history)
    assert final is None or isinstance(final, str)
    assert last_number(text) is None or last_number(text).denominator >= 1
    assert exact_match(text, [text]) and isinstance(exact_match(text, "42"), bool)


def test_a_tool_that_exits_is_a_crash_observation():
    @tool
    def quit_(code: int) -> str:
        """Exit the process (what a careless tool, or code it runs in-process, may do)."""
        raise SystemExit(code)

    result = trio.run(ToolBox([quit_]).execute, ToolCall("quit_", {"code": 3}))
    assert result.error_kind == "crash" and "SystemExit: 3" in result.content
