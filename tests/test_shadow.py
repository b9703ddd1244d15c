"""`kite shadow`: diff classification and the command's exit codes on a tiny random model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kite.bench.shadow import classify, compare, token_diff
from kite.cli.main import app
from tests.conftest import parse_json
from tests.test_bench import DOC_A, DOC_B, _case, one_thread  # noqa: F401 - fixture

runner = CliRunner()


@pytest.mark.parametrize("golden, candidate, expected", [
    ("The court of Shanghai.", "The court of Shanghai.", "identical"),
    ("The court of Shanghai.", "The court of Shanghai", "whitespace_punctuation"),
    ("The court of  Shanghai, here", "The court of Shanghai here", "whitespace_punctuation"),
    ("The court of Shanghai.", "A court in Shanghai.", "stop_words"),
    ("It is the court of Shanghai.", "court of Shanghai", "stop_words"),
    ("The court of Shanghai.", "The court of Beijing.", "substantive"),
    ("10 days", "ten days", "substantive"),
])
def test_classify(golden, candidate, expected):
    assert classify(golden, candidate) == expected


def test_token_diff_and_noise_floor():
    assert token_diff("pay 10 days", "pay 20 days") == [{"op": "replace", "golden": "10", "candidate": "20"}]
    ids, qs = ["a", "b", "c", "d"], ["?"] * 4
    golden = ["x 1", "y 2", "z 3", "w 4"]
    again = ["x 1", "y 9", "z 3", "w 4"]  # the golden config disagrees with itself once: floor 25%
    cand = ["x 1", "y 8", "z 7", "w 4."]
    rep = compare(ids, qs, golden, again, cand, max_substantive=0.2)
    assert rep.rates["substantive"] == 0.5 and rep.noise_floor == 0.25 and rep.excess == 0.25
    assert rep.rates["whitespace_punctuation"] == 0.25 and not rep.passed
    assert [e["id"] for e in rep.examples] == ["b", "c"]
    assert compare(ids, qs, golden, again, cand, max_substantive=0.3).passed


@pytest.fixture()
def files(tmp_path, tiny_models):
    cases = tmp_path / "cases.jsonl"
    cases.write_text("".join(json.dumps(c) + "\n" for c in [
        _case("a", DOC_A, "qa", "Which court settles a breach?", "the court of Shanghai"),
        _case("b", DOC_B, "needle", "What is the capital of France?", "Paris")]))
    golden = tmp_path / "golden.yaml"
    golden.write_text("name: golden\nmethod: full\ntemperature: 0\nmax_new_tokens: 4\n")
    return {"cases": cases, "golden": golden, "model": str(tiny_models["llama"]), "tmp": tmp_path}


def _shadow(files, candidate_yaml: str, *extra):
    cand = files["tmp"] / "candidate.yaml"
    cand.write_text(candidate_yaml)
    return runner.invoke(app, ["shadow", "--golden", str(files["golden"]), "--candidate", str(cand),
                               "--cases", str(files["cases"]), "--model", files["model"],
                               "--upcycle", str(files["tmp"] / "states"), "--json", *extra])


def test_shadow_same_config_passes(files):
    r = _shadow(files, "name: same\nmethod: full\nmax_new_tokens: 4\n")
    assert r.exit_code == 0, r.output
    rep = parse_json(r.stdout)
    assert rep["rates"]["identical"] == 1.0 and rep["noise_floor"] == 0.0 and rep["passed"]


def test_shadow_sampled_candidate_fails(files):
    r = _shadow(files, "method: full\ntemperature: 5.0\nseed: 3\nmax_new_tokens: 4\n",
                "--max-substantive", "0")
    rep = parse_json(r.stdout)
    assert rep["substantive_rate"] > 0 and rep["examples"]
    assert r.exit_code == 1


def test_shadow_bad_config(files):
    r = _shadow(files, "method: full\ntemprature: 0.5\n")
    assert r.exit_code == 2 and "unknown key 'temprature'; did you mean 'temperature'?" in r.stderr


def test_shadow_fused_is_reproducible_and_sampled_noise_floor(files):
    from tests.test_bench import RULES

    tmp = files["tmp"]
    (tmp / "rules.yaml").write_text(RULES)
    (tmp / "upcycle.yaml").write_text(
        "compression: {svd_ratio: 0.25, cluster_num: 2, min_span_tokens: 8, max_span_tokens: 24}\n"
        "semantic_tagging: {labels: [], generated_examples_per_label: 0}\n")
    fused = (f"method: fused\nrules: {tmp / 'rules.yaml'}\nupcycle_config: {tmp / 'upcycle.yaml'}\n"
             "max_new_tokens: 4\n")
    files["golden"].write_text(fused)
    r = _shadow(files, fused)  # greedy, a fresh health store per pass: the same answers
    assert r.exit_code == 0, r.output
    rep = parse_json(r.stdout)
    assert rep["rates"]["identical"] == 1.0 and rep["noise_floor"] == 0.0
    files["golden"].write_text(fused + "temperature: 2.0\nseed: 1\n")
    r = _shadow(files, fused + "temperature: 2.0\nseed: 1\n", "--max-substantive", "1")
    rep = parse_json(r.stdout)
    assert r.exit_code == 0 and rep["rates"]["identical"] == 1.0  # same config, same seed
    assert sum(rep["noise_rates"].values()) == pytest.approx(1.0, abs=1e-3)
