"""Load a rule file: YAML → checked conditions and actions → compiled `RuleSet`.

Every error in the file is collected, each with its file, line and column (a condition's
errors are mapped from their place in the condition text to the file), and the whole set is
compiled before anything is returned: a bad file raises `RuleSetError`, never a half-built set.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml
from yaml.nodes import MappingNode, Node as YamlNode, ScalarNode, SequenceNode

from kite.errors import BadInput
from kite.yoco.rules.actions import ACTION_KEYS, Action, LayerRun, check_action, layer_problems
from kite.yoco.rules.checker import check_condition
from kite.yoco.rules.compiler import compile_condition, condition_source, fields_of
from kite.yoco.rules.errors import RuleError, RuleSetError, Span
from kite.yoco.rules.parser import ConditionSyntaxError, Pos, parse_condition
from kite.yoco.signals import suggest

RULE_KEYS = ("name", "condition", "action", "description")
TOP_KEYS = ("rules", "version", "description")


@dataclass(frozen=True, slots=True)
class Rule:
    """One compiled rule. `test(signals) -> bool`; `is_default` when its condition is `true`."""

    name: str
    condition: str
    action: Action
    test: Callable[[Any], bool] = field(repr=False, compare=False)
    fields: tuple[str, ...] = ()
    getters: tuple[Callable[[Any], Any], ...] = field(default=(), repr=False, compare=False)
    line: int = 0
    is_default: bool = False
    # the runs its `layers:` names, each placed in the file (`where` is a Span)
    layer_runs: tuple[LayerRun, ...] = field(default=(), repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class RuleSet:
    """A compiled, immutable rule set: first match wins; the last rule is the default."""

    rules: tuple[Rule, ...]
    sha256: str
    source: str
    loaded_at: float  # time.time() when it compiled
    version: str
    labels: tuple[str, ...] | None = None
    n_layers: int | None = None

    def match(self, signals: Any) -> Rule:
        """The first rule whose condition holds (the default always does)."""
        for rule in self.rules:
            if rule.test(signals):
                return rule
        return self.rules[-1]  # unreachable for a checked set: the default matches

    def for_layers(self, n_layers: int) -> "RuleSet":
        """This set checked against a model of `n_layers` layers (a set compiled before its model
        loaded is checked once the model is known, not compiled again): itself when it was compiled
        for that count, else a copy that records it. Raises RuleSetError with the errors compiling
        the file with `n_layers` gives (`layer_errors`): one per run of layers the model lacks."""
        if self.n_layers == n_layers:
            return self
        errors = layer_errors((run for rule in self.rules for run in rule.layer_runs), n_layers, self.source)
        if errors:
            raise RuleSetError(errors)
        return replace(self, n_layers=n_layers)

    def info(self) -> dict[str, Any]:
        return {"source": self.source, "version": self.version, "sha256": self.sha256,
                "loaded_at": self.loaded_at, "rules": len(self.rules),
                "default_rule": self.rules[-1].name}


def layer_errors(runs: Iterable[LayerRun], n_layers: int, source: str) -> list[RuleError]:
    """The one check of `layers:` against a model: an error for each run (placed in the file: its
    `where` is a Span) naming a layer a model of `n_layers` layers lacks. A file compiled with the
    count and a compiled set checked later (`RuleSet.for_layers`) both come here: one list."""
    errors = [p.where.error(source, p.message) for p in layer_problems(runs, n_layers)]
    return sorted(errors, key=lambda e: (e.line, e.col))


def version_of(path: str | os.PathLike[str]) -> str:
    """`yoco_rules_v2.yaml` → `v2`; `yoco_rules.yaml` → `v1`; any other name → its stem."""
    stem = Path(path).stem
    head, _, tail = stem.rpartition("_")
    if head and tail[:1] == "v" and tail[1:].isdigit():
        return tail
    return "v1" if stem == "yoco_rules" else stem


def load_rules(path: str | os.PathLike[str], labels: Iterable[str] | None = None,
               n_layers: int | None = None) -> RuleSet:
    """Read, check and compile a rule file. Raises RuleSetError (BadInput) with every error."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise BadInput(f"{p}: no such rule file") from None
    except OSError as exc:
        raise BadInput(f"{p}: cannot read ({exc.strerror})") from None
    return parse_rules(data, str(p), labels=labels, n_layers=n_layers, version=version_of(p))


