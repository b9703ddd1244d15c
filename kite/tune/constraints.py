"""What every point of a sweep must respect: conditions in the rules' language (`ppl_delta < 0.5
AND f1 >= 0.3`: kite.yoco.rules' grammar and parser), checked against the metric names
(kite.tune.objective.metrics) when they are read (an unknown name gets a did-you-mean), and
evaluated on each point's figures; a figure a run could not measure (no load, so no
`yoco_hit_rate`) meets no constraint that reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kite.errors import BadInput
from kite.tune.objective import Objective, metrics, parse_objective


def _schema():
    from kite.yoco.signals import SignalField

    return {name: SignalField(name, "number", "", doc) for name, doc in metrics().items()}


@dataclass(frozen=True)
class Constraint:
    """One `--constraint` (or the part of `--metric` after `|`), parsed and checked."""

    text: str
    tree: object  # kite.yoco.rules.parser node

    def fields(self) -> list[str]:
        from kite.yoco.rules.compiler import fields_of

        return list(fields_of(self.tree))

    def holds(self, figures: dict) -> bool:
        return _eval(self.tree, figures) is True

    def violation(self, figures: dict) -> float:
        """0 when it holds, else how far it is from holding (> 0), in the units of the metric it
        compares (1.0 for a figure that was not measured): what Optuna's constraints read."""
        return 0.0 if self.holds(figures) else max(_distance(self.tree, figures), 1e-9)

    def why_broken(self, figures: dict) -> str:
        """`ppl_delta 0.82 (needs < 0.5)` for each comparison that fails; '' when it holds."""
        if self.holds(figures):
            return ""
        parts = _failing(self.tree, figures)
        return "; ".join(parts) if parts else f"{self.text} is false"


def parse_constraint(text: str, flag: str = "--constraint") -> Constraint:
    """Parse and check one constraint. BadInput naming the column for a syntax error (a bad
    operator gets its fix), an unknown metric (with did-you-mean) or a type error."""
    from kite.yoco.rules import ConditionSyntaxError, parse_condition
    from kite.yoco.rules.checker import check_condition

    try:
        tree = parse_condition(text)
    except ConditionSyntaxError as exc:
        raise BadInput(_at(flag, text, exc.pos, exc.message)) from None
    problems = check_condition(tree, fields=_schema(), noun="metric")
    if problems:
        raise BadInput(_at(flag, text, problems[0].pos, problems[0].message))
    return Constraint(text, tree)


def _at(flag: str, text: str, pos, message: str) -> str:
    """One line: `--constraint 'ppl_detla < 0.5': column 1: unknown metric ...`."""
    where = f"column {pos.col}" if "\n" not in text else f"line {pos.line}, column {pos.col}"
    return f"{flag} {text!r}: {where}: {message}"


def parse_metric(spec: str) -> tuple[Objective, list[Constraint]]:
    """The seed's `--metric "qps|ppl_delta<0.5"`: an objective, then constraints after `|`."""
    head, *rest = spec.split("|")
    if not head.strip():
        raise BadInput(f"--metric {spec!r}: expected OBJECTIVE|CONSTRAINT, e.g. \"qps|ppl_delta<0.5\"")
    return parse_objective(head), [parse_constraint(c, "--metric") for c in rest if c.strip()]


# ---------------------------------------------------------------------------- evaluation

def _value(node, figures: dict):
    from kite.yoco.rules.parser import Field, Literal

    if isinstance(node, Field):
        v = figures.get(node.name)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else v
    if isinstance(node, Literal):
        return node.value
    return _eval(node, figures)


_OPS = {"<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
        ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}


def _eval(node, figures: dict) -> bool | None:
    """True, False, or None where a figure it reads was not measured (three-valued logic)."""
    from kite.yoco.rules.parser import And, Compare, Literal, Not, Or

    if isinstance(node, Literal):
        return bool(node.value)
    if isinstance(node, Compare):
        a, b = _value(node.left, figures), _value(node.right, figures)
        return None if a is None or b is None else _OPS[node.op](a, b)
    if isinstance(node, Not):
        v = _eval(node.item, figures)
        return None if v is None else not v
    vals = [_eval(i, figures) for i in node.items]
    if isinstance(node, And):
        return False if False in vals else (None if None in vals else True)
    if isinstance(node, Or):
        return True if True in vals else (None if None in vals else False)
    raise TypeError(f"not a condition node: {node!r}")


def _distance(node, figures: dict) -> float:
    """How far a false condition is from true (see Constraint.violation)."""
    from kite.yoco.rules.parser import And, Compare, Not, Or

    if _eval(node, figures) is True:
        return 0.0
    if isinstance(node, Compare):
        a, b = _value(node.left, figures), _value(node.right, figures)
        if not all(isinstance(x, (int, float)) for x in (a, b)):
            return 1.0
        return abs(a - b) if node.op not in ("==", "!=") else (abs(a - b) or 1.0)
    if isinstance(node, And):
        return sum(_distance(i, figures) for i in node.items)
    if isinstance(node, Or):
        return min(_distance(i, figures) for i in node.items)
    if isinstance(node, Not):
        return 1.0
    return 1.0


def _failing(node, figures: dict) -> list[str]:
    from kite.yoco.rules.parser import And, Compare, Field, Literal

    if _eval(node, figures) is True:
        return []
    if isinstance(node, Compare):
        def show(n):
            if isinstance(n, Field):
                v = _value(n, figures)
                return f"{n.name} {'not measured' if v is None else format(v, '.4g')}"
            return format(n.value, "g") if isinstance(n, Literal) and n.type == "number" else str(getattr(n, "value", "?"))
        left, right = node.left, node.right
        if isinstance(left, Field):
            return [f"{show(left)} (needs {node.op} {show(right)})"]
        return [f"{show(right)} (needs {show(left)} {node.op} it)"]
    if isinstance(node, And):
        return [p for i in node.items for p in _failing(i, figures)]
    return []
