"""`kite tune auto` / `kite tune params` on a tiny random model: points are bench runs that reuse
the model, full prefill's answers and the states of the same settings; results, resume, the
best config, the Pareto PNG, exit codes, bad usage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kite.cli.main import app
from tests.conftest import parse_json
from tests.test_bench import DOC_A, bench_inputs

runner = CliRunner()

RULES = """version: v1
rules:
  - name: sure
    condition: query_label != "" AND label_entropy < 0.1
    action: {load_cluster: $query_label}
  - name: default
    condition: true
    action: {load_all_clusters: true}
"""


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One torch thread (a tiny model's forward on a loaded 2-core box: see tests/test_bench.py)."""


@pytest.fixture()
def setup(tmp_path, tiny_models):
    cases, cfg, rules = bench_inputs(tmp_path, RULES)
    return tmp_path, ["--model", str(tiny_models["llama"]), "--cases", str(cases), "--upcycle-config", str(cfg),
                      "--yoco-rules", str(rules), "--upcycle", str(tmp_path / "states"), "--mkdir",
                      "--max-new-tokens", "3"]


def tune(setup, *args):
    tmp, common = setup
    return runner.invoke(app, ["tune", "auto", *common, "--output", str(tmp / "out" / "best.yaml"), *args],
                         prog_name="kite")


def test_a_grid_reuses_states_and_references_and_writes_a_valid_best_config(setup, kite_home):
    tmp, _ = setup
    r = tune(setup, "--param", "ratio", "--values", "2,4", "--param", "yoco_min_hit_gain", "--min", "0",
             "--max", "0.01", "--step", "0.01", "--objective", "bytes", "--constraint", "ppl_delta < 1000",
             "--constraint", "qps > 1e9", "--json")
    # qps > 1e9 holds nowhere: every point is infeasible, exit 1, no config
    assert r.exit_code == 1, r.output
    doc = parse_json(r.output)
    assert doc["best"] is None and not (tmp / "out" / "best.yaml").exists()
    assert [b["constraint"] for b in doc["points"][0]["broken"]] == ["qps > 1e9"]
    assert len(doc["broken"][1]["points"]) == 4 and not doc["broken"][0]["points"]

    r = tune(setup, "--param", "ratio", "--values", "2,4", "--param", "yoco_min_hit_gain", "--min", "0",
             "--max", "0.01", "--step", "0.01", "--objective", "bytes", "--constraint", "ppl_delta < 1000",
             "--constraint", "compression_ratio < 3", "--json")
    assert r.exit_code == 0, r.output
    doc = parse_json(r.output)
    pts = doc["points"]
    assert [p["params"] for p in pts] == [{"ratio": 2.0, "yoco_min_hit_gain": 0.0}, {"ratio": 2.0, "yoco_min_hit_gain": 0.01},
                                          {"ratio": 4.0, "yoco_min_hit_gain": 0.0}, {"ratio": 4.0, "yoco_min_hit_gain": 0.01}]
    # the states were made by the first run: every point now reuses them, and full prefill's
    # answers are computed once (first point) and read by the other three
    assert all(p["states_made"] == 0 and p["states_reused"] == 2 for p in pts)
    assert doc["reuse"]["references"] == 6 and doc["reuse"]["prefills"] == 6 and doc["reuse"]["model_loads"] == 3
    assert pts[1]["figures"]["bytes"] == pts[0]["figures"]["bytes"] > pts[2]["figures"]["bytes"]
    # ratio 4 breaks compression_ratio < 3: the best is the smaller ratio-2 state that meets it
    assert [p["feasible"] for p in pts] == [True, True, False, False]
    assert doc["best"]["params"]["ratio"] == 2.0 and doc["best"]["why"][0].startswith("best bytes (minimize)")
    best = tmp / "out" / "best.yaml"
    text = best.read_text()
    assert "# why it won:" in text and "# constraint compression_ratio < 3: broken by 2 point(s)" in text
    assert "upcycle_compression_ratio: 0.5" in text and "yoco_min_hit_gain: 0.0" in text
    v = runner.invoke(app, ["config", "validate", str(best), "--json"])
    assert v.exit_code == 0 and parse_json(v.output)["keys_set"] == ["features.upcycle_compression_ratio",
                                                                     "features.yoco_min_hit_gain"]
    png = tmp / "out" / "best.pareto.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp / "out" / "best.tune.json").read_text())
    assert saved["complete"] and len(saved["points"]) == 4 and saved["best"]["id"] == doc["best"]["id"]
    # each point is a bench run, recorded in the history
    h = parse_json(runner.invoke(app, ["bench", "history", "--json"]).output)["runs"]
    assert len(h) == 8


