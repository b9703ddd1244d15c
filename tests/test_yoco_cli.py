"""`kite yoco validate|decide|fields` through the root app: exit codes, reports, --json."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kite.cli.main import app

RULES = Path(__file__).resolve().parent.parent / "rules"
BAD = """rules:
  - name: vague
    condition: intent_entropi > 5.2
    action: {load_all_clusters: true, precision: fp12}
  - name: op
    condition: hardware_watermark.gpu_mem => 0.9
    action: {skip: true}
  - name: default
    action: {load_all_clusters: true}
"""


def run(*args: str):
    return CliRunner().invoke(app, ["yoco", *args])


def test_validate_ok():
    r = run("validate", str(RULES / "yoco_rules.yaml"), "--labels", "违约责任,管辖法院", "--layers", "30")
    assert r.exit_code == 0, r.output
    assert "ok" in r.stdout and "6 rules" in r.stdout


def test_validate_reports_every_error_with_carets_and_exits_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD, encoding="utf-8")
    r = run("validate", str(path))
    assert r.exit_code == 2
    err = r.stderr
    assert f"{path}:3:16: unknown field 'intent_entropi'; did you mean 'intent_entropy'?" in err
    assert f"{path}:4:50: bad precision 'fp12'" in err
    assert f"{path}:6:43: bad operator '=>'; did you mean '>='?" in err
    assert "    condition: hardware_watermark.gpu_mem => 0.9\n" in err
    assert "\n" + " " * 46 + "^~\n" in err
    assert err.strip().splitlines()[-1].startswith(f"error: {path}: 3 errors in the rule set")


def test_validate_json(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD, encoding="utf-8")
    r = run("validate", str(path), "--json")
    assert r.exit_code == 2
    doc = json.loads(r.stdout)
    assert doc["ok"] is False
    assert [(e["line"], e["col"]) for e in doc["errors"]] == [(3, 16), (4, 50), (6, 43)]
    r = run("validate", str(RULES / "yoco_rules_v2.yaml"), "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["ok"] and doc["version"] == "v2" and len(doc["sha256"]) == 64


def test_validate_checks_labels_and_layers():
    r = run("validate", str(RULES / "yoco_rules.yaml"), "--layers", "12")
    assert r.exit_code == 2 and "layer 12 is out of range 0-11" in r.stderr


def test_validate_missing_file():
    r = run("validate", "nope.yaml")
    assert r.exit_code == 2 and "nope.yaml: no such rule file" in r.stderr


def test_decide_json_and_human(tmp_path):
    sig = {"hardware_watermark.gpu_mem": 0.95, "query_label": "违约责任", "label_entropy": 0.2}
    r = run("decide", "--rules", str(RULES / "yoco_rules.yaml"), "--signals", json.dumps(sig),
            "--labels", "违约责任=0.8,管辖法院", "--layers", "30", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["plan"]["matched_rule"] == "memory_pressure"
    assert doc["plan"]["clusters"] == ["违约责任"] and doc["plan"]["precision"] == "int4"
    assert doc["signals"]["state_health_score"] > 0 and doc["rules"]["version"] == "v1"
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"hardware_watermark": {"spike": True}, "query_label": "管辖法院"}))
    r = run("decide", "--rules", str(RULES / "yoco_rules.yaml"), "--signals", f"@{f}",
            "--labels", "违约责任=0.8,管辖法院=0.55", "--min-hit-gain", "0.005")
    assert r.exit_code == 0, r.output
    assert "memory_pressure" in r.stdout and "predicted gain 0.002 < yoco_min_hit_gain 0.005" in r.stdout


def test_decide_bad_input_exits_2():
    rules = str(RULES / "yoco_rules.yaml")
    r = run("decide", "--rules", rules, "--signals", '{"intent_entropi": 3}')
    assert r.exit_code == 2 and "did you mean 'intent_entropy'" in r.stderr
    r = run("decide", "--rules", rules, "--signals", "{not json")
    assert r.exit_code == 2 and "--signals:1:2: not JSON" in r.stderr
    r = run("decide", "--rules", rules, "--signals", "{}", "--labels", "a=2")
    assert r.exit_code == 2 and "health must be in 0-1" in r.stderr


def test_fields_json():
    r = run("fields", "--json")
    assert r.exit_code == 0
    names = [f["name"] for f in json.loads(r.stdout)]
    assert "hardware_watermark.spike" in names and "intent_entropy" in names


def test_assume_errors_name_assume(tmp_path):
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"query": "who pays?"}\n')
    r = run("analyze", "--queries", str(queries), "--assume", "{bad json")
    assert r.exit_code == 2 and "--assume:1:2: not JSON" in r.stderr and "--signals" not in r.stderr
    r = run("analyze", "--queries", str(queries), "--assume", f"@{tmp_path / 'none.json'}")
    assert r.exit_code == 2 and "--assume @" in r.stderr and "no such file" in r.stderr


def test_min_hit_gain_below_zero_is_refused():
    rules = str(RULES / "yoco_rules.yaml")
    r = run("decide", "--rules", rules, "--signals", "{}", "--min-hit-gain", "-5", "--json")
    assert r.exit_code == 2 and r.stdout == "" and "--min-hit-gain" in r.stderr
    r = run("decide", "--rules", rules, "--signals", "{}", "--min-hit-gain", "0", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["min_hit_gain"] == 0


def test_the_configs_rules_file_is_every_commands_default(tmp_path, kite_home, monkeypatch):
    """yoco.rules_file (config file or KITE_YOCO__RULES_FILE) is the rule file `yoco decide` uses
    without --rules, as `kite serve` does; --rules beats it."""
    only = tmp_path / "only.yaml"
    only.write_text("version: v7\nrules:\n  - name: the_only_rule\n    condition: true\n"
                    "    action: {load_all_clusters: true}\n")
    monkeypatch.setenv("KITE_YOCO__RULES_FILE", str(only))
    r = run("decide", "--signals", "{}", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["plan"]["matched_rule"] == "the_only_rule"
    r = run("decide", "--rules", str(RULES / "yoco_rules.yaml"), "--signals", "{}", "--json")
    assert json.loads(r.stdout)["plan"]["matched_rule"] != "the_only_rule"
    monkeypatch.setenv("KITE_YOCO__RULES_FILE", str(tmp_path / "missing.yaml"))
    r = run("decide", "--signals", "{}", "--json")
    assert r.exit_code == 2 and "missing.yaml: no such rule file" in r.output
