"""The tool API: tools are classes or decorated functions; calls never crash an episode.

A tool has a name, a description and a JSON schema of its parameters (OpenAI function format); for
a decorated function (:func:`tool`) the schema comes from the type hints and the ``Args:`` section
of its docstring. A parameter named ``state`` receives the episode's state dict and is not in the
schema. Arguments arrive as the hints promise (an ``Enum`` member, a tuple).

Invariant: :class:`ToolBox` turns every failure (unknown tool, arguments that do not fit, an
exception, a time-out, an oversized output) into a :class:`ToolResult` with ``is_error=True`` and a
message the model can read; only ``trio.Cancelled`` propagates. A tool answers with an error on
purpose by raising :class:`ToolError` (counted as ``error_kind="tool_error"``, not as a crash).
A tool may answer with images: a PIL image, or a list of content parts (``{"type": "text", "text": ...}``,
``{"type": "image", "image": ...}``); images become PNG bytes (agentrl/images.py), one that cannot be read
is an error observation. See docs/tools.md.
"""

from __future__ import annotations

import enum
import inspect
import re
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from agentrl.images import ImageError, to_png

ToolOutput = str | list[dict[str, Any]]  # text, or content parts with images (ToolBox normalises what run returns)

_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str = ""  # the text the call was parsed from


@dataclass
class ToolResult:
    content: ToolOutput
    is_error: bool = False
    latency_s: float = 0.0
    name: str = ""
    # why it failed: "unknown_tool" / "bad_arguments" (the model's mistake), "tool_error" (the tool
    # raised ToolError: an answer on purpose), "crash" / "timeout" (the tool's fault: an evaluation
    # reports these); "" when it did not fail
    error_kind: str = ""

    @property
    def tool_fault(self) -> bool:
        return self.error_kind in ("crash", "timeout")


class ToolError(Exception):
    """Raise it in a tool to answer the model with an error on purpose (``Error: <message>``):
    an unknown country, a unit the converter does not know. Any other exception is a crash."""


