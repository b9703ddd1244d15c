"""`kite tune`'s pieces without a model: ranges and grids, objectives and constraints (the rules'
grammar over the bench's metric names), rule thresholds as parameters, judging points."""

from __future__ import annotations

import pytest

from kite.errors import BadInput
from kite.tune import RangeSpec, judge, parse_constraint, parse_metric, parse_objective, parse_ranges, tunable_params
from kite.tune.objective import figures_of
from kite.tune.rule_params import thresholds, write_variant
from kite.tune.space import grid

RULES = """version: v1
rules:
  - name: sure
    condition: query_label != "" AND label_entropy < 0.1
    action: {load_cluster: $query_label}
  - name: band
    condition: intent_entropy > 2 AND intent_entropy < 5.25 OR state_health_score < 0.5
    action: {load_all_clusters: true}
  - name: default
    condition: true
    action: {load_all_clusters: true}
"""


@pytest.fixture()
def params(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    return tunable_params(path)


def ranges(params, *specs, continuous=False):
    return parse_ranges([RangeSpec(*s) for s in specs], params, continuous)


def test_a_grid_holds_exactly_the_values_from_min_to_max_by_step(params):
    [r] = ranges(params, ("yoco_min_hit_gain", "0.002", "0.006", "0.0005"))
    assert r.values == (0.002, 0.0025, 0.003, 0.0035, 0.004, 0.0045, 0.005, 0.0055, 0.006)
    rs = ranges(params, ("ratio", None, None, None, "2,4,8"), ("cluster_num", "4", "8", "2"),
                ("max_span_tokens", "64", "128", "64"))
    points, skipped = grid(rs)
    assert len(points) == 3 * 3 * 2 and points[0] == {"ratio": 2.0, "cluster_num": 4, "max_span_tokens": 64}
    assert points[-1] == {"ratio": 8.0, "cluster_num": 8, "max_span_tokens": 128} and not skipped
    [p] = ranges(params, ("precision", None, None, None, "int4,INT8"))
    assert p.values == ("int4", "int8")
    # impossible combinations are skipped, with why; the base config's value counts
    pts, skipped = grid(ranges(params, ("min_span_tokens", "32", "96", "32")), {"max_span_tokens": 64})
    assert [x["min_span_tokens"] for x in pts] == [32] and "min_span_tokens 64 ≥ max_span_tokens 64" in skipped[0][1]


@pytest.mark.parametrize("spec, message", [
    (("ratoi", "2", "8", "2"), "not a tunable parameter; did you mean 'ratio'?"),
    (("nope", "2", "8", "2"), "tunable: ratio, upcycle_compression_ratio, precision"),
    (("ratio", "8", "2", "2"), "the range is inverted (--min 8 > --max 2)"),
    (("ratio", "4", "4", "1"), "the range is empty (--min = --max = 4)"),
    (("ratio", "2", "8", "4"), "--step 4 does not divide the range 2..8"),
    (("ratio", "2", "8", "0"), "the step must be positive"),
    (("ratio", "2", "8", None), "--step is missing"),
    (("ratio", "0.5", "8", "0.5"), "ratio 0.5 is outside its range ≥ 1"),
    (("cluster_num", "1", "300", "1"), "cluster_num 300 is outside its range [1, 256]"),
    (("cluster_num", "2", "8", "1.5"), "takes whole numbers"),
    (("upcycle_compression_ratio", "0", "0.5", "0.25"), "outside its range (0, 1]"),
    (("precision", "1", "2", "1"), "a choice (one of exact"),
    (("precision", None, None, None, "int5"), "precision 'int5' is not one of exact"),
    (("ratio", "2", None, "1"), "--max is missing"),
    (("ratio", "2", "4", "1", "2,4"), "either --values or --min/--max/--step"),
    (("rules.sure.label_entrpy", "0", "1", "0.5"), "did you mean 'rules.sure.label_entropy'?"),
])
def test_bad_ranges_say_what_is_wrong(params, spec, message):
    with pytest.raises(BadInput) as info:
        ranges(params, spec)
    assert message in str(info.value)


def test_parameters_given_twice_or_setting_the_same_thing_are_refused(params):
    with pytest.raises(BadInput, match="given twice"):
        ranges(params, ("ratio", "2", "4", "2"), ("ratio", "2", "8", "2"))
    with pytest.raises(BadInput, match="both set a state's size"):
        ranges(params, ("ratio", "2", "4", "2"), ("precision", None, None, None, "int4"))
    with pytest.raises(BadInput, match="at least one --param"):
        parse_ranges([], params)
    with pytest.raises(BadInput, match="tune it alone, not with --param ratio"):
        ranges(params, ("kv_budget_tokens", "512", "1024", "512"), ("ratio", "2", "4", "2"))


def test_optuna_may_sample_a_range_without_a_step(params):
    [r] = ranges(params, ("ratio", "2", "16"), continuous=True)
    assert r.values == () and (r.low, r.high, r.step) == (2.0, 16.0, None)
    with pytest.raises(BadInput, match="continuous range has no grid"):
        grid([r])


def test_rule_thresholds_are_parameters_and_a_variant_changes_only_its_number(tmp_path, params):
    path = tmp_path / "rules.yaml"
    names = [t.param for t in thresholds(path)]
    assert names == ["rules.sure.label_entropy", "rules.band.intent_entropy", "rules.band.intent_entropy#2",
                     "rules.band.state_health_score"]
    by = {p.name: p for p in params}
    assert by["rules.sure.label_entropy"].current == 0.1 and by["rules.band.state_health_score"].high == 1.0
    out = write_variant(path, {"rules.band.intent_entropy#2": 6.5, "rules.sure.label_entropy": 0.25,
                               "ratio": 4.0}, tmp_path / "v")
    from kite.yoco.rules import load_rules

    rs = load_rules(out)
    assert rs.rules[0].condition == 'query_label != "" AND label_entropy < 0.25'
    assert rs.rules[1].condition == "intent_entropy > 2 AND intent_entropy < 6.5 OR state_health_score < 0.5"
    assert write_variant(path, {"rules.sure.label_entropy": 0.25, "rules.band.intent_entropy#2": 6.5},
                         tmp_path / "v") == out  # named by content
    with pytest.raises(BadInput, match="no such threshold"):
        write_variant(path, {"rules.sure.nope": 1.0}, tmp_path / "v")


def test_constraints_use_the_rules_grammar_checked_against_the_bench_metrics():
    c = parse_constraint("ppl_delta < 0.5 AND (f1 >= 0.3 OR qps > 10)")
    assert c.fields() == ["ppl_delta", "f1", "qps"]
    assert c.holds({"ppl_delta": 0.2, "f1": 0.1, "qps": 12})
    assert not c.holds({"ppl_delta": 0.8, "f1": 0.5, "qps": 12})
    assert c.why_broken({"ppl_delta": 0.8, "f1": 0.5, "qps": 12}) == "ppl_delta 0.8 (needs < 0.5)"
    assert c.violation({"ppl_delta": 0.8, "f1": 0.5, "qps": 12}) == pytest.approx(0.3)
    assert c.violation({"ppl_delta": 0.2, "f1": 0.5}) == 0
    # a figure the run did not measure meets nothing that reads it
    hit = parse_constraint("yoco_hit_rate >= 0.7")
    assert not hit.holds({"yoco_hit_rate": None}) and "not measured" in hit.why_broken({})
    for text, message in [
        ("ppl_detla < 0.5", "column 1: unknown metric 'ppl_detla'; did you mean 'ppl_delta'?"),
        ("ppl_delta =< 0.5", "column 11: bad operator '=<'; did you mean '<='?"),
        ("ppl_delta < 'x'", "type mismatch"),
        ("ppl_delta", "not true/false"),
        ("", "empty condition"),
    ]:
        with pytest.raises(BadInput) as info:
            parse_constraint(text)
        assert message in str(info.value), str(info.value)


def test_objectives_and_the_seeds_metric_form():
    assert parse_objective("qps").maximize and not parse_objective("ppl_delta").maximize
    assert not parse_objective("bytes").maximize and not parse_objective("ttft_ms").maximize
    with pytest.raises(BadInput, match="did you mean 'ttft_ms'"):
        parse_objective("ttft")
    obj, cons = parse_metric("qps|ppl_delta<0.5")
    assert obj.name == "qps" and [c.text for c in cons] == ["ppl_delta<0.5"]
    with pytest.raises(BadInput, match="--metric"):
        parse_metric("qps|ppl_delta<<0.5")
    bench = {"summary": {"overall": {"fused": {"avg_latency_ms": 250.0, "kv_bytes": 1000, "f1": 0.5},
                                     "budget": {"avg_latency_ms": 500.0, "kv_bytes": 3000}}},
             "cases": [{"memory_peak_gb": 1.5}, {"memory_peak_gb": 2.0}]}
    figures = figures_of(bench)
    assert figures["qps"] == 4.0 and figures["bytes"] == 1000 and figures["memory_peak_gb"] == 2.0
    assert figures_of(bench, "budget")["qps"] == 2.0 and figures_of(bench, "budget")["bytes"] == 3000


def _doc(points, objectives, constraints):
    return {"points": [{"id": f"p{i}", "params": {"ratio": float(r)}, "status": "measured", "figures": f}
                       for i, (r, f) in enumerate(points)],
            "objectives": [o.to_dict() for o in objectives], "constraints": [c.text for c in constraints]}


def test_judging_picks_the_best_feasible_point_and_says_why_and_who_broke_what():
    qps, cons = parse_objective("qps"), [parse_constraint("ppl_delta < 0.5")]
    doc = judge(_doc([(2, {"qps": 3.0, "ppl_delta": 0.1, "bytes": 9}), (4, {"qps": 4.0, "ppl_delta": 0.3, "bytes": 5}),
                      (8, {"qps": 6.0, "ppl_delta": 0.9, "bytes": 3})], [qps], cons), [qps], cons)
    assert doc["best"]["id"] == "p1" and doc["feasible"] == 2
    assert doc["best"]["why"][0].startswith("best qps (maximize) among the 2 of 3 points")
    assert "runner-up ratio=2: qps 3; the winner is 1 higher (+33.3%)" in doc["best"]["why"][1]
    assert doc["broken"] == [{"constraint": "ppl_delta < 0.5", "points": [
        {"id": "p2", "params": {"ratio": 8.0}, "why": "ppl_delta 0.9 (needs < 0.5)"}]}]
    assert not doc["points"][2]["feasible"] and doc["points"][2]["broken"][0]["constraint"] == "ppl_delta < 0.5"
    # two objectives: the Pareto front, and the best of it on the first
    f1, size = parse_objective("f1"), parse_objective("bytes")
    doc = judge(_doc([(2, {"f1": 0.5, "bytes": 9}), (4, {"f1": 0.4, "bytes": 5}), (8, {"f1": 0.3, "bytes": 6})],
                     [f1, size], []), [f1, size], [])
    assert doc["pareto"] == ["p0", "p1"] and doc["best"]["id"] == "p0"
    # nothing feasible: no best
    doc = judge(_doc([(2, {"qps": 3.0, "ppl_delta": 0.7})], [qps], cons), [qps], cons)
    assert doc["best"] is None and doc["feasible"] == 0


def test_a_point_becomes_a_bench_run_with_copies_of_the_configs(tmp_path):
    """precision / clusters go into a copy of the upcycle config (its relative paths made absolute),
    a precision point drops the KITE config's fraction (it would win over the precision), the
    fraction kept becomes --ratio, the minimum gain a setting."""
    from kite.bench.runner import BenchSettings
    from kite.tune.point import bench_settings
    from kite.upcycle import compress_settings, load_upcycle_config

    (tmp_path / "ex.jsonl").write_text('{"text": "The court of Paris decides.", "label": "jurisdiction"}\n')
    src = tmp_path / "up.yaml"
    src.write_text("compression: {cluster_num: 3}\nsemantic_tagging: {labels: [jurisdiction], examples_file: ex.jsonl}\n")
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    cfg, cfg_path = load_upcycle_config(src)
    base = BenchSettings(cases="c.jsonl", output="", upcycle_config=str(src), kept_fraction=0.5, min_hit_gain=0.005)
    s = bench_settings(base, {"precision": "int4", "cluster_num": 6, "yoco_min_hit_gain": 0.01}, cfg, cfg_path,
                       rules, tmp_path / "work", tmp_path / "p.json")
    assert s.kept_fraction is None and s.ratio is None and s.min_hit_gain == 0.01 and s.rules == str(rules)
    vcfg, vpath = load_upcycle_config(s.upcycle_config)
    assert vcfg.compression.precision == "int4" and vcfg.compression.cluster_num == 6
    assert vcfg.semantic_tagging.examples_file == str(tmp_path / "ex.jsonl")
    assert compress_settings(vcfg).codec.name == "int4"
    s = bench_settings(base, {"upcycle_compression_ratio": 0.125, "rules.sure.label_entropy": 0.3}, cfg, cfg_path,
                       rules, tmp_path / "work", tmp_path / "p.json")
    assert s.ratio == 8.0 and s.kept_fraction is None and s.upcycle_config == str(src) and s.rules != str(rules)
    s = bench_settings(base, {"yoco_min_hit_gain": 0.0}, cfg, cfg_path, rules, tmp_path / "work", tmp_path / "p.json")
    assert s.kept_fraction == 0.5 and s.ratio is None and s.min_hit_gain == 0.0
