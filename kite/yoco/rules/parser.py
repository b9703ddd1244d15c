"""Conditions: text → a small typed AST with positions (Lark, LALR, grammar.lark beside this file).

Syntax errors come back as `ConditionSyntaxError` with a line and column inside the condition
text and a message a person can act on ("bad operator '=': did you mean '=='?").
"""

from __future__ import annotations

import ast as _pyast
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Union

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError


@dataclass(frozen=True, slots=True)
class Pos:
    """A place in the condition text: 1-based line and column, and how many characters it spans."""

    line: int
    col: int
    length: int = 1


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    pos: Pos


@dataclass(frozen=True, slots=True)
class Literal:
    value: object  # float | str | bool
    type: str  # "number" | "string" | "bool"
    pos: Pos


@dataclass(frozen=True, slots=True)
class Compare:
    op: str
    left: "Node"
    right: "Node"
    pos: Pos  # the operator


@dataclass(frozen=True, slots=True)
class And:
    items: tuple["Node", ...]
    pos: Pos


@dataclass(frozen=True, slots=True)
class Or:
    items: tuple["Node", ...]
    pos: Pos


@dataclass(frozen=True, slots=True)
class Not:
    item: "Node"
    pos: Pos


Node = Union[Field, Literal, Compare, And, Or, Not]


class ConditionSyntaxError(Exception):
    def __init__(self, message: str, pos: Pos):
        super().__init__(message)
        self.message = message
        self.pos = pos


def _tpos(tok: Token) -> Pos:
    return Pos(tok.line, tok.column, max(1, len(tok)))


@v_args(inline=True)
class _ToAst(Transformer):
    def number(self, tok):
        value = float(tok)
        if not math.isfinite(value):
            raise ConditionSyntaxError(f"number {str(tok)!r} is out of range", _tpos(tok))
        return Literal(value, "number", _tpos(tok))

    def string(self, tok):
        try:
            value = _pyast.literal_eval(str(tok))
        except (ValueError, SyntaxError):
            raise ConditionSyntaxError(f"bad escape in the string {str(tok)}", _tpos(tok)) from None
        return Literal(value, "string", _tpos(tok))

    def true(self, tok):
        return Literal(True, "bool", _tpos(tok))

    def false(self, tok):
        return Literal(False, "bool", _tpos(tok))

    def field(self, *names):
        first, last = names[0], names[-1]
        length = (last.end_pos - first.start_pos) if last.line == first.line else len(first)
        return Field(".".join(str(n) for n in names), Pos(first.line, first.column, length))

    def compare(self, left, op, right):
        return Compare(str(op), left, right, _tpos(op))

    def and_(self, left, op, right):
        items = (left.items if isinstance(left, And) else (left,)) + (right,)
        return And(items, _node_pos(items[0]))

    def or_(self, left, op, right):
        items = (left.items if isinstance(left, Or) else (left,)) + (right,)
        return Or(items, _node_pos(items[0]))

    def not_(self, op, item):
        return Not(item, _tpos(op))


def _node_pos(node: Node) -> Pos:
    if isinstance(node, Compare):
        return _node_pos(node.left)
    return node.pos


@lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = (Path(__file__).with_name("grammar.lark")).read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", propagate_positions=False, maybe_placeholders=False)


_OP_CHARS = "=<>!&|"
_OP_FIX = {
    "=": "==", "=>": ">=", "=<": "<=", "<>": "!=", "=!": "!=", "!": "NOT", "&&": "AND",
    "&": "AND", "||": "OR", "|": "OR", "===": "==", "!==": "!=", "><": "!=",
}


def parse_condition(text: str) -> Node:
    """Parse a condition; raise ConditionSyntaxError with the place inside `text`."""
    if not text.strip():
        raise ConditionSyntaxError("empty condition (write `true` for a default rule)", Pos(1, 1))
    try:
        tree = _parser().parse(text)
        return _ToAst().transform(tree)
    except VisitError as exc:  # keep our own message, not Lark's wrapper
        raise exc.orig_exc from None
    except UnexpectedInput as exc:
        raise _syntax_error(text, exc) from None


def _syntax_error(text: str, exc: UnexpectedInput) -> ConditionSyntaxError:
    lines = text.split("\n")
    if isinstance(exc, UnexpectedEOF) or (
        isinstance(exc, UnexpectedToken) and exc.token.type == "$END"
    ):
        last = len(lines)
        col = len(lines[-1].rstrip()) + 1
        while last > 1 and not lines[last - 1].strip():
            last -= 1
            col = len(lines[last - 1].rstrip()) + 1
        expected = set(getattr(exc, "expected", None) or ())
        if "RPAR" in expected and not expected & {"NAME", "NUMBER", "STRING"}:
            return ConditionSyntaxError("missing ')': a parenthesis opened here is never closed",
                                        _open_paren(lines) or Pos(last, col))
        return ConditionSyntaxError("the condition ends too early: expected a field, a value or "
                                    "'(' after the last operator", Pos(last, col))
    line, col = exc.line, exc.column
    src = lines[line - 1] if 0 < line <= len(lines) else ""
    # An operator-like run of characters at (or just before) the error: name the bad operator.
    start = col - 1
    if isinstance(exc, UnexpectedToken) and exc.token.type == "COMP_OP":
        while start > 0 and src[start - 1] in _OP_CHARS:
            start -= 1
    end = start
    while end < len(src) and src[end] in _OP_CHARS:
        end += 1
    run = src[start:end]
    if run in ("<", "<=", ">", ">=", "==", "!="):
        return ConditionSyntaxError(f"unexpected {run!r}: comparisons do not chain; write "
                                    "`a < b AND b < c`", Pos(line, start + 1, len(run)))
    if run:
        fix = _OP_FIX.get(run)
        hint = f"; did you mean {fix!r}?" if fix else "; comparisons are < <= > >= == !="
        return ConditionSyntaxError(f"bad operator {run!r}{hint}", Pos(line, start + 1, len(run)))
    if isinstance(exc, UnexpectedCharacters):
        ch = src[col - 1] if 0 < col <= len(src) else "?"
        return ConditionSyntaxError(f"unexpected character {ch!r}", Pos(line, col))
    tok = exc.token  # UnexpectedToken
    kind = {"NAME": "field ", "NUMBER": "number ", "STRING": "string ", "TRUE": "value ",
            "FALSE": "value "}.get(tok.type, "")
    what = f"{kind}{str(tok)!r}"
    expected = sorted(exc.expected or ())
    if expected and set(expected) <= {"AND", "OR", "RPAR", "DOT", "COMP_OP", "$END"}:
        msg = f"unexpected {what}: expected AND, OR, a comparison or the end"
    else:
        msg = f"unexpected {what}: expected a field, a value, NOT or '('"
    return ConditionSyntaxError(msg, Pos(tok.line, tok.column, max(1, len(str(tok)))))


def _open_paren(lines: list[str]) -> Pos | None:
    """The last '(' left open (outside strings), for a "missing ')'" error."""
    stack: list[Pos] = []
    for i, line in enumerate(lines, 1):
        quote = ""
        for j, ch in enumerate(line, 1):
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "\"'":
                quote = ch
            elif ch == "(":
                stack.append(Pos(i, j))
            elif ch == ")" and stack:
                stack.pop()
    return stack[-1] if stack else None
