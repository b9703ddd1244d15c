"""`kite bench` on a tiny random model: every method, equal bytes, thresholds, history, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kite.cli.main import app
from tests.conftest import parse_json

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent

DOC_A = ("The parties agree that the supplier shall deliver the goods. Any breach of this agreement "
         "shall be settled by the court of Shanghai. Confidential information shall not be disclosed. "
         "The penalty is the payment of the contract price. Once upon a time there was a contract "
         "between two companies about payment, penalty, jurisdiction and force majeure. The supplier "
         "shall deliver the goods to the court.")
DOC_B = ("Once upon a time there was a contract between two companies about payment, penalty, "
         "jurisdiction and force majeure. Paris is the capital of France. The parties agree that the "
         "supplier shall deliver the goods. Confidential information shall not be disclosed. What is "
         "the capital of France? Paris is the capital of France.")


RULES = """version: v1
rules:
  - name: default
    condition: true
    action: {load_all_clusters: true}
"""


def _case(cid: str, text: str, family: str, question: str, answer: str) -> dict:
    return {"id": cid, "text": text, "spans": [],
            "questions": [{"id": "q0", "family": family, "label": None, "question": question,
                           "answer": answer}]}


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a loaded 2-core machine two threads spin against each other (a tiny
    model's forward goes from ~0.1 ms to ~20 ms)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def bench_inputs(tmp_path: Path, rules_text: str = RULES) -> tuple[Path, Path, Path]:
    """(cases, upcycle config, rules) of two tiny cases, written into `tmp_path` (tests/test_tune.py too)."""
    cases = tmp_path / "cases.jsonl"
    cases.write_text("".join(json.dumps(c) + "\n" for c in [
        _case("a", DOC_A, "qa", "Which court settles a breach?", "the court of Shanghai"),
        _case("b", DOC_B, "needle", "What is the capital of France?", "Paris"),
    ]))
    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text("compression: {svd_ratio: 0.25, cluster_num: 2, min_span_tokens: 8, max_span_tokens: 24}\n"
                   "semantic_tagging: {labels: [], generated_examples_per_label: 0}\n")
    rules = tmp_path / "rules.yaml"
    rules.write_text(rules_text)
    return cases, cfg, rules


@pytest.fixture()
def setup(tmp_path, tiny_models):
    cases, cfg, rules = bench_inputs(tmp_path)
    return {"cases": cases, "cfg": cfg, "rules": rules, "model": str(tiny_models["llama"]), "tmp": tmp_path}


def _run(setup, *extra, thresholds: str | None = None):
    tmp = setup["tmp"]
    th = tmp / "bench.yaml"
    th.write_text(thresholds or "thresholds:\n  memory_peak_gb: {max: 1000, unit: GB}\n")
    args = ["bench", "run", "--model", setup["model"], "--upcycle", str(tmp / "states"),
            "--upcycle-config", str(setup["cfg"]), "--yoco-rules", str(setup["rules"]), "--cases", str(setup["cases"]),
            "--output", str(tmp / "results.json"), "--thresholds", str(th),
            "--max-new-tokens", "4", *extra]
    return runner.invoke(app, args, prog_name="kite")


def test_run_all_methods_fields_equal_bytes_history(setup):
    r = _run(setup, "--json", "--plot", str(setup["tmp"] / "plots"))
    assert r.exit_code == 0, r.output
    res = parse_json(r.output)
    assert res["complete"] and res["passed"]
    assert set(res["methods"]) == {"full", "window", "kivi", "snapkv", "state", "fused"}
    assert any("kvpress" in n for n in res["notes"])
    for row in res["cases"]:
        budget = row["state"]["bytes"]
        for name in ("window", "kivi", "snapkv", "state"):
            assert abs(row["methods"][name]["kv_bytes"] - budget) <= 0.05 * budget, (name, row)
        for m in row["methods"].values():
            for key in ("f1", "exact_match", "ppl", "ppl_delta", "ttft_ms", "latency_ms", "tokens_per_s",
                        "memory_peak_gb", "memory_source", "kv_bytes"):
                assert key in m
        assert row["methods"]["full"]["ppl_delta"] == 0
    fused = res["summary"]["fused"]
    for key in ("avg_latency_ms", "ttft_ms", "tokens_per_s", "memory_peak_gb", "upcycle_regenerate_rate",
                "compression_ratio", "yoco_hit_rate", "load_helped_rate", "ppl_delta", "f1", "exact_match"):
        assert key in fused
    assert set(res["summary"]["families"]) == {"qa", "needle"}
    assert (setup["tmp"] / "plots" / "latency.png").stat().st_size > 0
    assert json.loads((setup["tmp"] / "results.json").read_text())["complete"]
    h = runner.invoke(app, ["bench", "history", "--json"])
    assert h.exit_code == 0
    runs = parse_json(h.output)["runs"]
    assert len(runs) == 1 and runs[0]["cases"] == 2 and runs[0]["model"]["fingerprint"]
    # the states are reused on a second run
    r2 = _run(setup, "--json", "--baselines", "window")
    assert r2.exit_code == 0, r2.output
    assert all(row["state"]["reused"] for row in parse_json(r2.output)["cases"])
    assert len(parse_json(runner.invoke(app, ["bench", "history", "--json"]).output)["runs"]) == 2


def test_concurrency_serves_the_cases_batched_and_one_at_a_time(setup):
    r = _run(setup, "--json", "--baselines", "state", "--concurrency", "2")
    assert r.exit_code == 0, r.output
    c = parse_json(r.output)["concurrency"]
    assert c["clients"] == 2 and c["requests"] == 2 and c["identical_answers"] and c["differing"] == []
    for side, rows in (("batched", 2), ("one_at_a_time", 1)):
        fig = c[side]
        assert fig["rows"] == rows and fig["new_tokens"] > 0 and fig["tokens_per_s"] > 0
        assert 0 < fig["ttft_p50_ms"] <= fig["ttft_p95_ms"]
    assert c["throughput_ratio"] > 0
    shown = _run(setup, "--baselines", "state", "--concurrency", "2")
    assert shown.exit_code == 0 and "2 clients, 2 requests from states" in shown.output
    bad = _run(setup, "--concurrency", "0")
    assert bad.exit_code == 2


def test_concurrency_waits_for_rows_in_arrival_order(tiny_models):
    from kite.bench.concurrency import closed_loop
    from kite.model import load_model

    lm = load_model(tiny_models["llama"], device="cpu")
    reqs = [(lm.tokenizer(p)["input_ids"], None) for p in ("The parties", "Paris is", "Any breach", "Once upon")]
    one = closed_loop(lm, reqs, clients=4, rows=1, max_new_tokens=5)
    four = closed_loop(lm, reqs, clients=4, rows=4, max_new_tokens=5)
    assert one["texts"] == four["texts"] and one["new_tokens"] == four["new_tokens"]
    assert (one["peak_rows"], four["peak_rows"]) == (1, 4)   # all four decoded together, or one by one


def test_threshold_fail_exits_1(setup):
    r = _run(setup, "--baselines", "window", "--max-cases", "1",
             thresholds="thresholds:\n  f1: {min: 2, unit: fraction}\n  memory_peak_gb: {max: 1000, unit: GB}\n")
    assert r.exit_code == 1, r.output
    res = json.loads((setup["tmp"] / "results.json").read_text())
    rows = {t["metric"]: t["pass"] for t in res["thresholds"]}
    assert rows == {"f1": False, "memory_peak_gb": True} and res["passed"] is False
    assert "FAIL" in r.stdout
    # off a terminal, progress is plain lines on stderr: each case and each method of it
    progress = [line.split("] ", 1)[1] for line in r.stderr.splitlines() if line.startswith("[")]
    assert "cases 1/1" in progress and "methods 3/3" in progress, r.stderr


@pytest.mark.parametrize("exc, code, error", [(RuntimeError("boom"), 1, "case b/q0: RuntimeError: boom"),
                                               (KeyboardInterrupt(), 130, "interrupted (Ctrl-C)")])
def test_failing_or_interrupted_run_keeps_finished_cases(setup, monkeypatch, exc, code, error):
    from kite.bench import methods

    calls = {"n": 0}
    real = methods.KeepLastWindow.answer

    def flaky(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise exc
        return real(self, *a, **kw)

    monkeypatch.setattr(methods.KeepLastWindow, "answer", flaky)
    r = _run(setup, "--baselines", "window")
    assert r.exit_code == code, r.output
    res = json.loads((setup["tmp"] / "results.json").read_text())
    assert len(res["cases"]) == 1 and not res["complete"] and res["error"] == error
    runs = parse_json(runner.invoke(app, ["bench", "history", "--json"]).output)["runs"]
    assert len(runs) == 1 and runs[0]["complete"] is False and runs[0]["cases"] == 1
    assert runs[0]["status"] == ("interrupted" if code == 130 else "error")
    assert runs[0]["interrupted"] is (code == 130)
    assert runs[0]["completed_cases"] == ["a/q0"] and runs[0]["cases_total"] == 2


def _interrupt_case(monkeypatch, n: int) -> None:
    """Ctrl-C in the n-th call of the window baseline's answer (one call a case)."""
    from kite.bench import methods

    calls = {"n": 0}
    real = methods.KeepLastWindow.answer

    def interrupted(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(methods.KeepLastWindow, "answer", interrupted)


def test_interrupted_run_is_recorded_once_and_shown_as_interrupted(setup, monkeypatch):
    _interrupt_case(monkeypatch, 2)
    r = _run(setup, "--baselines", "window")
    assert r.exit_code == 130
    said = r.stderr.strip().splitlines()[-1]
    assert said.startswith("interrupted (Ctrl-C): kite bench run: 1 of 2 cases finished (a/q0)"), said
    assert str(setup["tmp"] / "results.json") in said
    # a second run, interrupted before its first case, leaves the first run's results file in
    # place: that run is not recorded again, and this one recorded no case
    from kite.bench import runner as bench_runner

    def no_lengths(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_runner, "check_lengths", no_lengths)
    again = _run(setup, "--baselines", "window")
    assert again.exit_code == 130 and "no case had started" in again.stderr
    runs = json.loads(runner.invoke(app, ["bench", "history", "--json"]).stdout)["runs"]
    assert [(x["status"], x["cases"], x["cases_total"]) for x in runs] == [("interrupted", 1, 2)]
    table = runner.invoke(app, ["bench", "history"]).stdout
    row = next(line for line in table.splitlines() if runs[0]["run_id"] in line)
    assert " interrupted " in row and " 1/2 " in row, table


def test_history_reads_each_run_once_with_its_status_old_lines_too(kite_home):
    from kite.bench.history import append_run, history_path, read_history

    base = {"started_at": "t0", "finished_at": "t1", "model": {"spec": "m", "fingerprint": "kite-fp1:" + "ab" * 8},
            "cases": 1, "figures": {"fused": {"f1": 0.5}}}
    old_lines = [  # written before `status`; the interrupted run twice, as the old CLI recorded it
        {**base, "run_id": "r1", "complete": True, "passed": True, "error": None},
        {**base, "run_id": "r2", "complete": False, "passed": False, "error": "interrupted (Ctrl-C)"},
        {**base, "run_id": "r2", "complete": False, "passed": False, "error": "interrupted (Ctrl-C)"},
        {**base, "run_id": "r3", "complete": False, "passed": False, "error": "case x: RuntimeError: boom"},
        {**base, "run_id": "r4", "complete": True, "passed": False, "error": None},
    ]
    history_path().parent.mkdir(parents=True)
    history_path().write_text("".join(json.dumps(x) + "\n" for x in old_lines))
    runs = read_history()
    assert [(x["run_id"], x["status"], x["interrupted"]) for x in runs] == [
        ("r1", "passed", False), ("r2", "interrupted", True), ("r3", "error", False), ("r4", "failed", False)]
    append_run({**runs[0], "finished_at": "t2"})   # the same run again: replaced, not added
    assert [x["run_id"] for x in read_history()] == ["r2", "r3", "r4", "r1"]
    assert len(history_path().read_text().splitlines()) == 4


def _bad(setup, lines: list[str] | None = None, *extra, thresholds=None):
    if lines is not None:
        setup["cases"].write_text("\n".join(lines) + "\n")
    return _run(setup, *extra, thresholds=thresholds)


def test_malformed_jsonl(setup):
    good = json.dumps(_case("a", DOC_A, "qa", "Q?", "A"))
    r = _bad(setup, [good, '{"id": "b", "text": '])
    assert r.exit_code == 2 and f"{setup['cases']}:2:" in r.stderr and "invalid JSON" in r.stderr


def test_case_without_document(setup):
    r = _bad(setup, [json.dumps({"id": "x", "questions": [{"question": "Q?", "answer": "A"}]})])
    assert r.exit_code == 2 and f"{setup['cases']}:1: case 'x' has no document" in r.stderr


def test_reference_longer_than_context(setup):
    long_ref = "the court of Shanghai " * 200
    r = _bad(setup, [json.dumps(_case("a", DOC_A, "qa", "Which court?", long_ref))])
    assert r.exit_code == 2 and "past the model's context of 512" in r.stderr and ":1: case a/q0" in r.stderr


def test_unknown_threshold_metric(setup):
    r = _bad(setup, None, thresholds="thresholds:\n  latency_ms: {max: 3}\n")
    assert r.exit_code == 2
    assert "bench.yaml:2: thresholds.latency_ms: unknown metric (did you mean 'ttft_ms'" in r.stderr \
        or "bench.yaml:2: thresholds.latency_ms: unknown metric" in r.stderr


def test_a_threshold_in_another_unit_is_refused_before_the_model_loads(setup):
    r = _bad(setup, None, thresholds="thresholds:\n  upcycle_regenerate_rate: {min: 0.85, unit: x}\n")
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert ("bench.yaml:2: thresholds.upcycle_regenerate_rate: unit 'x' is not the metric's (MB/1K tokens: MB of "
            ".upc per 1,000 document tokens)") in r.stderr
    assert not (setup["tmp"] / "states").exists()


def test_unknown_baseline_and_family(setup):
    r = _bad(setup, None, "--baselines", "full,h2o")
    assert r.exit_code == 2 and "--baselines 'h2o'" in r.stderr
    r = _bad(setup, None, "--families", "trivia")
    assert r.exit_code == 2 and "--families 'trivia'" in r.stderr


def test_scoring_squad_normalisation():
    from kite.bench.scoring import exact_match, f1_score, normalize_answer

    assert normalize_answer("The Court of  Shanghai!") == "court of shanghai"
    assert exact_match("the court of Shanghai.", "Court of Shanghai") == 1.0
    assert exact_match("It is the court of Shanghai.", "court of Shanghai") == 1.0
    assert exact_match("Beijing", "Shanghai") == 0.0
    assert f1_score("court of Shanghai", "the court of Beijing") == pytest.approx(2 / 3)
    assert f1_score("", "x") == 0.0


def test_bundled_cases_are_deterministic():
    from kite.bench.cases import FAMILIES, load_cases, make_default_cases
    from kite.data.contracts import to_jsonl

    bundled = REPO / "configs" / "bench_cases.jsonl"
    assert to_jsonl(make_default_cases(2, 1500, 0, 1)) == bundled.read_text(encoding="utf-8")
    cases = load_cases(bundled)
    assert sorted({c.family for c in cases}) == sorted(FAMILIES) and len(cases) == 10
    multihop = next(c for c in cases if c.family == "multihop")
    assert "PREVIOUS VERSION" in multihop.document


def test_snapkv_selects_the_attended_tokens():
    import torch

    from kite.bench.snapkv import select
    from kite.runtime.cache import KVPrefix

    torch.manual_seed(0)
    H, T, d, w = 2, 40, 8, 3
    keys = torch.randn(H, T, d) * 0.01
    target = [5, 17, 33]
    q = torch.zeros(2 * H, w, d)
    q[..., 0] = 50.0
    keys[:, target, 0] = 1.0  # only these keys answer the window's queries
    full = KVPrefix([keys], [torch.randn(H, T, d)], next_position=T)
    picks = select(full, [q], [torch.zeros(H, w, d)], keep=3, kernel=1)
    assert picks[0].shape == (H, 3) and picks[0].tolist() == [target, target]


@pytest.mark.parametrize("budget_fraction", [0.5, 0.25, 0.1])
def test_kivi_spends_the_budget(budget_fraction):
    import torch

    from kite.bench.kivi import kivi_at_budget
    from kite.runtime.cache import KVPrefix

    torch.manual_seed(0)
    L, H, T, d = 2, 2, 300, 16
    full = KVPrefix([torch.randn(H, T, d) for _ in range(L)], [torch.randn(H, T, d) for _ in range(L)], T)
    raw = L * 2 * H * T * d * 2
    budget = int(raw * budget_fraction)
    cache = kivi_at_budget(full, budget)
    assert cache.nbytes <= budget and cache.nbytes >= 0.95 * budget
    prefix = cache.to_prefix()
    assert prefix.keys[0].shape == (H, T - cache.first_token, d)
    err = (prefix.values[0] - full.values[0][:, cache.first_token:]).abs().mean()
    assert err < 0.5


def test_completion_prompts_and_the_scored_answer(tmp_path):
    from kite.bench.cases import BenchCase, load_cases
    from kite.bench.runner import answer_text, prompt_text
    from kite.errors import BadInput

    base = dict(id="c/q0", family="qa", document="d", question="Which court?", reference="Paris",
                label=None, where="f:1")
    assert prompt_text(BenchCase(**base)) == ("Which court?", True)
    text, chat = prompt_text(BenchCase(**base, prompt="In short, the courts in"))
    assert text == "\nIn short, the courts in" and not chat
    assert answer_text("  Paris.\nThe Supplier shall") == "Paris."
    bad = tmp_path / "bad.jsonl"
    case = _case("a", DOC_A, "qa", "Which court?", "Shanghai")
    case["questions"][0]["prompt"] = " "
    bad.write_text(json.dumps(case) + "\n")
    with pytest.raises(BadInput, match="prompt must be a non-empty string"):
        load_cases(bad)
    # every bundled question carries its completion-style prompt
    assert all(c.prompt for c in load_cases(REPO / "configs" / "bench_cases.jsonl"))


def test_two_runs_started_in_the_same_second_into_one_output_keep_two_history_lines():
    """Each run carries its own id (a tune sweep starts several a second on tiny models)."""
    from kite.bench.history import record_of

    a = {"run_id": "aaaaaaaaaaaa", "started_at": "2026-11-30T20:00:00+00:00", "model": {"spec": "m", "fingerprint": "f"}}
    b = {**a, "run_id": "bbbbbbbbbbbb"}
    assert record_of(a, "out.json")["run_id"] != record_of(b, "out.json")["run_id"]
    old = {k: v for k, v in a.items() if k != "run_id"}      # a result from before runs carried ids
    assert record_of(old, "out.json")["run_id"] == record_of(dict(old), "out.json")["run_id"]
