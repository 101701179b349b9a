"""Reading the JSON and JSONL files users hand to agentrl: task data, SFT conversations, search corpora.

Every problem is a ``ValueError`` that names the file and the line, including invalid UTF-8, JSON
nested too deeply and integers too long for Python. What a record must hold is the caller's
business.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def loads(text: str | bytes, where: str) -> Any:
    """``json.loads`` whose every failure is a ValueError starting with ``where``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise ValueError(f"{where} is not valid JSON: nested too deeply") from None
    except ValueError as e:  # Python's limit on the digits of an integer
        raise ValueError(f"{where} is not valid JSON: {e}") from None


def read_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` for each non-blank line of a JSONL file."""
    with Path(path).open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, loads(line, f"{path}:{lineno}")


def read_json(path: str | Path) -> Any:
    return loads(Path(path).read_bytes(), str(path))
