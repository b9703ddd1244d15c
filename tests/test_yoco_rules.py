"""The rule language: precedence, every error message (file:line:col + caret), whole-set loads."""

from __future__ import annotations

import textwrap

import pytest

from kite.errors import BadInput
from kite.yoco.rules import ActiveRules, RuleSetError, load_rules, parse_condition, parse_rules
from kite.yoco.rules.compiler import compile_condition, condition_source
from kite.yoco.rules.parser import And, ConditionSyntaxError, Not, Or
from kite.yoco.signals import HardwareWatermark, Signals


DEFAULT = "- name: default\n  action: {load_all_clusters: true}\n"


def rules(body: str, default: bool = True) -> str:
    """A rule file from an indented YAML list, closed by a default rule."""
    text = textwrap.dedent(body).strip("\n") + "\n" + (DEFAULT if default else "")
    return "rules:\n" + textwrap.indent(text, "  ")


def errors_of(text: str, **kw) -> list:
    with pytest.raises(RuleSetError) as info:
        parse_rules(text, "r.yaml", **kw)
    return info.value.errors


def one_error(text: str, **kw):
    errs = errors_of(text, **kw)
    assert len(errs) == 1, [e.render() for e in errs]
    return errs[0]


# -- grammar -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, shape", [
    ("a > 1 OR b > 1 AND c > 1", "(a or (b and c))"),
    ("NOT a > 1 AND b > 1", "((not a) and b)"),
    ("NOT (a > 1 AND b > 1)", "(not (a and b))"),
    ("(a > 1 OR b > 1) AND c > 1", "((a or b) and c)"),
    ("a > 1 or not b > 1 and c > 1", "(a or ((not b) and c))"),
    ("a > 1 AND b > 1 AND c > 1 OR d > 1", "((a and b and c) or d)"),
])
def test_precedence(text, shape):
    def show(n):
        if isinstance(n, Or):
            return "(" + " or ".join(show(i) for i in n.items) + ")"
        if isinstance(n, And):
            return "(" + " and ".join(show(i) for i in n.items) + ")"
        if isinstance(n, Not):
            return f"(not {show(n.item)})"
        return n.left.name

    assert show(parse_condition(text)) == shape


def test_precedence_by_evaluation():
    """Truth tables decide: OR binds loosest, NOT tightest, parentheses override."""
    def run(cond: str, e: float, g: float, spike: bool) -> bool:
        f = compile_condition(parse_condition(cond))
        return f(Signals(intent_entropy=e, hardware_watermark=HardwareWatermark(gpu_mem=g, spike=spike)))

    for e in (1.0, 6.0):
        for g in (0.5, 0.95):
            for spike in (False, True):
                A, B, C = e > 5, g > 0.9, spike
                assert run("intent_entropy > 5 OR hardware_watermark.gpu_mem > 0.9 AND "
                           "hardware_watermark.spike", e, g, spike) == (A or (B and C))
                assert run("(intent_entropy > 5 OR hardware_watermark.gpu_mem > 0.9) AND "
                           "hardware_watermark.spike", e, g, spike) == ((A or B) and C)
                assert run("NOT intent_entropy > 5 AND hardware_watermark.spike", e, g, spike) \
                    == ((not A) and C)
                assert run("NOT (intent_entropy > 5 AND hardware_watermark.spike)", e, g, spike) \
                    == (not (A and C))
                assert run("not not hardware_watermark.spike or false", e, g, spike) == C


@pytest.mark.parametrize("op", ["<", "<=", ">", ">=", "==", "!="])
def test_every_operator(op):
    f = compile_condition(parse_condition(f"intent_entropy {op} 5"))
    for v in (4.0, 5.0, 6.0):
        assert f(Signals(intent_entropy=v)) == eval(f"{v} {op} 5")


def test_values_strings_booleans_and_keywords_any_case():
    f = compile_condition(parse_condition(
        "query_label == '违约责任' and hardware_watermark.spike == TRUE And label_entropy <= .5"))
    assert f(Signals(query_label="违约责任", label_entropy=0.5,
                     hardware_watermark=HardwareWatermark(spike=True)))
    assert not f(Signals(query_label="管辖法院", hardware_watermark=HardwareWatermark(spike=True)))
    assert condition_source(parse_condition("intent_entropy > -1.5e1")) == "(s.intent_entropy > -15.0)"