def test_resume_reads_finished_points_and_refuses_another_setup(setup, monkeypatch):
    tmp, _ = setup
    args = ["--param", "yoco_min_hit_gain", "--values", "0,0.01", "--objective", "f1"]
    assert tune(setup, *args).exit_code == 0
    from kite.bench import runner as bench_runner

    calls = []
    real = bench_runner.run_bench

    def counting(s, *a, **kw):
        calls.append(s.min_hit_gain)
        return real(s, *a, **kw)

    monkeypatch.setattr(bench_runner, "run_bench", counting)
    r = tune(setup, "--param", "yoco_min_hit_gain", "--values", "0,0.01,0.02", "--objective", "f1", "--resume",
             "--json")
    assert r.exit_code == 0, r.output
    doc = parse_json(r.output)
    assert calls == [0.02] and [p["status"] for p in doc["points"]] == ["resumed", "resumed", "measured"]
    # the cases changed: the old points would not compare
    cases = Path(setup[1][setup[1].index("--cases") + 1])
    cases.write_text(cases.read_text().replace("Paris", "Lyon"))
    r = tune(setup, *args, "--resume")
    assert r.exit_code == 2 and "was measured with cases_sha256" in r.output
    r = runner.invoke(app, ["tune", "auto", *setup[1], "--output", str(tmp / "elsewhere.yaml"), *args, "--resume"])
    assert r.exit_code == 2 and "does not exist (nothing to resume" in r.output


def test_ctrl_c_keeps_the_points_finished_and_says_how_to_resume(setup, monkeypatch):
    from kite.bench import runner as bench_runner

    real = bench_runner.run_bench
    seen = []

    def interrupted(s, *a, **kw):
        seen.append(1)
        if len(seen) == 2:
            raise KeyboardInterrupt
        return real(s, *a, **kw)

    monkeypatch.setattr(bench_runner, "run_bench", interrupted)
    r = tune(setup, "--param", "yoco_min_hit_gain", "--values", "0,0.01,0.02", "--objective", "f1")
    assert r.exit_code == 130
    assert "1 point finished, kept in" in r.output and "--resume" in r.output
    doc = json.loads((setup[0] / "out" / "best.tune.json").read_text())
    assert doc["interrupted"] and len(doc["points"]) == 1


def test_optuna_nsga2_with_two_objectives_and_rule_thresholds(setup):
    tmp, _ = setup
    r = tune(setup, "--param", "rules.sure.label_entropy", "--min", "0", "--max", "1", "--param", "cluster_num",
             "--values", "1,2", "--search", "optuna", "--trials", "3", "--objective", "f1", "--objective", "bytes",
             "--json")
    assert r.exit_code == 0, r.output
    doc = parse_json(r.output)
    assert doc["search"] == {"kind": "optuna", "trials": 3, "seed": 0} and 1 <= len(doc["points"]) <= 3
    assert doc["best"]["id"] in doc["pareto"]
    rules = tmp / "out" / "best.rules.yaml"
    up = tmp / "out" / "best.upcycle.yaml"
    assert rules.exists() and up.exists() and "cluster_num: " in up.read_text()
    text = (tmp / "out" / "best.yaml").read_text()
    assert f"rules_file: {rules.resolve()}" in text
    assert runner.invoke(app, ["config", "validate", str(tmp / "out" / "best.yaml")]).exit_code == 0
    assert runner.invoke(app, ["yoco", "validate", str(rules)]).exit_code == 0


@pytest.mark.parametrize("args, message", [
    (["--param", "ratoi", "--values", "2"], "did you mean 'ratio'?"),
    (["--param", "ratio", "--min", "8", "--max", "2", "--step", "2"], "the range is inverted"),
    (["--param", "ratio", "--min", "2", "--max", "2", "--step", "1"], "the range is empty"),
    (["--param", "ratio", "--min", "2", "--max", "9", "--step", "2"], "does not divide the range"),
    (["--min", "2", "--param", "ratio", "--max", "9"], "--min 2 comes before any --param"),
    (["--param", "ratio", "--values", "2,4", "--constraint", "ppl_detla < 0.5"], "did you mean 'ppl_delta'?"),
    (["--param", "ratio", "--values", "2,4", "--objective", "qpss"], "did you mean 'qps'?"),
    (["--param", "ratio", "--values", "2,4", "--trials", "3"], "--trials sets how many points Optuna tries"),
    (["--param", "ratio", "--values", "2,4", "--search", "optuna"], "--search optuna needs --trials N"),
    (["--param", "ratio", "--values", "2,4", "--metric", "qps|ppl_delta<0.5", "--objective", "f1"],
     "give one of them"),
])
def test_bad_usage_exits_2_before_any_point(setup, args, message):
    extra = [] if any(a in args for a in ("--objective", "--metric")) else ["--objective", "qps"]
    r = tune(setup, *args, *extra)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert not (setup[0] / "states").exists()


