"""`kite yoco decide --state X.upc --query TEXT` on a tiny random model: signals from the model,
health from the store, the matched rule and the plan; usage errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kite.cli.main import app

RULES = """rules:
  - name: pressure
    condition: hardware_watermark.spike OR hardware_watermark.gpu_mem > 0.99
    action: {load_cluster: $query_label, layers: "0-1", precision: int4}
  - name: vague
    condition: intent_entropy > 100
    action: {skip: true}
  - name: default
    condition: true
    action: {load_all_clusters: true, precision: int8}
"""


@pytest.fixture(scope="module")
def state(tiny_contract_state):
    return tiny_contract_state[2]


def run(*args: str):
    return CliRunner().invoke(app, ["yoco", *args])


def test_decide_state_json(state, tiny_models, tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES, encoding="utf-8")
    r = run("decide", "--state", str(state), "--query", "Which court settles a breach?", "--model",
            str(tiny_models["llama"]), "--rules", str(rules), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    sig = doc["signals"]
    assert sig["intent_entropy"] > 0 and sig["query_label"] and 0 <= sig["state_health_score"] <= 1
    assert "hardware_watermark.gpu_mem" in sig and doc["watermark_source"]
    assert doc["matched_rule"] == doc["plan"]["matched_rule"] == "default"
    assert doc["plan"]["clusters"] == "all" and doc["plan"]["precision"] == "int8"
    assert doc["n_layers"] == 3 and doc["state_id"] == "contract" and doc["query_tokens"] > 0
    human = run("decide", "--state", str(state), "--query", "Which court settles a breach?", "--model",
                str(tiny_models["llama"]), "--rules", str(rules))
    assert human.exit_code == 0, human.output
    assert "matched default" in " ".join(human.stdout.split()) and "signals" in human.stdout


@pytest.mark.parametrize("json_out", [True, False], ids=["json", "human"])
def test_decide_state_compiles_the_rule_set_once(state, tiny_models, tmp_path, rule_compiles, json_out):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES, encoding="utf-8")
    r = run("decide", "--state", str(state), "--query", "Which court settles a breach?", "--model",
            str(tiny_models["llama"]), "--rules", str(rules), *(["--json"] if json_out else []))
    assert r.exit_code == 0, r.output
    assert rule_compiles == [str(rules)]


def test_decide_state_reports_a_bad_rule_file_with_its_carets(state, tiny_models, tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES.replace('layers: "0-1"', 'layers: "0-9"'), encoding="utf-8")
    r = run("decide", "--state", str(state), "--query", "Which court settles a breach?", "--model",
            str(tiny_models["llama"]), "--rules", str(rules))
    assert r.exit_code == 2
    assert f"{rules}:4:51: layer 9 is out of range 0-2 (the model has 3 layers)" in r.stderr
    assert "^~~" in r.stderr and r.stderr.strip().splitlines()[-1].startswith(
        f"error: {rules}: 1 error in the rule set")


def test_decide_state_usage_errors(state, tmp_path):
    r = run("decide", "--state", str(state))
    assert r.exit_code == 2 and "--state needs --query" in r.stderr
    r = run("decide", "--state", str(state), "--query", "  ")
    assert r.exit_code == 2 and "--query is empty" in r.stderr
    r = run("decide", "--signals", "{}", "--state", str(state), "--query", "x")
    assert r.exit_code == 2 and "either --signals, or --state" in r.stderr
    r = run("decide")
    assert r.exit_code == 2
    r = run("decide", "--signals", "{}", "--query", "x")
    assert r.exit_code == 2 and "--query needs --state" in r.stderr