# -- errors: message, place, caret ------------------------------------------------------------------

def test_unknown_field_with_did_you_mean_line_col_caret():
    text = rules("""
        - name: vague
          condition: intent_entropi > 5.2
          action: {load_all_clusters: true}""")
    e = one_error(text)
    assert e.header == "r.yaml:3:16: unknown field 'intent_entropi'; did you mean 'intent_entropy'?"
    assert e.render().splitlines()[1:] == ["        condition: intent_entropi > 5.2",
                                           "                   ^~~~~~~~~~~~~~"]


def test_unknown_dotted_field_suggests_the_dotted_name():
    e = one_error(rules("""
        - name: mem
          condition: hardware_watermark.gpu_memory > 0.9
          action: {skip: true}"""))
    assert "did you mean 'hardware_watermark.gpu_mem'?" in e.message
    e = one_error(rules("""
        - name: mem
          condition: gpu_mem > 0.9
          action: {skip: true}"""))
    assert "did you mean 'hardware_watermark.gpu_mem'?" in e.message


@pytest.mark.parametrize("op, fix, col", [("=>", ">=", 31), ("=", "==", 31), ("=<", "<=", 31),
                                          ("<>", "!=", 31), ("&&", "AND", 31)])
def test_bad_operator(op, fix, col):
    cond = f"intent_entropy {op} 5" if op != "&&" else "intent_entropy && 5"
    e = one_error(rules(f"""
        - name: x
          condition: {cond}
          action: {{skip: true}}"""))
    assert e.line == 3 and e.col == col
    assert e.message == f"bad operator {op!r}; did you mean {fix!r}?"
    assert e.render().splitlines()[2].endswith("^" + "~" * (len(op) - 1))


def test_bad_operator_inside_quoted_and_block_conditions():
    text = 'rules:\n  - name: q\n    condition: "intent_entropy = 5"\n    action: {skip: true}\n' \
           "  - name: b\n    condition: |\n      intent_entropy > 5\n      AND label_entropy => 1\n" \
           "    action: {skip: true}\n" + textwrap.indent(DEFAULT, "  ")
    errs = errors_of(text)
    assert [(e.line, e.col, e.message) for e in errs] == [
        (3, 32, "bad operator '='; did you mean '=='?"),
        (8, 25, "bad operator '=>'; did you mean '>='?"),
    ]
    lines = text.split("\n")
    for e in errs:  # the caret sits under the operator in the file's own line
        assert lines[e.line - 1][e.col - 1] == "="


@pytest.mark.parametrize("cond", [
    "    condition: intent_entropy > 5 AND\n      label_entropy => 1\n",
    '    condition: "intent_entropy > 5 AND\n      label_entropy => 1"\n',
])
def test_multiline_plain_and_quoted_conditions_map_to_their_file_line(cond):
    text = "rules:\n  - name: m\n" + cond + "    action: {skip: true}\n" + textwrap.indent(DEFAULT, "  ")
    e = one_error(text)
    assert (e.line, e.col) == (4, 21) and text.split("\n")[3][20:22] == "=>"


def test_folded_condition_maps_to_its_file_line():
    text = ("rules:\n  - name: f\n    condition: >\n      intent_entropy > 5 and\n"
            "      query_novelty >> 1\n    action: {skip: true}\n" + textwrap.indent(DEFAULT, "  "))
    e = one_error(text)
    assert (e.line, e.col) == (5, 21) and text.split("\n")[4][20:22] == ">>"
    assert e.message == "bad operator '>>'; comparisons are < <= > >= == !="


