"""The tool API: schemas from signatures, ToolBox failure handling, Hermes tool-call parsing."""

from __future__ import annotations

import enum
import time
from fractions import Fraction
from typing import Any, Literal

import pytest
import trio

from agentrl.tools.base import Tool, ToolBox, ToolCall, ToolSchemaError, check_arguments, tool
from agentrl.tools.parsing import HermesToolCallParser, get_parser

# ----------------------------------------------------------------------------- schemas


@tool
async def lookup(
    query: str, top_k: int = 3, mode: Literal["fast", "exact"] = "fast", tags: list[str] | None = None
) -> str:
    """Search the corpus for passages.

    Args:
        query: what to look for.
        top_k: how many passages
            to return.
        mode: search mode.

    Returns:
        The passages.
    """
    return f"{query}:{top_k}:{mode}:{tags}"


def test_function_schema_from_hints_and_docstring():
    fn = lookup.schema()["function"]
    assert fn["name"] == "lookup"
    assert fn["description"] == "Search the corpus for passages."
    props = fn["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "what to look for."}
    assert props["top_k"] == {"type": "integer", "description": "how many passages to return."}
    assert props["mode"] == {"type": "string", "enum": ["fast", "exact"], "description": "search mode."}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert fn["parameters"]["required"] == ["query"]


def test_state_parameter_is_hidden_and_passed():
    @tool(name="remember", timeout_s=1.5)
    def remember(value: str, state: dict) -> str:
        """Store a value."""
        state.setdefault("seen", []).append(value)
        return "ok"

    assert remember.name == "remember" and remember.timeout_s == 1.5 and remember.wants_state
    assert "state" not in remember.parameters["properties"]
    state: dict = {}
    result = trio.run(ToolBox([remember]).execute, ToolCall("remember", {"value": "x"}), state)
    assert result.content == "ok" and not result.is_error and state == {"seen": ["x"]}


class WeatherTool(Tool):
    """Report the weather of a city.

    Args:
        city: the city's name.
    """

    async def run(self, city: str, days: int = 1, state: dict | None = None) -> str:
        return f"{city} sunny for {days} day(s)"


def test_class_tool_schema_is_derived():
    t = WeatherTool()
    assert t.name == "weather"
    assert t.description == "Report the weather of a city."
    assert t.parameters == {
        "type": "object",
        "required": ["city"],
        "properties": {"city": {"type": "string", "description": "the city's name."}, "days": {"type": "integer"}},
    }
    assert t.wants_state
    out = trio.run(ToolBox([t]).execute, ToolCall("weather", {"city": "Oslo", "days": 2}))
    assert out.content == "Oslo sunny for 2 day(s)"


def test_unresolvable_annotations_are_an_error_naming_the_tool():
    with pytest.raises(ToolSchemaError, match=r"Odd\.run.*do not resolve"):

        class Odd(Tool):
            async def run(self, thing: NotDefinedAnywhere, count: int = 1) -> str:  # noqa: F821
                return "ok"


def test_a_parameter_without_a_type_hint_is_an_error_naming_it():
    with pytest.raises(ToolSchemaError, match=r"lookup_factor.*'to_unit' has no type hint"):

        @tool
        def lookup_factor(from_unit: str, to_unit) -> str:
            return "1"

    with pytest.raises(ToolSchemaError, match=r"Convert\.run.*'value' has no type hint"):

        class Convert(Tool):
            async def run(self, value) -> str:
                return "1"


def test_an_unsupported_type_hint_is_an_error_naming_it():
    with pytest.raises(ToolSchemaError, match=r"scale.*'factor': Fraction has no JSON-schema type"):

        @tool
        def scale(x: float, factor: Fraction) -> str:
            return "1"


class Unit(enum.Enum):
    METRE = "m"
    FOOT = "ft"


def test_any_unions_enums_and_tuples_have_schemas():
    @tool
    def convert(
        value: int | float, unit: Unit, extra: Any = None, pair: tuple[int, int] = (0, 0), note: str | None = None
    ) -> str:
        return "ok"

    props = convert.parameters["properties"]
    assert props["value"] == {"anyOf": [{"type": "integer"}, {"type": "number"}]}
    assert props["unit"] == {"type": "string", "enum": ["m", "ft"]}
    assert props["extra"] == {} and props["note"] == {"type": "string"}
    assert props["pair"] == {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}
    assert convert.parameters["required"] == ["value", "unit"]
    assert check_arguments(convert, {"value": 2.5, "unit": "m", "extra": [1]}) is None
    assert "must be of type integer or number, got str" in check_arguments(convert, {"value": "2", "unit": "m"})


def test_explicit_class_schema_is_kept():
    class Echo(Tool):
        name = "echo"
        description = "Echo."
        parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

        async def run(self, **arguments):
            return arguments["text"]

    assert Echo().schema()["function"]["parameters"]["required"] == ["text"]
    assert not Echo.wants_state


def test_check_arguments_messages():
    assert check_arguments(lookup, {"query": "a"}) is None
    assert "missing required argument(s): query" in check_arguments(lookup, {})
    assert "unknown argument(s): colour" in check_arguments(lookup, {"query": "a", "colour": 1})
    assert "must be of type integer" in check_arguments(lookup, {"query": "a", "top_k": "3"})
    assert "must be of type integer" in check_arguments(lookup, {"query": "a", "top_k": True})
    assert "must be a JSON object" in check_arguments(lookup, ["a"])


def test_toolbox_rejects_duplicate_and_nameless_tools():
    with pytest.raises(ValueError, match="two tools are named 'lookup'"):
        ToolBox([lookup, lookup])
    nameless = Tool()
    with pytest.raises(ValueError, match="has no name"):
        ToolBox([nameless])


# ------------------------------------------------------------------- ToolBox failures


@tool
async def hang(seconds: float) -> str:
    """Sleep."""
    await trio.sleep(seconds)
    return "woke"


@tool
def block(seconds: float) -> str:
    """Block a thread."""
    time.sleep(seconds)
    return "done"


@tool
async def explode() -> str:
    """Raise."""
    raise KeyError("boom")


@tool
async def chatty(n: int) -> str:
    """Return a lot."""
    return "x" * n


@tool
async def number() -> int:
    """Return an int."""
    return 42


def _box(**kw) -> ToolBox:
    return ToolBox([lookup, hang, block, explode, chatty, number], **kw)


@pytest.mark.parametrize(
    "call, expected",
    [
        (ToolCall("nope", {}), "unknown tool 'nope'; available tools: lookup, hang, block, explode, chatty, number"),
        (ToolCall("lookup", {"top_k": 2}), "lookup is missing required argument(s): query"),
        (ToolCall("lookup", {"query": 5}), "argument 'query' of lookup must be of type string, got int"),
        (ToolCall("lookup", "not a dict"), "arguments for lookup must be a JSON object, got str"),
        (ToolCall("explode", {}), "explode failed: KeyError: 'boom'"),
    ],
)
def test_failures_become_error_observations(call, expected):
    result = trio.run(_box().execute, call)
    assert result.is_error
    assert result.content.startswith("Error: ") and expected in result.content
    assert result.name == call.name


def test_async_tool_that_hangs_times_out():
    start = time.monotonic()
    result = trio.run(_box(timeout_s=0.3).execute, ToolCall("hang", {"seconds": 60}))
    assert result.is_error and "hang timed out after 0.3 s" in result.content
    assert time.monotonic() - start < 5 and 0.25 < result.latency_s < 5


def test_sync_tool_that_blocks_times_out():
    start = time.monotonic()
    result = trio.run(_box(timeout_s=0.3).execute, ToolCall("block", {"seconds": 3}))
    assert result.is_error and "timed out" in result.content
    assert time.monotonic() - start < 2.5  # the thread is abandoned, the episode goes on


def test_per_tool_timeout_overrides_default():
    quick = tool(timeout_s=0.2)(hang.fn)
    result = trio.run(ToolBox([quick], timeout_s=30).execute, ToolCall("hang", {"seconds": 5}))
    assert "timed out after 0.2 s" in result.content


def test_output_is_truncated_and_non_strings_are_rendered():
    box = _box(max_output_chars=100)
    result = trio.run(box.execute, ToolCall("chatty", {"n": 5000}))
    assert not result.is_error
    assert result.content.startswith("x" * 100) and "[output truncated to 100 characters]" in result.content
    assert len(result.content) < 160
    assert trio.run(box.execute, ToolCall("number", {})).content == "42"


def test_cancellation_of_the_episode_propagates():
    async def main():
        with trio.move_on_after(0.2) as scope:
            await _box(timeout_s=30).execute(ToolCall("hang", {"seconds": 30}))
            pytest.fail("execute returned although the episode was cancelled")
        return scope.cancelled_caught

    assert trio.run(main)


def test_successful_call_reports_latency():
    result = trio.run(_box().execute, ToolCall("lookup", {"query": "q", "top_k": 1}))
    assert result.content == "q:1:fast:None" and not result.is_error and result.latency_s >= 0


# -------------------------------------------------------------------------- parsing

parser = HermesToolCallParser()


def test_parse_single_call():
    turn = parser.parse(
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>'
    )
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "1 + 2"})]
    assert turn.errors == [] and not turn.truncated and turn.has_tool_activity
    assert turn.calls[0].raw.startswith("<tool_call>") and turn.calls[0].raw.endswith("</tool_call>")


