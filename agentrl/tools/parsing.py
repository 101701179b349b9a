"""Tool-call parsing from the text of an assistant turn.

The default format is Qwen/Hermes: JSON ``{"name": ..., "arguments": {...}}`` between
``<tool_call>`` and ``</tool_call>``, several per turn. The JSON is decoded first, so an argument
that holds ``</tool_call>`` still parses. Strict JSON only: ``NaN``, ``Infinity``, overflowing
numbers, duplicate keys, too-deep nesting and too-long integers are errors.

Invariant: parsing never raises; each problem becomes an error string the agent loop returns to the
model as an observation. Other formats implement :class:`ToolCallParser` and are chosen by the env
(``env.tool_parser``; ``llama3`` as SGLang's). See docs/tools.md.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentrl.tools.base import ToolCall


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    truncated: bool = False  # a call was opened but never closed

    @property
    def has_tool_activity(self) -> bool:
        return bool(self.calls or self.errors)


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class HermesToolCallParser:
    """``<tool_call>{json}</tool_call>`` blocks, as Qwen 2.5/3 and Hermes models emit them."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        pos = 0
        while (start := text.find(self.open_tag, pos)) != -1:
            body_start = start + len(self.open_tag)
            end = self._end_of_json_call(text, body_start)
            if end is None:  # not a well-formed JSON call: the body runs to the first close tag
                close = text.find(self.close_tag, body_start)
                if close == -1:
                    turn.truncated = True
                    turn.errors.append("Error: the tool call was cut off before </tool_call>; keep calls short")
                    break
                end = close + len(self.close_tag)
            body = text[body_start : end - len(self.close_tag)]
            call, error = _parse_call(body)
            if call is not None:
                call.raw = text[start:end]
                turn.calls.append(call)
            else:
                turn.errors.append(error)
            pos = end
        return turn

    def _end_of_json_call(self, text: str, i: int) -> int | None:
        """Where ``</tool_call>`` ends when one JSON value and blanks lie between ``i`` and it."""
        i = _skip_blanks(text, i)
        try:
            _, j = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):  # the fallback reports it with a message
            return None
        j = _skip_blanks(text, j)
        return j + len(self.close_tag) if text.startswith(self.close_tag, j) else None


def _skip_blanks(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class _StrictJSONError(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _StrictJSONError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _StrictJSONError(f"{_short(text, 20)} is too large for a JSON number")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _StrictJSONError(f"the key {_short(key)!r} appears twice")
        obj[key] = value
    return obj


_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float, object_pairs_hook=_no_duplicates)


def _short(value: str, limit: int = 60) -> str:
    """Model text cut so that an error observation stays short."""
    return value if len(value) <= limit else value[:limit] + "..."


def _loads(text: str) -> tuple[Any, str]:
    """Strict JSON: (value, "") or (None, why it is not valid JSON)."""
    try:
        return _DECODER.decode(text), ""
    except (ValueError, RecursionError) as e:
        return None, _problem(e)


def _problem(e: ValueError | RecursionError) -> str:
    """Why ``_DECODER`` refused a text, in words for the model."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at position {e.pos}"
    if isinstance(e, _StrictJSONError):
        return str(e)
    if isinstance(e, RecursionError):
        return "it is nested too deeply"
    return f"a number has more than {sys.get_int_max_str_digits()} digits"  # Python's limit on int digits


class Llama3JsonToolCallParser:
    """Llama 3.1/3.2 JSON tool calls: the turn is ``{"name": ..., "parameters": {...}}`` (``"arguments"``
    is read too), optionally after ``<|python_tag|>``; several calls are separated by ``;``. A turn that
    neither starts with ``{`` nor holds the tag is plain text; text after the last call is ignored. A
    call whose JSON ends before its braces close was cut off (``truncated``)."""

    tag = "<|python_tag|>"

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        if self.tag in text:
            body = text.split(self.tag, 1)[1]
        elif text.lstrip().startswith("{"):
            body = text
        else:
            return turn
        pos = 0
        while True:
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
            if not body.startswith("{", pos):
                return turn
            start = pos
            try:
                obj, pos = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError as e:
                rest = body[pos:]
                if rest.count("{") > rest.count("}"):
                    turn.truncated = True
                    turn.errors.append("Error: the tool call was cut off before its JSON ended; keep calls short")
                else:
                    turn.errors.append(f"Error: the tool call is not valid JSON ({e.msg} at position {e.pos - pos})")
                return turn
            except (ValueError, RecursionError) as e:
                turn.errors.append(f"Error: the tool call is not valid JSON ({_problem(e)})")
                return turn
            if isinstance(obj, dict) and "arguments" not in obj and "parameters" in obj:
                obj = {**obj, "arguments": obj["parameters"]}
            call, error = _call_from(obj)
            if call is not None:
                call.raw = body[start:pos]
                turn.calls.append(call)
            else:
                turn.errors.append(error)


def _parse_call(body: str) -> tuple[ToolCall | None, str]:
    obj, problem = _loads(body.strip())
    if problem:
        return None, f"Error: the tool call is not valid JSON ({problem})"
    return _call_from(obj)


def _call_from(obj: Any) -> tuple[ToolCall | None, str]:
    """The call a decoded JSON value holds (``arguments`` may be an object or JSON text), or why not."""
    if not isinstance(obj, dict):
        return None, 'Error: a tool call must be a JSON object with "name" and "arguments"'
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, 'Error: the tool call has no "name"'
    args = obj.get("arguments", {})
    if isinstance(args, str):
        args, problem = _loads(args) if args.strip() else ({}, "")
        if problem:
            return None, f"Error: the arguments of {_short(name)} are not valid JSON ({problem})"
    if not isinstance(args, dict):
        return None, f"Error: the arguments of {_short(name)} must be a JSON object"
    return ToolCall(name=name, arguments=args), ""


PARSERS: dict[str, type] = {
    "hermes": HermesToolCallParser,
    "qwen": HermesToolCallParser,
    "llama3": Llama3JsonToolCallParser,
}


def get_parser(name: str = "hermes") -> ToolCallParser:
    """A parser by format name (``hermes``/``qwen``, ``llama3``), or by import path ``module:Class``; a name
    that gives no parser is a ValueError naming it."""
    if ":" not in name:
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call format {name!r}; choose one of {', '.join(PARSERS)} or 'module:Class'")
        return PARSERS[name]()
    import importlib

    module_name, cls_name = name.split(":", 1)
    try:
        parser = getattr(importlib.import_module(module_name), cls_name)()
    except Exception as e:  # no such module or attribute, a relative name, a class whose constructor fails
        raise ValueError(f"cannot load tool-call parser {name!r}: {type(e).__name__}: {e}") from e
    if not callable(getattr(parser, "parse", None)):
        raise ValueError(f"tool-call parser {name!r} has no parse(text) method")
    return parser