@pytest.mark.parametrize("cond, message, col", [
    ('query_label > 5', "type mismatch: query_label is a string; '>' compares numbers", 16),
    ('intent_entropy == "high"', "type mismatch: cannot compare intent_entropy (number) with "
                                 "'high' (string)", 34),
    ('hardware_watermark.spike < 1', "type mismatch: hardware_watermark.spike is a bool; '<' "
                                     "compares numbers", 16),
    ('intent_entropy AND query_novelty > 0.5', "type mismatch: AND needs true/false, but "
                                               "intent_entropy is a number", 16),
    ('intent_entropy', "the condition is a number, not true/false: compare it "
                       "(e.g. `intent_entropy > 0`)", 16),
])
def test_type_mismatch(cond, message, col):
    e = one_error(rules(f"""
        - name: t
          condition: {cond}
          action: {{skip: true}}"""))
    assert (e.line, e.col, e.message) == (3, col, message)


def test_unknown_label_in_condition_and_action():
    text = rules("""
        - name: l
          condition: query_label == "违约责"
          action: {load_cluster: 管辖法, precision: int8}""")
    errs = errors_of(text, labels=["违约责任", "管辖法院"])
    assert [(e.line, e.col) for e in errs] == [(3, 31), (4, 28)]
    assert errs[0].message == ("unknown label '违约责'; did you mean '违约责任'? "
                               "(the state's labels: 违约责任, 管辖法院)")
    assert errs[1].message.startswith("unknown label '管辖法'; did you mean '管辖法院'?")
    parse_rules(text, "r.yaml")  # without the state's labels nothing is checked


def test_bad_precision_and_layers_out_of_range():
    text = rules("""
        - name: p
          condition: intent_entropy > 5
          action:
            load_all_clusters: true
            precision: fp12
            layers: "12-40"
        - name: q
          condition: intent_entropy > 6
          action: {load_all_clusters: true, layers: [3, 30]}""")
    errs = errors_of(text, n_layers=30)
    assert [(e.line, e.col) for e in errs] == [(6, 18), (7, 16), (10, 51)]
    assert errs[0].message.startswith("bad precision 'fp12': choose one of fp32, fp16, bf16, fp8, "
                                      "int8, int4")
    assert errs[1].message == "layer 40 is out of range 0-29 (the model has 30 layers)"
    assert errs[1].render().splitlines()[2].strip() == "^~~~~"
    assert errs[2].message.startswith("layer 30 is out of range 0-29")
    assert parse_rules(text.replace("fp12", "fp8"), "r.yaml")  # layers unchecked without n_layers


LAYERS_PAST_3 = rules("""
    - name: p
      condition: intent_entropy > 5
      action: {load_all_clusters: true, layers: "1-40"}
    - name: q
      condition: intent_entropy > 6
      action: {load_all_clusters: true, layers: [0, 2]}""")


def test_a_set_compiled_before_the_model_loads_is_checked_against_its_layers_without_recompiling():
    rs = parse_rules(LAYERS_PAST_3, "r.yaml")  # compiled with no model: layers unchecked
    assert rs.n_layers is None
    assert rs.for_layers(41).n_layers == 41 and rs.for_layers(41).rules == rs.rules
    with pytest.raises(RuleSetError) as info:
        rs.for_layers(3)
    (err,) = info.value.errors
    assert [err] == errors_of(LAYERS_PAST_3, n_layers=3)  # the error compiling with the count gives
    assert err.message == "layer 40 is out of range 0-2 (the model has 3 layers)"
    _, source, caret = err.render().splitlines()
    assert caret.index("^") == source.index('1-40') and caret.strip() == "^~~~"  # under the run
    checked = parse_rules(LAYERS_PAST_3.replace("1-40", "1-2"), "r.yaml", n_layers=3)
    assert checked.for_layers(3) is checked  # already checked for that count: nothing to do


LAYERS_AND_MORE = rules("""
    - name: early_default
      action: {load_all_clusters: true, layers: "1,40-50,60"}
    - name: p
      condition: intent_entropy > 5
      action: {load_cluster: [a, b], layers: [2, 31]}
    - name: q
      condition: intent_entropi > 6
      action: {load_all_clusters: true, precision: fp12, layers: "29-30"}""")


