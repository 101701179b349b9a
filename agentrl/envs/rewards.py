"""Reward helpers shared by environments: find the final answer, normalise it, compare it.

The final answer is the content of the last message when it is an assistant turn without a tool
call (as ``tool_calls`` or as raw ``<tool_call>`` text); an episode that ended on a tool call or
result has none and scores zero in the built-in envs. ``<think>`` reasoning is removed.
"""

from __future__ import annotations

import re
import string
from fractions import Fraction
from typing import Any

_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.S)  # reasoning is not the answer
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER_PREFIX = re.compile(r"^\s*(?:the\s+)?(?:final\s+)?answer\s*(?:is|:)\s*", re.I)


def without_reasoning(text: str) -> str:
    """``text`` without ``<think>...</think>`` blocks (an unclosed one runs to the end)."""
    return _THINK.sub("", text)


def final_assistant_text(messages: list[dict[str, Any]]) -> str | None:
    """The final answer's text, or None when the episode did not end with a plain answer."""
    if not messages:
        return None
    last = messages[-1]
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    content = last.get("content") or ""
    if not isinstance(content, str) or "<tool_call>" in content:
        return None
    return without_reasoning(content).strip()


def last_number(text: str) -> Fraction | None:
    """The last number written in ``text`` (``"The answer is 133."`` -> 133), or None (also for a
    number longer than Python converts, 4300 digits: a degenerate turn, not an answer)."""
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    try:
        return Fraction(found[-1])
    except ValueError:
        return None


def normalize_answer(text: str) -> str:
    """Lower-case, drop an "The answer is" prefix, punctuation, articles and extra spaces."""
    text = _ANSWER_PREFIX.sub("", text.strip())
    text = text.lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: str | list[str]) -> bool:
    """Normalised exact match against one or several accepted answers."""
    options = [answers] if isinstance(answers, str) else answers
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(a) for a in options)
