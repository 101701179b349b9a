"""The ``calculator`` tool: exact arithmetic with a hand-written parser (never ``eval``).

Usual precedence; ``**``/``^`` is right-associative and binds tighter than unary minus, as in
Python. Values are :class:`fractions.Fraction`, so ``0.1 + 0.2`` is exactly ``0.3``. Inputs that
could hang or exhaust memory are refused with a message: beyond :data:`MAX_CHARS` characters,
:data:`MAX_DEPTH` nesting, :data:`MAX_EXPONENT` exponents or :data:`MAX_BITS` result bits.
"""

from __future__ import annotations

import re
from fractions import Fraction

from agentrl.tools.base import Tool

MAX_CHARS = 256
MAX_DEPTH = 32
MAX_EXPONENT = 64
MAX_BITS = 1024

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(\*\*|//|[-+*/%^()]))")


class CalculatorError(ValueError):
    """An expression the calculator cannot evaluate; the message says why and where."""


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            bad = text[pos:].lstrip()[:1]
            raise CalculatorError(f"unexpected character {bad!r} at position {len(text) - len(text[pos:].lstrip())}")
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.i = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise CalculatorError("the expression ends too early")
        self.i += 1
        return tok

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
            _check_size(value)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op = self.take()
            rhs = self.unary()
            if op != "*" and rhs == 0:
                raise CalculatorError("division by zero")
            if op == "*":
                value = value * rhs
            elif op == "/":
                value = value / rhs
            elif op == "//":
                value = Fraction(value // rhs)
            else:
                value = value % rhs
            _check_size(value)
        return value

    def unary(self) -> Fraction:
        if self.peek() in ("+", "-"):
            op = self.take()
            self._enter()
            value = self.unary()
            self.depth -= 1
            return -value if op == "-" else value
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() in ("**", "^"):
            self.take()
            self._enter()
            exponent = self.unary()
            self.depth -= 1
            if exponent.denominator != 1:
                raise CalculatorError("only whole-number exponents are supported")
            if abs(exponent) > MAX_EXPONENT:
                raise CalculatorError(f"exponent {exponent} is too large (limit {MAX_EXPONENT})")
            if base == 0 and exponent < 0:
                raise CalculatorError("division by zero")
            if base.numerator.bit_length() * abs(int(exponent)) > 4 * MAX_BITS:
                raise CalculatorError("result is too large")
            base = base ** int(exponent)
            _check_size(base)
        return base

    def atom(self) -> Fraction:
        tok = self.take()
        if tok == "(":
            self._enter()
            value = self.expr()
            self.depth -= 1
            if self.peek() != ")":
                raise CalculatorError(
                    "missing ')'" if self.peek() is None else f"expected ')' but found {self.peek()!r}"
                )
            self.take()
            return value
        if tok[0].isdigit() or tok[0] == ".":
            return Fraction(tok)
        raise CalculatorError(f"expected a number or '(' but found {tok!r}")

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"the expression is nested too deeply (limit {MAX_DEPTH})")


def _check_size(value: Fraction) -> None:
    if value.numerator.bit_length() > MAX_BITS or value.denominator.bit_length() > MAX_BITS:
        raise CalculatorError("result is too large")


def evaluate(expression: str) -> Fraction:
    """Evaluate an arithmetic expression exactly; raises :class:`CalculatorError` on bad input."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    tokens = _tokenize(expression)
    if not tokens:
        raise CalculatorError("the expression is empty")
    parser = _Parser(tokens)
    value = parser.expr()
    if parser.peek() is not None:
        raise CalculatorError(f"unexpected {parser.peek()!r} after a complete expression")
    return value


def format_number(value: Fraction) -> str:
    """Integers exactly (``133``); other values as decimals with up to 10 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


class CalculatorTool(Tool):
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: for example "37 + 48 * 2".
    """

    name = "calculator"
    timeout_s = 2.0

    async def run(self, expression: str) -> str:
        return format_number(evaluate(expression))
