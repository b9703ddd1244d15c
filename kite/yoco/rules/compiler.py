"""Compile a checked condition once into one Python function of a `Signals`.

The function's source is generated from the checked AST: field names come only from the signal
schema and constants are written with `repr`, so nothing from the rule file runs as code. One
flat expression per rule (`s.intent_entropy > 5.2 and s.hardware_watermark.gpu_mem < 0.85`)
costs about one attribute read per comparison, which is what keeps a decision in microseconds
(benchmarks/yoco_decision.py; docs/PERFORMANCE.md).
"""

from __future__ import annotations

from typing import Callable

from kite.yoco.rules.parser import And, Compare, Field, Literal, Node, Not, Or
from kite.yoco.signals import SIGNAL_FIELDS

Condition = Callable[[object], bool]


def condition_source(node: Node) -> str:
    """The Python expression a checked condition compiles to, over the name `s`."""
    if isinstance(node, Field):
        if node.name not in SIGNAL_FIELDS:  # the checker rejects these; never emit them
            raise ValueError(f"unchecked field {node.name!r}")
        return "s." + node.name
    if isinstance(node, Literal):
        if node.type == "number":
            return repr(float(node.value))
        if node.type == "string":
            return repr(str(node.value))
        return "True" if node.value else "False"
    if isinstance(node, Compare):
        return f"({condition_source(node.left)} {node.op} {condition_source(node.right)})"
    if isinstance(node, And):
        return "(" + " and ".join(condition_source(i) for i in node.items) + ")"
    if isinstance(node, Or):
        return "(" + " or ".join(condition_source(i) for i in node.items) + ")"
    if isinstance(node, Not):
        return f"(not {condition_source(node.item)})"
    raise TypeError(f"not a condition node: {node!r}")


def compile_condition(node: Node, name: str = "condition") -> Condition:
    """A function `f(signals) -> bool` for a checked condition."""
    src = f"lambda s: {condition_source(node)}"  # the checker made it a bool
    code = compile(src, f"<yoco rule {name!r}>", "eval")
    return eval(code, {"__builtins__": {}})  # noqa: S307 - generated from the AST


def fields_of(node: Node) -> tuple[str, ...]:
    """The signal fields a condition reads, in order of first use (for plan reasons)."""
    seen: dict[str, None] = {}

    def walk(n: Node) -> None:
        if isinstance(n, Field):
            seen.setdefault(n.name)
        elif isinstance(n, Compare):
            walk(n.left)
            walk(n.right)
        elif isinstance(n, (And, Or)):
            for i in n.items:
                walk(i)
        elif isinstance(n, Not):
            walk(n.item)

    walk(node)
    return tuple(seen)