class Tool:
    """Base class. Subclasses implement ``run`` and may set ``name``/``description``/``parameters``.

    What a subclass leaves out is derived, as for decorated functions: ``parameters`` from the
    type hints of ``run`` (when it names its arguments instead of taking ``**arguments``),
    ``description`` from the class docstring, argument descriptions from the ``Args:`` section
    of the class or ``run`` docstring, ``name`` from the class name (``WeatherTool`` ->
    ``weather``), and ``wants_state`` from a ``state`` parameter of ``run``.
    """

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
    timeout_s: float | None = None  # None: the ToolBox default
    wants_state: bool = False  # pass the episode state as keyword ``state``
    converters: dict[str, Callable[[Any], Any]] = {}  # argument -> its JSON value as the hint's type

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__name__ == "FunctionTool" or cls.__module__ == __name__:
            return
        class_desc, class_args = _parse_docstring(cls.__doc__ or "")
        if "name" not in cls.__dict__ and not any(b.name for b in cls.__mro__[1:] if issubclass(b, Tool)):
            base = cls.__name__[:-4] if cls.__name__.endswith("Tool") and cls.__name__ != "Tool" else cls.__name__
            cls.name = re.sub(r"(?<!^)(?=[A-Z])", "_", base).lower()
        if "description" not in cls.__dict__ and class_desc:
            cls.description = class_desc
        run = cls.__dict__.get("run")
        if run is None:
            return
        params = inspect.signature(run).parameters
        named = [p for n, p in params.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if "parameters" not in cls.__dict__ and named:
            _, run_args = _parse_docstring(run.__doc__ or "")
            cls.parameters = _schema_from_signature(run, {**class_args, **run_args})
            cls.converters = _argument_converters(run)
        if "wants_state" not in cls.__dict__ and "state" in params:
            cls.wants_state = True

    async def run(self, **arguments: Any) -> Any:
        raise NotImplementedError(f"tool {self.name!r} does not implement run()")

    def cannot_take(self, arguments: dict[str, Any]) -> str | None:
        """Why ``run`` cannot be called with these keyword arguments (None when it can): the
        check behind the schema, for tools whose schema does not list every argument."""
        try:
            inspect.signature(type(self).run).bind(self, **arguments)
        except TypeError as e:
            return str(e)
        return None

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class FunctionTool(Tool):
    """A tool made from a plain (sync or async) function by :func:`tool`."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, timeout_s: float | None = None):
        self.fn = fn
        self.name = name or fn.__name__
        self.timeout_s = timeout_s
        self.description, arg_docs = _parse_docstring(fn.__doc__ or "")
        self.parameters = _schema_from_signature(fn, arg_docs)
        self.wants_state = "state" in inspect.signature(fn).parameters
        self.converters = _argument_converters(fn)
        self._is_async = inspect.iscoroutinefunction(fn)

    def cannot_take(self, arguments: dict[str, Any]) -> str | None:
        try:
            inspect.signature(self.fn).bind(**arguments)
        except TypeError as e:
            return str(e)
        return None

    async def run(self, /, **arguments: Any) -> Any:
        if self._is_async:
            return await self.fn(**arguments)
        return await trio.to_thread.run_sync(lambda: self.fn(**arguments), abandon_on_cancel=True)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, timeout_s: float | None = None) -> Any:
    """Decorator: turn a function into a :class:`Tool` (``@tool`` or ``@tool(name=...)``)."""
    if fn is None:
        return lambda f: FunctionTool(f, name=name, timeout_s=timeout_s)
    return FunctionTool(fn, name=name, timeout_s=timeout_s)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {arg: description})."""
    doc = inspect.cleandoc(doc)
    parts = re.split(r"^\s*(?:Args|Arguments|Parameters):\s*$", doc, maxsplit=1, flags=re.M)
    description = " ".join(parts[0].split())
    args: dict[str, str] = {}
    if len(parts) == 2:
        current = None
        for line in parts[1].splitlines():
            m = re.match(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if m:
                current = m.group(1)
                args[current] = m.group(2).strip()
            elif re.match(r"^\s*(Returns|Raises|Yields):", line):
                break
            elif current and line.strip():
                args[current] += " " + line.strip()
    return description, args


class ToolSchemaError(ValueError):
    """A tool's parameter has no type hint, or one that has no JSON-schema type; the message
    names the tool and the parameter. Raised when the tool is defined, i.e. when its env loads."""


SUPPORTED_HINTS = "str, int, float, bool, list[...], tuple[...], dict, Literal[...], an Enum, X | None, X | Y, or Any"


def _json_type(annotation: Any) -> dict[str, Any]:
    """The JSON schema of one type hint; raises ``TypeError`` for a hint without one."""
    if annotation is Any:
        return {}
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [_json_type(a) for a in typing.get_args(annotation) if a is not type(None)]
        return options[0] if len(options) == 1 else {"anyOf": options}
    if origin is typing.Literal:
        values = list(typing.get_args(annotation))
        return {"type": _JSON_TYPES.get(type(values[0]), "string"), "enum": values}
    if origin in (list, tuple):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        schema: dict[str, Any] = {"type": "array"}
        if len(set(args)) == 1:
            schema["items"] = _json_type(args[0])
        elif args:
            schema["prefixItems"] = [_json_type(a) for a in args]
        if origin is tuple and args and Ellipsis not in typing.get_args(annotation):  # tuple[int, int]: exactly two
            schema["minItems"] = schema["maxItems"] = len(args)
        return schema
    if origin is dict:
        return {"type": "object"}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        values = [m.value for m in annotation]
        return {"type": _JSON_TYPES.get(type(values[0]), "string"), "enum": values}
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    raise TypeError(f"{getattr(annotation, '__name__', annotation)!s} has no JSON-schema type")


def _tool_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))