def parse_rules(data: bytes | str, source: str = "<rules>", labels: Iterable[str] | None = None,
                n_layers: int | None = None, version: str | None = None) -> RuleSet:
    """Check and compile rule YAML held in memory (see `load_rules`)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RuleSetError([RuleError(source, 1, 1, f"not UTF-8 text (byte {exc.start})")]) from None
    builder = _Builder(source, text, None if labels is None else list(labels), n_layers)
    rules = builder.build()
    if builder.errors:
        raise RuleSetError(sorted(builder.errors, key=lambda e: (e.line, e.col)))
    _warm(rules)
    return RuleSet(tuple(rules), hashlib.sha256(raw).hexdigest(), source, time.time(),
                   version or Path(source).stem,
                   None if labels is None else tuple(builder.labels or ()), n_layers)


class _Builder:
    def __init__(self, source: str, text: str, labels: list[str] | None, n_layers: int | None):
        self.source, self.text, self.labels, self.n_layers = source, text, labels, n_layers
        self.lines = text.split("\n")
        self.errors: list[RuleError] = []
        self._names: dict[str, int] = {}  # rule name -> line of its first use
        self._constructor = yaml.SafeLoader("")

    # -- errors -------------------------------------------------------------------------------
    def error(self, line: int, col: int, message: str, length: int = 1) -> None:
        src = self.lines[line - 1].rstrip("\r") if 0 < line <= len(self.lines) else ""
        self.errors.append(RuleError(self.source, line, col, message, src, length))

    def at(self, node: YamlNode, message: str, offset: int = 0, length: int | None = None) -> None:
        where = self.span(node)
        self.error(where.line, where.col + offset, message, where.length if length is None else max(1, length))

    def span(self, node: YamlNode) -> Span:
        """Where `node` is written (a node over several lines: its first character)."""
        m = node.start_mark
        length = (node.end_mark.index - m.index) if m.line == node.end_mark.line else 1
        src = self.lines[m.line].rstrip("\r") if m.line < len(self.lines) else ""
        return Span(m.line + 1, m.column + 1, max(1, length), src)

    # -- walk ---------------------------------------------------------------------------------
    def build(self) -> list[Rule]:
        try:
            root = yaml.compose(self.text, Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            msg = f"YAML syntax: {exc.problem or exc.context}"
            if exc.context and exc.problem:
                msg = f"YAML syntax: {exc.problem} ({exc.context})"
            self.error((mark.line + 1) if mark else 1, (mark.column + 1) if mark else 1, msg)
            return []
        except yaml.YAMLError as exc:
            self.error(1, 1, f"YAML: {exc}")
            return []
        if root is None:
            self.error(1, 1, "empty rule file: expected `rules:` with a list of rules")
            return []
        if not isinstance(root, MappingNode):
            self.at(root, "expected a mapping with a `rules:` list at the top", length=1)
            return []
        rules_node = None
        for key, value in root.value:
            k = self.value(key)
            if k == "rules":
                rules_node = value
            elif k not in TOP_KEYS:
                self.unknown_key(key, k, TOP_KEYS, "top-level key")
        if rules_node is None:
            self.error(1, 1, "no `rules:` list in the file")
            return []
        if not isinstance(rules_node, SequenceNode) or not rules_node.value:
            self.at(rules_node, "`rules:` must be a non-empty list of {name, condition, action}",
                    length=1)
            return []
        rules = [r for r in (self.rule(n, i) for i, n in enumerate(rules_node.value)) if r]
        self.check_default(rules_node, rules)
        return rules

    def rule(self, node: YamlNode, index: int) -> Rule | None:
        if not isinstance(node, MappingNode):
            self.at(node, f"rule {index + 1}: expected a mapping with name, condition and action",
                    length=1)
            return None
        parts: dict[str, tuple[YamlNode, YamlNode]] = {}
        for key, value in node.value:
            k = self.value(key)
            if k in parts:
                self.at(key, f"duplicate key {k!r} in this rule")
            elif k not in RULE_KEYS:
                self.unknown_key(key, k, RULE_KEYS, "rule key")
            parts[k] = (key, value)
        ok = True
        name = f"rule {index + 1}"
        if "name" not in parts:
            self.at(node, f"rule {index + 1} has no name", length=1)
            ok = False
        else:
            name_node = parts["name"][1]
            value = self.value(name_node)
            if not isinstance(value, str) or not value.strip():
                self.at(name_node, "name: expected a non-empty string")
                ok = False
            else:
                name = value
                if name in self._names:
                    self.at(name_node, f"duplicate rule name {name!r} (first at line "
                                       f"{self._names[name]})")
                    ok = False
                self._names.setdefault(name, name_node.start_mark.line + 1)
        test, fields, cond_text, is_default = self.condition(parts.get("condition"), name)
        ok = ok and test is not None
        action, runs = None, ()
        if "action" not in parts:
            self.at(node, f"rule {name!r} has no action", length=1)
        else:
            action, runs = self.action(*parts["action"])
        if not ok or action is None:
            return None
        getters = tuple(_getter(f) for f in fields)
        return Rule(name, cond_text, action, test, fields, getters, node.start_mark.line + 1,
                    is_default, runs)

    def condition(self, pair, name):
        if pair is None:
            return (lambda s: True), (), "true", True
        key, node = pair
        value = self.value(node)
        if value is True:
            return (lambda s: True), (), "true", True
        if not isinstance(value, str):
            self.at(node, f"condition: expected a condition string, got {value!r}")
            return None, (), "", False
        try:
            tree = parse_condition(value)
        except ConditionSyntaxError as exc:
            self.at_condition(node, exc.pos, exc.message)
            return None, (), value, False
        problems = check_condition(tree, self.labels)
        for p in problems:
            self.at_condition(node, p.pos, p.message)
        if problems:
            return None, (), value, False
        is_default = condition_source(tree) == "True"
        return compile_condition(tree, name), fields_of(tree), " ".join(value.split()), is_default

    def action(self, key: YamlNode, node: YamlNode) -> tuple[Action | None, tuple[LayerRun, ...]]:
        """The checked action (None if it has errors) and the runs its `layers:` names, placed in
        the file. With the model's layer count known, the runs it lacks are errors (`layer_errors`);
        they leave the action standing, so the rest of the file is checked as without the count."""
        data: dict[Any, Any] = {}
        where: dict[Any, YamlNode] = {"action": key}
        if isinstance(node, MappingNode):
            for k_node, v_node in node.value:
                k = self.value(k_node)
                data[k] = self.value(v_node)
                # Point at the value of a known key, at the key itself when it is unknown.
                where[k] = v_node if k in ACTION_KEYS else k_node
                if isinstance(v_node, SequenceNode):
                    for i, item in enumerate(v_node.value):
                        where[(k, i)] = item
        else:
            data = self.value(node)
            where["action"] = node
        action, problems, runs = check_action(data, self.labels)
        for p in problems:
            self.errors.append(self.in_action(where.get(p.where, where["action"]), p.offset,
                                              p.length).error(self.source, p.message))
        placed = tuple(LayerRun(r.lo, r.hi, self.in_action(where.get(r.where, where["action"]), r.offset,
                                                           r.length)) for r in runs)
        if self.n_layers is not None:
            self.errors.extend(layer_errors(placed, self.n_layers, self.source))
        return action, placed

    def in_action(self, node: YamlNode, offset: int, length: int) -> Span:
        """Where `offset`/`length` inside an action's value node are in the file (past an opening
        quote; the whole node when they name no part of it)."""
        quote = 1 if isinstance(node, ScalarNode) and node.style in ("'", '"') else 0
        where = self.span(node)
        if not (offset or length > 1):
            return replace(where, col=where.col + quote)
        return replace(where, col=where.col + offset + quote, length=max(1, length))

    def check_default(self, rules_node: SequenceNode, rules: list[Rule]) -> None:
        if self.errors and len(rules) < len(rules_node.value):
            # A rule with errors may well be the default; don't guess, report what we know.
            last = rules_node.value[-1]
            if not rules or rules[-1].line != last.start_mark.line + 1:
                return
        defaults = [r for r in rules if r.is_default]
        for d in defaults:
            later = [r for r in rules if r.line > d.line]
            if later:
                node = next(n for n in rules_node.value if n.start_mark.line + 1 == later[0].line)
                self.at(node, f"rule {later[0].name!r} can never match: the default rule "
                              f"{d.name!r} (line {d.line}) comes before it", length=1)
                return
        if not defaults:
            last = rules_node.value[-1]
            name = rules[-1].name if rules else "the last rule"
            self.at(last, f"missing default rule: {name!r} has a condition, so some requests "
                          f"match nothing; end the list with a rule whose condition is `true` "
                          f"(or has no condition)", length=1)

    # -- helpers ------------------------------------------------------------------------------
    def value(self, node: YamlNode) -> Any:
        try:
            return self._constructor.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            self.at(node, f"YAML: {exc}")
            return None

    def unknown_key(self, key_node: YamlNode, k: Any, known: tuple[str, ...], what: str) -> None:
        hint = suggest(str(k), known)
        self.at(key_node, f"unknown {what} {k!r}" + (f"; did you mean {hint!r}?" if hint else
                                                       "; expected one of " + ", ".join(known)))

    def at_condition(self, node: ScalarNode, pos: Pos, message: str) -> None:
        line, col = self.map_condition(node, pos)
        self.error(line, col, message, pos.length)

    def map_condition(self, node: ScalarNode, pos: Pos) -> tuple[int, int]:
        """A (line, col) inside the condition string → 1-based (line, col) in the file."""
        start = node.start_mark
        if node.style == "|":
            # Literal block: value line i is file line start+i, under the block's indent.
            body = self.lines[start.line + pos.line] if start.line + pos.line < len(self.lines) else ""
            first = next((l for l in self.lines[start.line + 1: node.end_mark.line + 1] if l.strip()),
                         body)
            indent = len(first) - len(first.lstrip(" "))
            return start.line + pos.line + 1, indent + pos.col
        quote = 1 if node.style in ("'", '"') else 0
        if start.line == node.end_mark.line and pos.line == 1:
            return start.line + 1, start.column + 1 + quote + pos.col - 1
        # Folded or multi-line plain/quoted: lines were joined with spaces. Walk the source
        # segments to find where the flat offset lands.
        value_lines = str(node.value).split("\n")
        offset = sum(len(l) + 1 for l in value_lines[: pos.line - 1]) + pos.col - 1
        first_line = start.line + (1 if node.style == ">" else 0)
        segments = []
        for i in range(first_line, min(node.end_mark.line + 1, len(self.lines))):
            src = self.lines[i]
            col0 = (start.column + quote) if (i == start.line and node.style != ">") else \
                len(src) - len(src.lstrip(" "))
            text = src[col0:].rstrip()
            if text:
                segments.append((i, col0, len(text)))
        flat = 0
        for i, col0, n in segments:
            if offset <= flat + n:
                return i + 1, col0 + 1 + (offset - flat)
            flat += n + 1
        return start.line + 1, start.column + 1


def _warm(rules: list[Rule]) -> None:
    """Run each new condition a few times so CPython's adaptive interpreter has specialized its
    code before the first request does (3.11+ quickens a code object after ~8 calls)."""
    from kite.yoco.signals import Signals

    probe = Signals(state_health_score=0.5)
    for rule in rules:
        for _ in range(16):
            rule.test(probe)
        for get in rule.getters:
            get(probe)


def _getter(name: str) -> Callable[[Any], Any]:
    from operator import attrgetter

    return attrgetter(name)
