"""`kite yoco analyze` and its library on a tiny random model: the report's shape and sums, bad
input, the PNG, and the batched entropy pass against one query at a time."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kite.cli.main import app
from kite.data.traffic import generate_traffic, to_jsonl
from kite.yoco.analyze import analyze, entropy_thresholds, otsu_cut
from kite.yoco.intent import QuerySignals, query_signals
from kite.yoco.rules import parse_rules

RULES = """rules:
  - name: vague
    condition: intent_entropy > 8.6255
    action: {load_all_clusters: true, precision: int8}
  - name: labeled
    condition: query_label != "" AND label_entropy < 0.5 AND 8.62 < intent_entropy
    action: {load_cluster: $query_label}
  - name: busy
    condition: hardware_watermark.gpu_mem > 0.9
    action: {skip: true}
  - name: default
    condition: true
    action: {load_all_clusters: true}
"""


@pytest.fixture(scope="module")
def lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["llama"]), device="cpu")


@pytest.fixture
def files(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES, encoding="utf-8")
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text(to_jsonl(generate_traffic(24, seed=3)), encoding="utf-8")
    return rules, traffic


def run(*args: str):
    return CliRunner().invoke(app, ["yoco", *args])


def test_batched_pass_matches_one_by_one(lm):
    queries = [r["query"] for r in generate_traffic(8, seed=1)] + ["", "x"]
    batched = query_signals(lm, queries, batch_size=5, batch_tokens=64)
    for q, b in zip(queries, batched):
        one = query_signals(lm, [q])[0]
        assert abs(one.intent_entropy - b.intent_entropy) < 1e-4
        assert one.tokens == b.tokens


def test_repeated_queries_run_once_and_come_back_in_order(lm):
    calls = []
    queries = ["the supplier shall deliver", "hi", "the supplier shall deliver", "hi", "court"]
    out = query_signals(lm, queries, progress=lambda d, t: calls.append(t))
    assert calls[-1] == 3  # distinct texts
    assert out[0].intent_entropy == out[2].intent_entropy and out[0] is not out[2]
    assert [s.tokens for s in out] == [query_signals(lm, [q])[0].tokens for q in queries]


def test_report_on_synthetic_signals():
    rs = parse_rules(RULES, "rules.yaml")
    sigs = [QuerySignals(e, lab, le, tokens=5) for e, lab, le in
            [(2.0, "a", 0.1), (2.1, "a", 0.2), (2.2, "b", 0.9), (9.0, "", 0.0), (9.1, "b", 0.3)]]
    rep = analyze(sigs, rs, queries=[f"q{i}" for i in range(5)])
    qs = list(rep["intent_entropy"]["quantiles"].values())
    assert qs == sorted(qs) and len(qs) == 8
    assert sum(rep["intent_entropy"]["histogram"]["counts"]) == 5
    assert [r["rule"] for r in rep["coverage"]["rules"]] == ["vague", "labeled", "busy", "default"]
    assert sum(r["count"] for r in rep["coverage"]["rules"]) == 5
    assert rep["coverage"]["rules"][0]["count"] == 2  # 9.0 and 9.1 are vague
    otsu = rep["cuts"]["otsu"]
    assert 2.2 < otsu["value"] < 9.0 and otsu["below"] == pytest.approx(0.6)
    assert {(t["rule"], t["op"], t["value"]) for t in entropy_thresholds(rs)} == {
        ("vague", ">", 8.6255), ("labeled", ">", 8.62)}  # `8.62 < x` reads as `x > 8.62`
    assert rep["labels"][0]["label"] in ("a", "b") and sum(r["count"] for r in rep["labels"]) == 5


def test_otsu_needs_two_values():
    assert otsu_cut([1.0, 1.0]) is None and otsu_cut([]) is None


def test_analyze_cli_json_and_plot(lm, tiny_models, files, tmp_path):
    rules, traffic = files
    png = tmp_path / "h.png"
    r = run("analyze", "--queries", str(traffic), "--model", str(tiny_models["llama"]), "--rules",
            str(rules), "--plot", str(png), "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["queries"] == 24 and 0 < rep["distinct_queries"] <= 24
    assert rep["timing"]["queries_per_s"] > 0
    qs = list(rep["intent_entropy"]["quantiles"].values())
    assert qs == sorted(qs)
    cov = rep["coverage"]
    assert [row["rule"] for row in cov["rules"]] == ["vague", "labeled", "busy", "default"]
    assert sum(row["count"] for row in cov["rules"]) == 24
    assert cov["assumed"]["hardware_watermark.gpu_mem"] == 0.0
    assert set(cov["by_group"]) == set(rep["by_group"]) <= {"precise", "fuzzy", "needle", "contract", "off_topic"}
    assert sum(g["count"] for g in rep["by_group"].values()) == 24
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    busy = run("analyze", "--queries", str(traffic), "--model", str(tiny_models["llama"]), "--rules",
               str(rules), "--assume", '{"hardware_watermark": {"gpu_mem": 0.95}}', "--json")
    assert busy.exit_code == 0, busy.output
    rows = {row["rule"]: row["count"] for row in json.loads(busy.stdout)["coverage"]["rules"]}
    assert rows["default"] == 0 and sum(rows.values()) == 24  # everything below vague/labeled is busy


def test_analyze_bad_line_and_empty_file(tiny_models, files, tmp_path):
    rules, _ = files
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "fine"}\n{"query": "broken"\n', encoding="utf-8")
    r = run("analyze", "--queries", str(bad), "--model", str(tiny_models["llama"]), "--rules", str(rules))
    assert r.exit_code == 2 and f"{bad}:2:" in r.stderr
    noquery = tmp_path / "noquery.jsonl"
    noquery.write_text('{"query": "fine"}\n\n{"text": "no query here"}\n', encoding="utf-8")
    r = run("analyze", "--queries", str(noquery), "--model", str(tiny_models["llama"]), "--rules", str(rules))
    assert r.exit_code == 2 and f"{noquery}:3: expected a \"query\" string" in r.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    r = run("analyze", "--queries", str(empty), "--model", str(tiny_models["llama"]), "--rules", str(rules))
    assert r.exit_code == 2 and "empty" in r.stderr


def test_analyze_rejects_assuming_the_query_signals(tiny_models, files):
    rules, traffic = files
    r = run("analyze", "--queries", str(traffic), "--model", str(tiny_models["llama"]), "--rules", str(rules),
            "--assume", '{"intent_entropy": 3}')
    assert r.exit_code == 2 and "the query's own signal" in r.stderr


def test_data_traffic_is_deterministic(tmp_path):
    out = tmp_path / "t.jsonl"
    r = CliRunner().invoke(app, ["data", "traffic", "--n", "50", "--seed", "7", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["queries"] == 50
    assert out.read_text(encoding="utf-8") == to_jsonl(generate_traffic(50, seed=7))
    assert generate_traffic(60, seed=7)[:50] == generate_traffic(50, seed=7)


def test_analyze_checks_rule_labels(tiny_models, files, tmp_path):
    _, traffic = files
    rules = tmp_path / "named.yaml"
    rules.write_text(RULES.replace("{load_cluster: $query_label}", "{load_cluster: escrow}"), encoding="utf-8")
    args = ["analyze", "--queries", str(traffic), "--model", str(tiny_models["llama"]), "--rules", str(rules)]
    r = run(*args)  # the tagger's labels: no `escrow`
    assert r.exit_code == 2 and "escrow" in r.stderr
    r = run(*args, "--labels", "escrow,payment", "--json")
    assert r.exit_code == 0, r.output


def test_bf16_pass_is_close_and_leaves_the_model_fp32(lm):
    queries = [r["query"] for r in generate_traffic(24, seed=3)]
    exact = query_signals(lm, queries)
    fast = query_signals(lm, queries, precision="bf16")
    dev = [abs(a.intent_entropy - b.intent_entropy) for a, b in zip(exact, fast)]
    assert max(dev) < 0.2 and any(d > 0 for d in dev)  # bf16 rounding: close, not identical
    assert all(type(m).__name__ != "BF16Linear" for m in lm.model.modules())
    assert [s.intent_entropy for s in query_signals(lm, queries)] == [s.intent_entropy for s in exact]
    with pytest.raises(ValueError, match="precision"):
        query_signals(lm, queries, precision="int3")
