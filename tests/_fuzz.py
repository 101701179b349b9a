"""Shared settings and strategies of the fuzz tests (``tests/test_fuzz_*.py``).

CI runs every fuzz test derandomized (the same examples on every run, so nothing flakes) with
example counts sized for a busy 2-core machine. ``AGENTRL_FUZZ_SCALE=20`` multiplies the
counts and draws fresh random examples each run: use it locally after changing a parser.
A failure found that way goes into the test as an ``@example`` before it is fixed.
"""

from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SCALE = float(os.environ.get("AGENTRL_FUZZ_SCALE", "1"))


def fuzz(max_examples: int) -> settings:
    """Settings of one fuzz test: ``max_examples`` (times the scale), no deadline."""
    return settings(
        max_examples=max(1, int(max_examples * SCALE)),
        derandomize=SCALE <= 1,
        database=None,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.function_scoped_fixture,
        ],
    )


# Text the way it arrives from outside: any Unicode (no lone surrogates: JSON escapes of
# those are fuzzed on their own), with the characters that matter to parsers made likely.
_SPICY = [
    "\x00",
    "\n",
    "\t",
    "\\",
    '"',
    "'",
    "\u2028",
    "\ufeff",
    "é",
    "🙂",
    "\U0010ffff",
    "NaN",
    "-Infinity",
    "1e999",
    "9" * 30,
    "null",
    "{}",
    "[]",
    "</tool_call>",
    "<tool_call>",
    "<|im_end|>",
    "=",
]
texts = st.text(max_size=20) | st.sampled_from(_SPICY) | st.lists(st.sampled_from(_SPICY), max_size=4).map("".join)

# Everything Python's json module can decode: NaN and infinities, and integers beyond 64 bits.
json_scalars = st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70) | st.floats() | texts
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=10,
)
# The same without NaN and infinities (what strict JSON can carry).
finite_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts
finite_values = st.recursive(
    finite_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=10,
)


def mostly(plausible: st.SearchStrategy, wild: st.SearchStrategy = json_values) -> st.SearchStrategy:
    """Values near the valid ones five times out of six, anything (``wild``) the rest of the time:
    a border has to be passed before the code behind it can be fuzzed."""
    return st.one_of(plausible, plausible, plausible, plausible, plausible, wild)


def nested(depth: int, leaf: str = "1") -> str:
    """JSON text nested ``depth`` levels deep (lists in objects in lists ...)."""
    return '{"a": [' * depth + leaf + "]}" * depth


def dumps(value) -> str:
    """JSON text of ``value`` as Python writes it (NaN and Infinity as bare words)."""
    return json.dumps(value, allow_nan=True)