def test_parse_several_calls_and_string_arguments():
    text = (
        '<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"b\\"}"}</tool_call>'
        '<tool_call>{"name": "ping"}</tool_call>'
    )
    turn = parser.parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("search", {"query": "a"}),
        ("search", {"query": "b"}),
        ("ping", {}),
    ]


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "calc", "arguments": {"expression": "1"}', "not valid JSON"),
        ('["calc"]', "must be a JSON object"),
        ('{"arguments": {}}', 'has no "name"'),
        ('{"name": "calc", "arguments": [1, 2]}', "arguments of calc must be a JSON object"),
        ('{"name": "calc", "arguments": "{oops"}', "arguments of calc are not valid JSON"),
    ],
)
def test_malformed_calls_become_errors(body, message):
    turn = parser.parse(f"<tool_call>{body}</tool_call>")
    assert turn.calls == [] and len(turn.errors) == 1 and message in turn.errors[0]
    assert turn.errors[0].startswith("Error: ") and turn.has_tool_activity


def test_good_and_bad_calls_in_one_turn():
    turn = parser.parse('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>nope</tool_call>')
    assert [c.name for c in turn.calls] == ["a"] and len(turn.errors) == 1


def test_call_cut_off_by_length_limit():
    turn = parser.parse('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "argu')
    assert [c.name for c in turn.calls] == ["a"]
    assert turn.truncated and "cut off" in turn.errors[0]


