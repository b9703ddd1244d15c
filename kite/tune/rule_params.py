"""A rule set's thresholds as tunable parameters: `rules.<rule>.<field>` is the number a rule's
condition compares `<field>` with (`rules.confident_label.label_entropy` is the 0.1 of
`label_entropy < 0.1`, the label-entropy cut). A field compared with a number more than once in
one rule is `rules.<rule>.<field>#2` for its second comparison, and so on.

A point with other thresholds runs on a copy of the rule file with those numbers replaced,
written to the sweep's folder and checked like any rule file before it is used.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from kite.errors import BadInput
from kite.tune.space import REQUEST, Param

PREFIX = "rules."


@dataclass(frozen=True, slots=True)
class Threshold:
    param: str  # rules.<rule>.<field>[#n]
    rule: str
    index: int  # the rule's position in the file
    offset: int  # where the number is in the condition text, and its length
    length: int
    value: float
    field: str
    op: str


def _literal_offset(text: str, line: int, col: int) -> int:
    lines = text.split("\n")
    return sum(len(s) + 1 for s in lines[: line - 1]) + col - 1


def thresholds(rules_path: str | Path) -> list[Threshold]:
    """Every `field OP number` comparison of the rule file, named as a parameter."""
    import yaml

    from kite.yoco.rules import load_rules, parse_condition
    from kite.yoco.rules.parser import And, Compare, Field, Literal, Not, Or
    from kite.yoco.signals import SIGNAL_FIELDS

    load_rules(rules_path)  # a rule file that does not load is refused here, with its errors
    data = yaml.safe_load(Path(rules_path).read_text(encoding="utf-8"))
    out: list[Threshold] = []
    for index, rule in enumerate(data["rules"]):
        cond = rule.get("condition", True)
        if not isinstance(cond, str):
            continue
        found: list[tuple[Field, Literal, str]] = []

        def walk(node) -> None:
            if isinstance(node, Compare):
                for a, b in ((node.left, node.right), (node.right, node.left)):
                    if isinstance(a, Field) and isinstance(b, Literal) and b.type == "number":
                        found.append((a, b, node.op))
            elif isinstance(node, (And, Or)):
                for item in node.items:
                    walk(item)
            elif isinstance(node, Not):
                walk(node.item)

        walk(parse_condition(cond))
        counts: dict[str, int] = {}
        for fld, lit, op in found:
            if SIGNAL_FIELDS[fld.name].type != "number":
                continue
            counts[fld.name] = counts.get(fld.name, 0) + 1
            n = counts[fld.name]
            name = f"{PREFIX}{rule['name']}.{fld.name}" + (f"#{n}" if n > 1 else "")
            out.append(Threshold(name, rule["name"], index, _literal_offset(cond, lit.pos.line, lit.pos.col),
                                 lit.pos.length, float(lit.value), fld.name, op))
    return out


def rule_params(rules_path: str | Path) -> list[Param]:
    """The rule file's thresholds as parameters (acting on the request: states are reused)."""
    from kite.yoco.signals import SIGNAL_FIELDS

    out = []
    for t in thresholds(rules_path):
        unit = SIGNAL_FIELDS[t.field].unit
        high = 1.0 if "0-1" in unit else None
        low = 0.0 if unit in ("bits", "GB", "tasks per core") or high is not None else None
        out.append(Param(t.param, "float", REQUEST,
                         f"rule {t.rule!r}: the number `{t.field} {t.op}` compares with ({unit})",
                         low=low, high=high, current=t.value, source=str(rules_path)))
    return out


def write_variant(rules_path: str | Path, values: dict[str, float], folder: Path) -> Path:
    """A copy of the rule file with the thresholds in `values` replaced (other keys ignored),
    written atomically into `folder`, checked, and named by its content. The copy is the file's
    data re-written as YAML (its comments are not kept; a header says what it is)."""
    import yaml

    from kite.atomic import write_text
    from kite.yoco.rules import load_rules

    mine = {k: v for k, v in values.items() if k.startswith(PREFIX)}
    by_name = {t.param: t for t in thresholds(rules_path)}
    unknown = sorted(set(mine) - set(by_name))
    if unknown:
        raise BadInput(f"{unknown[0]}: {rules_path} has no such threshold")
    data = yaml.safe_load(Path(rules_path).read_text(encoding="utf-8"))
    edits: dict[int, list[tuple[Threshold, float]]] = {}
    for name, value in mine.items():
        t = by_name[name]
        edits.setdefault(t.index, []).append((t, value))
    for index, items in edits.items():
        cond = data["rules"][index]["condition"]
        for t, value in sorted(items, key=lambda tv: -tv[0].offset):  # from the end: offsets stay valid
            cond = cond[:t.offset] + f"{float(value):g}" + cond[t.offset + t.length:]
        data["rules"][index]["condition"] = cond
    what = ", ".join(f"{k} = {v:g}" for k, v in sorted(mine.items()))
    body = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000)
    text = f"# {Path(rules_path).name} with {what} (written by kite tune)\n{body}"
    path = folder / f"{Path(rules_path).stem}.{hashlib.sha256(text.encode()).hexdigest()[:8]}.yaml"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_text(path, text)
    load_rules(path)
    return path
