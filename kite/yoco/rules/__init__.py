"""YOCO rules: YAML `rules: [{name, condition, action}]`, conditions in a small Lark language,
checked against the signal schema and compiled to functions when the file loads.

`load_rules(path)` → `RuleSet` (or `RuleSetError` with every error); `ActiveRules` swaps whole
sets on reload. The language is documented in docs/rules-dsl.md.
"""

from __future__ import annotations

from kite.yoco.rules.actions import PRECISIONS, QUERY_LABEL, Action, parse_layer_spec
from kite.yoco.rules.active import ActiveRules, default_rules_path, resolve_rules_path
from kite.yoco.rules.errors import RuleError, RuleSetError
from kite.yoco.rules.parser import ConditionSyntaxError, parse_condition
from kite.yoco.rules.ruleset import Rule, RuleSet, load_rules, parse_rules, version_of

__all__ = [
    "PRECISIONS", "QUERY_LABEL", "Action", "ActiveRules", "default_rules_path", "resolve_rules_path", "ConditionSyntaxError", "Rule",
    "RuleError", "RuleSet", "RuleSetError", "load_rules", "parse_condition", "parse_layer_spec",
    "parse_rules", "version_of",
]