def test_plain_text_has_no_tool_activity():
    turn = parser.parse("The answer is 42.")
    assert turn.calls == [] and turn.errors == [] and not turn.has_tool_activity


def test_parser_registry():
    assert isinstance(get_parser("hermes"), HermesToolCallParser)
    assert isinstance(get_parser("qwen"), HermesToolCallParser)
    assert isinstance(get_parser("agentrl.tools.parsing:HermesToolCallParser"), HermesToolCallParser)
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        get_parser("xml")
    with pytest.raises(ValueError, match="cannot load tool-call parser"):
        get_parser("agentrl.tools.parsing:Nope")


def test_parser_round_trips_the_chat_template_rendering():
    """A call rendered by the model's chat template parses back to the same call."""
    from jinja2 import Template  # transformers' dependency

    from agentrl.models.builder import CHAT_TEMPLATE

    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 * 3"}}},
                {"type": "function", "function": {"name": "search", "arguments": {"query": 'x "y"'}}},
            ],
        },
    ]
    rendered = Template(CHAT_TEMPLATE).render(messages=messages, tools=None, add_generation_prompt=False)
    assistant = rendered.split("<|im_start|>assistant\n", 1)[1]
    turn = parser.parse(assistant)
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("calculator", {"expression": "2 * 3"}),
        ("search", {"query": 'x "y"'}),
    ]