def test_the_seeds_metric_form_runs_and_params_lists_the_rule_thresholds(setup):
    tmp, common = setup
    r = tune(setup, "--param", "yoco_min_hit_gain", "--min", "0", "--max", "0.004", "--step", "0.002",
             "--metric", "qps|ppl_delta<1000")
    assert r.exit_code == 0, r.output
    assert "best p-" in r.output and "reuse saved" in r.output and "full-prefill references" in r.output
    p = runner.invoke(app, ["tune", "params", "--yoco-rules", common[common.index("--yoco-rules") + 1], "--json"])
    assert p.exit_code == 0
    listed = {x["name"]: x for x in parse_json(p.output)["params"]}
    assert listed["rules.sure.label_entropy"]["current"] == 0.1 and listed["ratio"]["acts_on"] == "state"
    assert listed["yoco_min_hit_gain"]["acts_on"] == "request" and "qps" in parse_json(p.output)["metrics"]


def test_a_bench_run_reusing_full_prefill_gives_the_same_figures(setup, tiny_models):
    """Full prefill read back from a BenchReuse is the same reference: the same answers and PPL,
    and the fused pipeline's deltas against it unchanged; the document is not prefilled again."""
    from kite.bench.reuse import BenchReuse
    from kite.bench.runner import BenchSettings, run_bench

    tmp, common = setup
    s = BenchSettings(cases=common[common.index("--cases") + 1], output=str(tmp / "r.json"),
                      model=str(tiny_models["llama"]), upcycle_dir=str(tmp / "states"), baselines=["full"],
                      rules=common[common.index("--yoco-rules") + 1],
                      upcycle_config=common[common.index("--upcycle-config") + 1], max_new_tokens=3)
    reuse = BenchReuse()
    first, second = run_bench(s, reuse=reuse), run_bench(s, reuse=reuse)
    assert first["reuse"]["references"] == 0 and second["reuse"] == {
        **second["reuse"], "model": True, "references": 2, "prefills": 2}
    for a, b in zip(first["cases"], second["cases"]):
        for name in ("full", "fused"):
            ma, mb = a["methods"][name], b["methods"][name]
            assert (ma["text"], ma["ppl"], ma["ppl_delta"], ma["kl_mean"]) == (mb["text"], mb["ppl"], mb["ppl_delta"],
                                                                                 mb["kl_mean"])
    # with a method that reads the document's cache, the document is prefilled again
    third = run_bench(BenchSettings(**{**s.__dict__, "baselines": ["full", "window"]}), reuse=reuse)
    assert third["reuse"]["prefills"] == 0 and third["reuse"]["references"] == 2


def test_the_budget_method_matches_full_prefill_until_it_compresses(tiny_models):
    """The bench's `budget` method (the memory-budgeted cache): with a budget past the document
    its reference logits are full prefill's; with a small one the document's share of the cache
    is smaller than its raw KV and the reference is still scored."""
    import torch

    from kite.bench.document import prefill_document
    from kite.bench.methods import FullPrefill, KVBudget
    from kite.model import load_model

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    ids = lm.tokenizer(DOC_A, add_special_tokens=False)["input_ids"]
    prompt, ref = ids[:6], ids[6:12]
    doc = prefill_document(lm, "a", ids)
    gen = dict(max_new_tokens=3, temperature=0.0)
    full = FullPrefill()
    f_ans = full.answer(lm, doc, full.prepare(lm, doc, 0), "q", prompt, gen)
    f_logits = full.reference_logits(lm, doc, f_ans, ref)
    wide = KVBudget(budget_tokens=300)
    w_ans = wide.answer(lm, doc, wide.prepare(lm, doc, 0), "q", prompt, gen)
    assert w_ans.text == f_ans.text and w_ans.details["compressed_tokens"] == 0
    assert torch.allclose(wide.reference_logits(lm, doc, w_ans, ref), f_logits, atol=1e-4)
    small = KVBudget(budget_tokens=36, block_tokens=16, codec="ratio=4")
    s_ans = small.answer(lm, doc, small.prepare(lm, doc, 0), "q", prompt, gen)
    assert s_ans.details["compressed_tokens"] > 0 and s_ans.kv_bytes < doc.raw_kv_bytes(lm)
    assert small.reference_logits(lm, doc, s_ans, ref).shape == f_logits.shape


def test_kv_budget_tokens_is_tuned_alone_on_the_budget_methods_figures(setup):
    r = tune(setup, "--param", "kv_budget_tokens", "--values", "300,400", "--objective", "bytes",
             "--constraint", "ppl_delta <= 0.001", "--json")
    assert r.exit_code == 0, r.output
    doc = parse_json(r.output)
    assert [p["method"] for p in doc["points"]] == ["budget", "budget"]
    # past these short documents nothing is compressed: full prefill's quality at every budget
    assert all(abs(p["figures"]["ppl_delta"]) < 1e-3 and p["figures"].get("yoco_hit_rate") is None
               for p in doc["points"])
    r = tune(setup, "--param", "kv_budget_tokens", "--values", "100", "--objective", "bytes")
    assert r.exit_code == 2 and "kv_budget_tokens 100 is outside its range ≥ 260" in r.output
