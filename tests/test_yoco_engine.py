"""Table-driven decisions over the seed rule set, the min-hit-gain skip, and the gain formula."""

from __future__ import annotations

from pathlib import Path

import pytest

from kite.errors import BadInput
from kite.yoco.engine import StateInfo, decide, predict_gain
from kite.yoco.health import gain_from_health, health_from_gain
from kite.yoco.rules import load_rules, parse_rules
from kite.yoco.signals import SIGNAL_FIELDS, HardwareWatermark, Signals

RULES = Path(__file__).resolve().parent.parent / "rules" / "yoco_rules.yaml"
STATE = StateInfo({"违约责任": 0.8, "管辖法院": 0.6, "保密义务": 0.9}, n_layers=30)


@pytest.fixture(scope="module")
def ruleset():
    return load_rules(RULES, labels=list(STATE.health), n_layers=30)


def sig(**kw) -> Signals:
    wm = {k[3:]: kw.pop(k) for k in list(kw) if k.startswith("hw_")}
    return Signals(hardware_watermark=HardwareWatermark(**wm), **kw)


CASES = [
    # signals, rule, clusters, layers, precision, micro, skipped
    (sig(hw_spike=True, query_label="保密义务"), "memory_pressure", ["保密义务"],
     list(range(12, 19)), "int4", True, False),
    (sig(hw_gpu_mem=0.95, query_label="违约责任", label_entropy=0.3), "memory_pressure", ["违约责任"],
     list(range(12, 19)), "int4", True, False),
    # under pressure, a query that names no clause (or is unsure which) loads nothing
    (sig(hw_spike=True, query_label="", label_entropy=3.0), "memory_pressure_no_label", [], None,
     None, True, True),
    (sig(hw_gpu_mem=0.95, query_label="违约责任", label_entropy=0.7), "memory_pressure_no_label", [],
     None, None, True, True),
    (sig(intent_entropy=6.0, state_health_score=0.5), "unhealthy_state", [], None, None, False, True),
    (sig(intent_entropy=6.0, hw_gpu_mem=0.5), "high_intent_entropy", "all", None, None, True, False),
    (sig(intent_entropy=6.0, hw_gpu_mem=0.88), "default", "all", None, None, False, False),
    # the query head is sure of the label: that cluster, as stored
    (sig(intent_entropy=6.0, query_label="违约责任", label_entropy=0.05), "confident_label",
     ["违约责任"], None, None, False, False),
    # less sure (0.1-0.5 bits lost F1 with one cluster): the whole state
    (sig(intent_entropy=4.0, query_label="违约责任", label_entropy=0.2), "default", "all", None,
     None, False, False),
    (sig(intent_entropy=4.0, label_entropy=1.5), "default", "all", None, None, False, False),
]


@pytest.mark.parametrize("signals, rule, clusters, layers, precision, micro, skipped", CASES)
def test_decisions(ruleset, signals, rule, clusters, layers, precision, micro, skipped):
    plan = decide(ruleset, signals, STATE, min_hit_gain=0.005)
    assert (plan.matched_rule, plan.clusters, plan.layers, plan.precision,
            plan.enable_micro_sampling, plan.skipped) == (rule, clusters, layers, precision,
                                                          micro, skipped)
    assert plan.reason.startswith(f"rule {rule!r}")


def test_reason_names_the_values(ruleset):
    plan = decide(ruleset, sig(intent_entropy=6.25, hw_gpu_mem=0.5), STATE, 0.005)
    assert plan.reason == ("rule 'high_intent_entropy' matched: intent_entropy > 5.2 AND "
                           "hardware_watermark.gpu_mem < 0.85 (intent_entropy=6.25, "
                           "hardware_watermark.gpu_mem=0.5)")


def test_min_hit_gain_skips_and_says_why(ruleset):
    weak = StateInfo({"违约责任": 0.55, "管辖法院": 0.9}, 30)
    s = sig(hw_spike=True, query_label="违约责任", label_entropy=0.2, state_health_score=0.7)
    plan = decide(ruleset, s, weak, min_hit_gain=0.005)
    assert plan.skipped and plan.clusters == [] and plan.matched_rule == "memory_pressure"
    assert plan.predicted_gain == pytest.approx(0.002)
    assert plan.skip_reason == "predicted gain 0.002 < yoco_min_hit_gain 0.005"
    assert plan.reason.endswith("skipped: predicted gain 0.002 < yoco_min_hit_gain 0.005")
    assert decide(ruleset, s, weak, min_hit_gain=0.001).loads