def test_the_layer_count_adds_its_own_errors_and_changes_no_other():
    """One file, one list: compiled with a model's layer count, a file gets exactly the errors it
    gets without it plus one per run of layers the model lacks (a rule whose layers the model
    lacks still stands for the other checks), and a set compiled without the count and checked
    later gets those same errors."""
    without = errors_of(LAYERS_AND_MORE)
    with_count = errors_of(LAYERS_AND_MORE, n_layers=30)
    layer_errors = [e for e in with_count if e not in without]
    assert sorted(without + layer_errors, key=lambda e: (e.line, e.col)) == with_count
    assert [(e.line, e.message) for e in layer_errors] == [
        (3, "layer 40 is out of range 0-29 (the model has 30 layers)"),
        (3, "layer 60 is out of range 0-29 (the model has 30 layers)"),
        (6, "layer 31 is out of range 0-29 (the model has 30 layers)"),
        (9, "layer 30 is out of range 0-29 (the model has 30 layers)")]
    assert any("can never match: the default rule 'early_default'" in e.message for e in with_count)
    only_layers = (LAYERS_AND_MORE.replace("intent_entropi", "intent_entropy").replace(", precision: fp12", "")
                   .replace("- name: early_default\n", "- name: early\n    condition: intent_entropy > 1\n"))
    rs = parse_rules(only_layers, "r.yaml")  # compiles: nothing else is wrong
    with pytest.raises(RuleSetError) as info:
        rs.for_layers(30)
    assert info.value.errors == errors_of(only_layers, n_layers=30) and len(info.value.errors) == 4


def test_an_empty_layer_list_is_an_error():
    e = one_error(rules("""
        - name: p
          condition: intent_entropy > 5
          action: {load_all_clusters: true, layers: []}"""))
    assert e.message.startswith("layers: an empty list loads into no layer")


def test_active_rules_hold_only_a_set_checked_against_their_layer_count():
    with pytest.raises(RuleSetError, match="layer 40 is out of range 0-2"):
        ActiveRules(parse_rules(LAYERS_PAST_3, "r.yaml"), n_layers=3)
    active = ActiveRules(parse_rules(LAYERS_PAST_3.replace("1-40", "1-2"), "r.yaml"), n_layers=3)
    assert active.current.n_layers == 3


def test_missing_default_rule():
    e = one_error(rules("""
        - name: only
          condition: intent_entropy > 5
          action: {load_all_clusters: true}""", default=False))
    assert e.line == 2 and e.message.startswith("missing default rule: 'only' has a condition")


def test_rule_after_default_is_unreachable():
    e = one_error(rules("""
        - name: default
          action: {load_all_clusters: true}
        - name: late
          condition: intent_entropy > 5
          action: {skip: true}""", default=False))
    assert e.line == 4 and "rule 'late' can never match: the default rule 'default'" in e.message


def test_unknown_action_key_and_rule_key():
    errs = errors_of(rules("""
        - name: k
          conditon: intent_entropy > 5
          action: {load_all_clusters: true, precison: int8}"""))
    msgs = {(e.line, e.col): e.message for e in errs}
    assert msgs[(3, 5)] == "unknown rule key 'conditon'; did you mean 'condition'?"
    assert msgs[(4, 39)] == "unknown action key 'precison'; did you mean 'precision'?"


@pytest.mark.parametrize("action, message", [
    ("{precision: int8}", "the action says nothing about loading"),
    ("{load_all_clusters: true, skip: true}", "skip conflicts with load_all_clusters"),
    ("{load_all_clusters: false}", "load_all_clusters: expected true"),
    ("{load_cluster: $label}", "unknown variable '$label'"),
    ("{skip: true, precision: int8}", "precision has no effect with skip: true"),
    ("{load_all_clusters: true, layers: twelve}", "layers: expected all"),
    ('{load_all_clusters: true, layers: "18-12"}', "layers: range '18-12' runs backwards"),
    ("{load_all_clusters: true, enable_micro_sampling: 1}", "enable_micro_sampling: expected true"),
])
def test_action_errors(action, message):
    e = one_error(rules(f"""
        - name: a
          condition: intent_entropy > 5
          action: {action}"""))
    assert e.line == 4 and message in e.message


def test_yaml_syntax_error_has_place():
    e = one_error("rules:\n  - name: a\n    condition: [unclosed\n")
    assert e.message.startswith("YAML syntax:") and e.line >= 3


