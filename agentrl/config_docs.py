"""``docs/config.md``: every config key, generated from the schema in ``agentrl/config.py``.

The schema is the truth: section classes give each key's type and default, and the comment at the
end of a field's line is its meaning (read with :mod:`tokenize`). ``python -m agentrl.config_docs``
prints the reference; ``--write`` updates ``docs/config.md``. A test fails when the file is out of
date or a key has no meaning.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "config.md"

HEADER = """# Config reference

Generated from `agentrl/config.py` by `python -m agentrl.config_docs --write`; a test fails when
it is out of date. One TOML file per run, one table per section; unknown keys are errors that
name the key and the file; override any key on the command line with `-s section.key=value`
(the value is read as TOML: `3`, `1e-4`, `true`, `["a"]`, `{x = 1}`, else a string).
`agentrl run CONFIG --dry-run` prints the resolved config. Units are in the names: `*_s`
seconds, `*_mb` mebibytes, `*_tokens` tokens, `num_*` counts. Secrets are never config values:
keys ending in `_env` name the environment variable that holds one.
"""


def field_comments(cls: type) -> dict[str, str]:
    """``{field: meaning}`` from the comments at the ends of the lines of each field's statement in ``cls``'s
    source (a comment on a line of its own is a heading for the reader, not a meaning)."""
    source = textwrap.dedent(inspect.getsource(cls))
    trailing = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and not tok.line.strip().startswith("#")
    }
    comments: dict[str, str] = {}
    class_def = ast.parse(source).body[0]
    assert isinstance(class_def, ast.ClassDef)
    for node in class_def.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            end = node.end_lineno or node.lineno
            lines = [trailing[i] for i in range(node.lineno, end + 1) if i in trailing]
            if lines:
                comments[node.target.id] = " ".join(lines)
    return comments


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(v) for v in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def _default(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, (list, dict)) else repr(value)


def section_rows(section: str, cls: type[BaseModel]) -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) for every field of a section class."""
    meanings = field_comments(cls)
    rows = []
    for name, info in cls.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):  # a sub-table
            rows += section_rows(f"{section}.{name}", info.annotation)
            continue
        default = info.get_default(call_default_factory=True)
        rows.append((f"{section}.{name}", _type_name(info.annotation), _default(default), meanings.get(name, "")))
    return rows


def section_class(annotation: Any) -> type[BaseModel]:
    """The section model of a top-level field (``EnvSection | None`` and ``list[EnvSection]`` too)."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    raise TypeError(f"{annotation!r} is not a config section")


def sections() -> list[tuple[str, str, type[BaseModel], str]]:
    """(name, TOML header, section class, the field's own comment) of every top-level field."""
    from agentrl.config import AgentRLConfig

    comments = field_comments(AgentRLConfig)
    out = []
    for name, info in AgentRLConfig.model_fields.items():
        header = f"[[{name}]]" if typing.get_origin(info.annotation) is list else f"[{name}]"
        out.append((name, header, section_class(info.annotation), comments.get(name, "")))
    return out


def reference() -> str:
    """The whole of ``docs/config.md``."""
    out = [HEADER]
    for section, header, cls, comment in sections():
        doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        out.append(f"## `{header}`\n")
        if comment:
            out.append(comment + "\n")
        if doc:
            out.append(doc + "\n")
        out.append("| key | type | default | meaning |\n| --- | --- | --- | --- |")
        for key, type_name, default, meaning in section_rows(section, cls):
            cells = [f"`{key}`", type_name, f"`{default}`", meaning.replace("|", "\\|")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m agentrl.config_docs", description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write {DOC_PATH} instead of printing")
    args = ap.parse_args(argv)
    text = reference()
    if args.write:
        DOC_PATH.write_text(text)
        print(f"wrote {DOC_PATH}")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
