"""Load-time checks: every field exists in the signal schema, every comparison has matching
types, every label exists in the state (when its labels are known), every action is valid."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from kite.yoco.rules.parser import And, Compare, Field, Literal, Node, Not, Or, Pos
from kite.yoco.signals import SIGNAL_FIELDS, SignalField, suggest

ORDERING = frozenset({"<", "<=", ">", ">="})


@dataclass(frozen=True, slots=True)
class Problem:
    """A checker finding at a place inside the condition text."""

    message: str
    pos: Pos


def check_condition(node: Node, labels: Iterable[str] | None = None,
                    fields: Mapping[str, SignalField] | None = None, noun: str = "field") -> list[Problem]:
    """Every problem in a parsed condition. An empty list means it compiles.

    `fields`: the schema its names are checked against (default: the signals; `kite tune` passes
    the bench's metrics, called `noun` in the messages)."""
    problems: list[Problem] = []
    known = None if labels is None else list(labels)
    kind = _check(node, known, problems, SIGNAL_FIELDS if fields is None else fields, noun)
    if kind not in (None, "bool"):
        problems.append(Problem(f"the condition is a {kind}, not true/false: compare it "
                                f"(e.g. `{_describe(node)} > 0`)", _pos(node)))
    return problems


def label_problem(label: str, labels: list[str]) -> str | None:
    """The message for a label the state does not have, or None if it has it."""
    if label in labels:
        return None
    hint = suggest(label, labels)
    shown = ", ".join(labels) if labels else "(none)"
    return (f"unknown label {label!r}" + (f"; did you mean {hint!r}?" if hint else "")
            + f" (the state's labels: {shown})")


def _check(node: Node, labels: list[str] | None, out: list[Problem], schema: Mapping[str, SignalField],
           noun: str) -> str | None:
    """The node's type ('number' | 'string' | 'bool'), or None where an error hides it."""
    if isinstance(node, Literal):
        return node.type
    if isinstance(node, Field):
        spec = schema.get(node.name)
        if spec is None:
            hint = suggest(node.name, schema)
            out.append(Problem(f"unknown {noun} {node.name!r}"
                               + (f"; did you mean {hint!r}?" if hint else
                                  f"; {noun}s: " + ", ".join(schema)), node.pos))
            return None
        return spec.type
    if isinstance(node, Compare):
        lt, rt = _check(node.left, labels, out, schema, noun), _check(node.right, labels, out, schema, noun)
        if lt is None or rt is None:
            return "bool"
        if node.op in ORDERING:
            for side, kind in ((node.left, lt), (node.right, rt)):
                if kind != "number":
                    out.append(Problem(f"type mismatch: {_describe(side)} is a {kind}; "
                                       f"{node.op!r} compares numbers", _pos(side)))
                    break
        elif lt != rt:
            out.append(Problem(f"type mismatch: cannot compare {_describe(node.left)} ({lt}) "
                               f"with {_describe(node.right)} ({rt})", _pos(node.right)))
        elif labels is not None:
            for a, b in ((node.left, node.right), (node.right, node.left)):
                if (isinstance(a, Field) and a.name == "query_label" and isinstance(b, Literal)
                        and b.value != ""):  # "" is "the tagger gave no label"
                    msg = label_problem(str(b.value), labels)
                    if msg:
                        out.append(Problem(msg, b.pos))
        return "bool"
    if isinstance(node, Not):
        _want_bool(node.item, _check(node.item, labels, out, schema, noun), "NOT", out)
        return "bool"
    if isinstance(node, (And, Or)):
        word = "AND" if isinstance(node, And) else "OR"
        for item in node.items:
            _want_bool(item, _check(item, labels, out, schema, noun), word, out)
        return "bool"
    raise TypeError(f"not a condition node: {node!r}")


def _want_bool(node: Node, kind: str | None, word: str, out: list[Problem]) -> None:
    if kind not in (None, "bool"):
        out.append(Problem(f"type mismatch: {word} needs true/false, but {_describe(node)} "
                           f"is a {kind}", _pos(node)))


def _pos(node: Node) -> Pos:
    if isinstance(node, Compare):
        return _pos(node.left)
    return node.pos


def _describe(node: Node) -> str:
    if isinstance(node, Field):
        return node.name
    if isinstance(node, Literal):
        if node.type == "number":
            v = float(node.value)
            return repr(int(v)) if v.is_integer() else repr(v)
        return repr(node.value) if node.type == "string" else str(node.value).lower()
    return "the expression"