@pytest.mark.parametrize("text, message", [
    ("", "empty rule file"),
    ("- a\n- b\n", "expected a mapping with a `rules:` list"),
    ("version: v1\n", "no `rules:` list"),
    ("rule: []\n", "unknown top-level key 'rule'; did you mean 'rules'?"),
])
def test_file_shape_errors(text, message):
    assert any(message in e.message for e in errors_of(text))


def test_syntax_errors_in_condition():
    cases = {
        "intent_entropy >": "the condition ends too early",
        "(intent_entropy > 5": "missing ')'",
        "intent_entropy > 5 5": "unexpected number '5'",
        "1 < intent_entropy < 5": "comparisons do not chain",
        "intent_entropy > 5 $": "unexpected character '$'",
    }
    for cond, message in cases.items():
        with pytest.raises(ConditionSyntaxError) as info:
            parse_condition(cond)
        assert message in info.value.message, cond


def test_all_errors_reported_and_nothing_half_built(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(rules("""
        - name: one
          condition: intent_entropi > 5
          action: {load_all_clusters: true}
        - name: two
          condition: query_label = "x"
          action: {load_cluster: x, precision: fp64}"""), encoding="utf-8")
    with pytest.raises(RuleSetError) as info:
        load_rules(path)
    exc = info.value
    assert [e.line for e in exc.errors] == [3, 6, 7]
    assert str(exc) == exc.errors[0].header and str(exc).startswith(f"{path}:3:16: ")
    assert isinstance(exc, BadInput) and exc.exit_code == 2
    assert exc.report().endswith(f"3 errors in {path}")


def test_ruleset_identity_and_version(tmp_path):
    text = rules("""
        - name: a
          condition: intent_entropy > 5
          action: {load_all_clusters: true}""")
    (tmp_path / "yoco_rules_v2.yaml").write_text(text, encoding="utf-8")
    rs = load_rules(tmp_path / "yoco_rules_v2.yaml")
    import hashlib

    assert rs.sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert rs.version == "v2" and rs.rules[-1].is_default and len(rs.rules) == 2
    assert rs.loaded_at > 0 and rs.source.endswith("yoco_rules_v2.yaml")


def test_seed_rule_files_load():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "rules"
    for name, version in (("yoco_rules.yaml", "v1"), ("yoco_rules_v2.yaml", "v2")):
        rs = load_rules(root / name, labels=["违约责任", "管辖法院"], n_layers=30)
        assert rs.version == version and rs.rules[-1].is_default


def test_active_rules_reload_and_switch(tmp_path):
    good = rules("""
        - name: a
          condition: intent_entropy > 5
          action: {load_all_clusters: true}""")
    (tmp_path / "yoco_rules.yaml").write_text(good, encoding="utf-8")
    (tmp_path / "yoco_rules_v2.yaml").write_text(good.replace("> 5", "> 6"), encoding="utf-8")
    active = ActiveRules.from_file(tmp_path / "yoco_rules.yaml")
    v1 = active.current
    (tmp_path / "yoco_rules.yaml").write_text(good.replace(">", "=>"), encoding="utf-8")
    with pytest.raises(RuleSetError):
        active.reload()
    assert active.current is v1  # the bad file changed nothing
    assert "bad operator '=>'" in active.status()["last_error"]["message"]
    v2 = active.switch("v2")
    assert active.current is v2 and v2.version == "v2" and v2.rules[0].condition == "intent_entropy > 6"
    with pytest.raises(BadInput):
        active.switch("../etc")


def test_constants_are_data_never_code():
    cond = """query_label == "x') or __import__('os').system('true') or ('" """
    f = compile_condition(parse_condition(cond))
    assert f(Signals(query_label="x') or __import__('os').system('true') or ('"))
    assert not f(Signals(query_label="x"))
    with pytest.raises(ConditionSyntaxError, match="out of range"):
        parse_condition("intent_entropy > 1e999")
    with pytest.raises(ConditionSyntaxError, match="bad escape"):
        parse_condition(r'query_label == "\x"')