def _converter(annotation: Any) -> Callable[[Any], Any] | None:
    """What turns a JSON value that fits ``annotation``'s schema into the type the hint promises
    (an Enum's value into its member, a list into a tuple); None when the JSON value is it already."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        inner = _converter(options[0]) if len(options) == 1 else None
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation
    return tuple if origin is tuple else None


def _argument_converters(fn: Callable[..., Any]) -> dict[str, Callable[[Any], Any]]:
    hints = typing.get_type_hints(fn)  # they resolved when the schema was built
    converters = {name: _converter(hint) for name, hint in hints.items() if name not in ("return", "state")}
    return {name: conv for name, conv in converters.items() if conv is not None}


def _schema_from_signature(fn: Callable[..., Any], arg_docs: dict[str, str]) -> dict[str, Any]:
    """The parameters' schema from type hints (strict: see :class:`ToolSchemaError`)."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # a forward reference that does not resolve
        raise ToolSchemaError(f"tool {_tool_name(fn)}: its type hints do not resolve ({e})") from None
    props: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if pname in ("self", "state") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if pname not in hints:
            raise ToolSchemaError(
                f"tool {_tool_name(fn)}: parameter {pname!r} has no type hint; annotate it with {SUPPORTED_HINTS}"
            )
        try:
            prop = _json_type(hints[pname])
        except TypeError as e:
            raise ToolSchemaError(f"tool {_tool_name(fn)}: parameter {pname!r}: {e}; use {SUPPORTED_HINTS}") from None
        if pname in arg_docs:
            prop["description"] = arg_docs[pname]
        props[pname] = prop
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    return {"type": "object", "properties": props, "required": required}


def check_arguments(tool_: Tool, arguments: Any) -> str | None:
    """Return an error message when ``arguments`` do not fit the tool's schema, else None.

    The message is for the model: it names the argument and what was expected, and quotes
    the model's own text only cut short (a name may be a megabyte of garbage)."""
    if not isinstance(arguments, dict):
        return f"arguments for {tool_.name} must be a JSON object, got {type(arguments).__name__}"
    props = tool_.parameters.get("properties", {})
    missing = [p for p in tool_.parameters.get("required", []) if p not in arguments]
    if missing:
        return f"{tool_.name} is missing required argument(s): {', '.join(missing)}"
    unknown = [a for a in arguments if props and a not in props]
    if unknown:
        names = ", ".join(_short(a) for a in unknown[:5]) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        )
        return f"{tool_.name} got unknown argument(s): {names}; it takes {', '.join(props)}"
    for key, value in arguments.items():
        schema = props.get(key, {})
        if not _fits(value, schema):
            got = type(value).__name__ if not _fits_type(value, schema) else _short(repr(value))
            return f"argument {key!r} of {tool_.name} must be {_expected(schema)}, got {got}"
    return None


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _expected(schema: dict[str, Any]) -> str:
    options = schema["anyOf"] if "anyOf" in schema else [schema]
    if all(set(o) <= {"type", "description"} for o in options):
        return "of type " + " or ".join(o.get("type", "anything") for o in options)
    return " or ".join(_expected_one(o) for o in options)