def test_query_label_not_in_state_passes_to_the_next_rule(ruleset):
    plan = decide(ruleset, sig(hw_spike=True, query_label="不可抗力"), STATE, 0.005)
    assert plan.matched_rule == "memory_pressure_no_label" and plan.skipped
    assert ("rule 'memory_pressure' passed on: query_label '不可抗力' is not a cluster label of "
            "this state") in plan.reason
    rs = parse_rules("""
rules:
  - name: by_label
    condition: query_label != ""
    action: {load_cluster: $query_label}
  - name: default
    action: {load_cluster: $query_label}
""")
    st = StateInfo({"a": 0.8})
    assert decide(rs, Signals(query_label="a"), st, 0.0).clusters == ["a"]
    # the default rule does not pass on: it reports the missing cluster and loads nothing
    # with room on the device, a label the state lacks falls through to the whole state
    plan = decide(ruleset, sig(query_label="不可抗力", label_entropy=0.01), STATE, 0.005)
    assert plan.matched_rule == "default" and plan.clusters == "all"
    assert "rule 'confident_label' passed on" in plan.reason
    plan = decide(rs, Signals(query_label="b"), st, 0.0)
    assert plan.matched_rule == "default" and plan.skipped
    assert plan.skip_reason == "query_label 'b' is not a cluster label of this state"
    assert "rule 'by_label' passed on" in plan.reason


def test_state_health_score_is_filled_from_the_state(ruleset):
    sick = StateInfo({"违约责任": 0.5, "管辖法院": 0.5}, 30)
    plan = decide(ruleset, sig(intent_entropy=6.0), sick, 0.005)
    assert plan.matched_rule == "unhealthy_state"  # 0.5 < 0.55 came from the state


def test_predicted_gain_formula():
    st = StateInfo({"a": 0.75, "b": 1.0}, tokens={"a": 300, "b": 100})
    # g(h) = (2h - 1) * 0.02; token-weighted mean
    assert predict_gain(st, ["a"]) == pytest.approx(0.01)
    assert predict_gain(st, ["a", "b"]) == pytest.approx((300 * 0.01 + 100 * 0.02) / 400)
    assert health_from_gain(gain_from_health(0.8)) == pytest.approx(0.8)
    assert health_from_gain(1.0) == 1.0 and health_from_gain(-1.0) == 0.0


def test_first_match_wins_and_layer_lists():
    rs = parse_rules("""
rules:
  - name: first
    condition: intent_entropy > 1
    action: {load_cluster: [a, b], layers: "0-2,5", precision: fp8}
  - name: second
    condition: intent_entropy > 0
    action: {skip: true}
  - name: default
    condition: true
    action: {load_all_clusters: true}
""")
    st = StateInfo({"a": 1.0, "b": 1.0})
    plan = decide(rs, Signals(intent_entropy=2), st, 0.0)
    assert (plan.matched_rule, plan.clusters, plan.layers) == ("first", ["a", "b"], [0, 1, 2, 5])
    assert decide(rs, Signals(intent_entropy=0.5), st, 0.0).matched_rule == "second"
    assert decide(rs, Signals(intent_entropy=0.0), st, 0.0).reason == "rule 'default' (default)"
    assert decide(rs, Signals(), StateInfo({}), 0.0).skip_reason == "the state has no clusters"


def test_signals_from_mapping_nested_and_dotted():
    s = Signals.from_mapping({"intent_entropy": 5, "hardware_watermark": {"gpu_mem": 0.9},
                              "hardware_watermark.spike": True, "query_label": "x"})
    assert s.intent_entropy == 5.0 and s.hardware_watermark.gpu_mem == 0.9
    assert s.hardware_watermark.spike is True and s.query_label == "x"
    assert set(s.flat()) == set(SIGNAL_FIELDS)
    with pytest.raises(BadInput, match="did you mean 'hardware_watermark.gpu_mem'"):
        Signals.from_mapping({"hardware_watermark": {"gpu_memory": 1}})
    with pytest.raises(BadInput, match="intent_entropy must be a number"):
        Signals.from_mapping({"intent_entropy": "high"})
    with pytest.raises(BadInput, match="spike must be a bool"):
        Signals.from_mapping({"hardware_watermark.spike": 1})


def test_decision_is_fast_enough_for_a_smoke_check(ruleset):
    """Not the benchmark (benchmarks/yoco_decision.py): a guard against a 100x regression."""
    import time

    s = sig(intent_entropy=4.0, label_entropy=1.5, state_health_score=0.7)
    for _ in range(200):
        decide(ruleset, s, STATE, 0.005)
    t0 = time.perf_counter()
    for _ in range(2000):
        decide(ruleset, s, STATE, 0.005)
    assert (time.perf_counter() - t0) / 2000 < 500e-6
