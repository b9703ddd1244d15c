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


@pytest.fixture()
def setup(tmp_path, tiny_models):
    cases = tmp_path / "cases.jsonl"
    cases.write_text("".join(json.dumps(c) + "\n" for c in [
        _case("a", DOC_A, "qa", "Which court settles a breach?", "the court of Shanghai"),
        _case("b", DOC_B, "needle", "What is the capital of France?", "Paris"),
    ]))
    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text("compression: {svd_ratio: 0.25, cluster_num: 2, min_span_tokens: 8, max_span_tokens: 24}\n"
                   "semantic_tagging: {labels: [], generated_examples_per_label: 0}\n")
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    return {"cases": cases, "cfg": cfg, "rules": rules, "model": str(tiny_models["llama"]), "tmp": tmp_path}


def _run(setup, *extra, thresholds: str | None = None):
    tmp = setup["tmp"]
    th = tmp / "bench.yaml"
    th.write_text(thresholds or "thresholds:\n  memory_peak_gb: {max: 1000}\n")
    args = ["bench", "run", "--model", setup["model"], "--upcycle", str(tmp / "states"),
            "--upcycle-config", str(setup["cfg"]), "--yoco-rules", str(setup["rules"]), "--cases", str(setup["cases"]),
            "--output", str(tmp / "results.json"), "--thresholds", str(th),
            "--max-new-tokens", "4", *extra]
    return runner.invoke(app, args)


def test_run_all_methods_fields_equal_bytes_history(setup):
    r = _run(setup, "--json", "--plot", str(setup["tmp"] / "plots"))
    assert r.exit_code == 0, r.output
    res = parse_json(r.output)
    assert res["complete"] and res["passed"]
    assert set(res["methods"]) == {"full", "window", "kivi", "snapkv", "fused"}
    assert any("kvpress" in n for n in res["notes"])
    for row in res["cases"]:
        budget = row["state"]["bytes"]
        for name in ("window", "kivi", "snapkv"):
            assert abs(row["methods"][name]["kv_bytes"] - budget) <= 0.05 * budget, (name, row)
        for m in row["methods"].values():
            for key in ("f1", "exact_match", "ppl", "ppl_delta", "ttft_ms", "latency_ms", "tokens_per_s",
                        "memory_peak_gb", "memory_source", "kv_bytes"):
                assert key in m
        assert row["methods"]["full"]["ppl_delta"] == 0
    fused = res["summary"]["fused"]
    for key in ("avg_latency_ms", "ttft_ms", "tokens_per_s", "memory_peak_gb", "upcycle_regenerate_rate",
                "compression_ratio", "yoco_hit_rate", "ppl_delta", "f1", "exact_match"):
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
