"""Tool-call parsing from the text of an assistant turn.

The default format is Qwen/Hermes: each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; a turn may
hold several. Parsing never raises: each problem (invalid JSON, a missing name, a call cut
off by the length limit) becomes an error string that the agent loop turns into an error
observation for the model, so the model learns from its malformed calls instead of the
episode crashing.

Other formats implement :class:`ToolCallParser` and are chosen by the env (``env.tool_parser``):
``llama3`` reads Llama 3.1/3.2's JSON calls, as SGLang's ``llama3`` parser does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol

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
        pattern = re.escape(self.open_tag) + r"(.*?)(" + re.escape(self.close_tag) + r"|$)"
        for match in re.finditer(pattern, text, flags=re.S):
            body, closed = match.group(1), bool(match.group(2))
            if not closed:
                turn.truncated = True
                turn.errors.append("Error: the tool call was cut off before </tool_call>; keep calls short")
                break
            call, error = _parse_call(body)
            if call is not None:
                call.raw = match.group(0)
                turn.calls.append(call)
            else:
                turn.errors.append(error)
        return turn


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
        decoder = json.JSONDecoder()
        pos = 0
        while True:
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
            if not body.startswith("{", pos):
                return turn
            start = pos
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as e:
                rest = body[pos:]
                if rest.count("{") > rest.count("}"):
                    turn.truncated = True
                    turn.errors.append("Error: the tool call was cut off before its JSON ended; keep calls short")
                else:
                    turn.errors.append(f"Error: the tool call is not valid JSON ({e.msg} at position {e.pos - pos})")
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
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return None, f"Error: the tool call is not valid JSON ({e.msg} at position {e.pos})"
    return _call_from(obj)


def _call_from(obj: object) -> tuple[ToolCall | None, str]:
    if not isinstance(obj, dict):
        return None, "Error: a tool call must be a JSON object with \"name\" and \"arguments\""
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, "Error: the tool call has no \"name\""
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None, f"Error: the arguments of {name} are not valid JSON"
    if not isinstance(args, dict):
        return None, f"Error: the arguments of {name} must be a JSON object"
    return ToolCall(name=name, arguments=args), ""


PARSERS: dict[str, type] = {"hermes": HermesToolCallParser, "qwen": HermesToolCallParser,
                            "llama3": Llama3JsonToolCallParser}


def get_parser(name: str = "hermes") -> ToolCallParser:
    """A parser by format name (``hermes``/``qwen``, ``llama3``), or by import path ``module:Class``."""
    if ":" in name:
        import importlib

        module_name, cls_name = name.split(":", 1)
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load tool-call parser {name!r}: {e}") from e
        return cls()
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call format {name!r}; choose one of {', '.join(PARSERS)} or 'module:Class'")
    return PARSERS[name]()