def _expected_one(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(repr(v) for v in schema["enum"])
    if schema.get("type") == "array":
        size = f"{schema['minItems']} " if schema.get("minItems") == schema.get("maxItems") is not None else ""
        if "prefixItems" in schema:
            return f"an array [{', '.join(_expected(p).removeprefix('of type ') for p in schema['prefixItems'])}]"
        if "items" in schema:
            return f"an array of {size}{_expected(schema['items']).removeprefix('of type ')} items"
        return f"an array of {size}items"
    return _expected(schema)


def _fits_type(value: Any, schema: dict[str, Any]) -> bool:
    """Whether the JSON type is right, before enum values, lengths and items are looked at."""
    if "anyOf" in schema:
        return any(_fits_type(value, option) for option in schema["anyOf"])
    return "type" not in schema or _matches(value, schema["type"])


def _fits(value: Any, schema: dict[str, Any]) -> bool:
    if "anyOf" in schema:
        return any(_fits(value, option) for option in schema["anyOf"])
    if not _fits_type(value, schema):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        if "prefixItems" in schema and not all(_fits(v, s) for v, s in zip(value, schema["prefixItems"])):
            return False
        if "items" in schema and not all(_fits(v, schema["items"]) for v in value):
            return False
    return True


def _matches(value: Any, json_type: str) -> bool:
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    py = {"string": str, "boolean": bool, "array": list, "object": dict}.get(json_type)
    return py is None or isinstance(value, py)


@dataclass
class ToolBox:
    """The tools of one env, executed with a time limit and an output size limit.

    Arguments are checked against the schema (JSON types, ``enum`` values, array items and
    lengths), then against the signature of ``run`` (which catches what a schema without
    properties lets through, such as any argument of a tool that takes none), so that a
    failure inside the tool is the tool's fault (``crash``), never a model's malformed call."""

    tools: list[Tool]
    timeout_s: float = 10.0
    max_output_chars: int = 2000
    _by_name: dict[str, Tool] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {}
        for t in self.tools:
            if not t.name:
                raise ValueError(f"tool {t!r} has no name")
            if t.name in self._by_name:
                raise ValueError(f"two tools are named {t.name!r}")
            self._by_name[t.name] = t

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools]

    async def execute(self, call: ToolCall, state: dict[str, Any] | None = None) -> ToolResult:
        start = time.monotonic()
        result = await self._execute(call, state if state is not None else {})
        result.latency_s = time.monotonic() - start
        result.name = call.name
        return result

    async def _execute(self, call: ToolCall, state: dict[str, Any]) -> ToolResult:
        tool_ = self._by_name.get(call.name)
        if tool_ is None:
            known = ", ".join(self._by_name) or "none"
            return ToolResult(
                f"Error: unknown tool {_short(call.name)!r}; available tools: {known}",
                is_error=True,
                error_kind="unknown_tool",
            )
        problem = check_arguments(tool_, call.arguments)
        if not problem:
            kwargs = {k: tool_.converters[k](v) if k in tool_.converters else v for k, v in call.arguments.items()}
            if tool_.wants_state:
                kwargs["state"] = state
            problem = _cannot_take(tool_, kwargs)
        if problem:
            return ToolResult(f"Error: {problem}", is_error=True, error_kind="bad_arguments")
        limit = tool_.timeout_s or self.timeout_s
        out: object = None  # set unless the call timed out
        try:
            with trio.move_on_after(limit) as scope:
                out = await tool_.run(**kwargs)
        except trio.Cancelled:
            raise
        except ToolError as e:  # the tool's answer, on purpose
            return ToolResult(f"Error: {e}", is_error=True, error_kind="tool_error")
        except (Exception, SystemExit) as e:  # a crashed (or exiting) tool is an observation, not a crashed episode
            return ToolResult(f"Error: {call.name} failed: {type(e).__name__}: {e}", is_error=True, error_kind="crash")
        if scope.cancelled_caught:
            return ToolResult(f"Error: {call.name} timed out after {limit:g} s", is_error=True, error_kind="timeout")
        try:
            return ToolResult(self._observation(out))
        except ImageError as e:
            return ToolResult(
                f"Error: {call.name} returned an image that cannot be read: {e}", True, error_kind="crash"
            )

    def _observation(self, out: Any) -> ToolOutput:
        """What a tool returned as the model's observation: text (truncated), or parts with PNG images."""
        if _is_image(out):
            out = [{"type": "image", "image": out}]
        if not (isinstance(out, list) and any(_is_image(p) or isinstance(p, dict) and "type" in p for p in out)):
            return self._truncate(out if isinstance(out, str) else str(out))  # a plain list of values is text
        parts: list[dict[str, Any]] = []
        for i, part in enumerate(out):
            kind = part.get("type") if isinstance(part, dict) else "image" if _is_image(part) else None
            if kind == "text":
                parts.append({"type": "text", "text": self._truncate(str(part.get("text", "")))})
            elif kind == "image":
                parts.append({"type": "image", "image": to_png(part.get("image") if isinstance(part, dict) else part)})
            else:
                raise ImageError(f"part {i} is {part!r:.60}, not a text or image part")
        return parts

    def _truncate(self, text: str) -> str:
        if len(text) > self.max_output_chars:
            return text[: self.max_output_chars] + f"\n[output truncated to {self.max_output_chars} characters]"
        return text


def _is_image(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.")


def _cannot_take(tool_: Tool, arguments: dict[str, Any]) -> str | None:
    why = tool_.cannot_take(arguments)
    return None if why is None else f"{tool_.name} cannot take these arguments: {_short(why, 200)}"
