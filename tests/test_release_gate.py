"""The model-release gate (scripts/release_gate.sh, docs/ci-cd.md) and its GitHub Actions workflow.

The end-to-end runs (slow) release a copy of the embedded SmolLM2-135M whose final norm is scaled
(its weights, hence its fingerprint, differ; every layer's K and V are as before) on one short
contract asked two questions with 8-token answers: the previous release's state is migrated to the
new fingerprint and reused by the bench, the shadow and the tune steps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
GATE = ROOT / "scripts" / "release_gate.sh"
REPORT = ROOT / "scripts" / "release_gate_report.py"
WORKFLOW = ROOT / ".github" / "workflows" / "release-gate.yml"
KITE = str(Path(sys.executable).parent / "kite")
STEPS = ["build-runtime", "model-info", "migrate", "bench", "shadow", "tune"]


def gate(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GATE), "--kite", KITE, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=600)


# --- the workflow -------------------------------------------------------------------------------

def test_workflow_parses_and_names_every_step():
    wf = yaml.safe_load(WORKFLOW.read_text())
    on = wf[True]  # YAML 1.1 reads the key `on` as a boolean; GitHub reads it as `on`
    assert on["push"]["tags"] and "new_model" in on["workflow_dispatch"]["inputs"]
    assert on["workflow_dispatch"]["inputs"]["new_model"]["required"] is True
    (job,) = wf["jobs"].values()
    assert job["timeout-minutes"] <= 90
    steps = job["steps"]
    assert all(isinstance(s.get("name"), str) and s["name"].strip() for s in steps)
    assert all(("uses" in s) != ("run" in s) for s in steps)
    runs = [s.get("run", "") for s in steps]
    install, test, release = (next(i for i, r in enumerate(runs) if r.strip().startswith(cmd))
                              for cmd in ("make install", "make test", "scripts/release_gate.sh"))
    assert install < test < release
    venv = next(s for s in steps if s.get("uses", "").startswith("actions/cache") and s["with"]["path"] == ".venv")
    assert "hashFiles('constraints.txt')" in venv["with"]["key"]
    assert "inputs.new_model" in job["env"]["KITE_GATE_NEW_MODEL"]


# --- the script's own checks (nothing slow runs) ------------------------------------------------

@pytest.mark.parametrize("args, message", [
    ([], "give --new-model"),
    (["--new-model", "smollm2-135m"], "give --states DIR"),
    (["--new-model", "smollm2-135m", "--states", "s"], "give --old-model or --old-fingerprint"),
    (["--new-model", "m", "--states", "s", "--old-model", "a", "--old-fingerprint", "b"], "not both"),
    (["--new-model", "m", "--states", "s", "--old-model", "a", "--bogus"], "unknown argument '--bogus'"),
    (["--new-model", "m", "--states", "s", "--old-model", "a", "--skip", "lint"], "--skip lint: not a step"),
    (["--new-model", "m", "--states", "s", "--old-model", "a", "--tune-param", "ratio"], "expected NAME=V1,V2"),
    (["--new-model", "m", "--states", "s", "--old-model", "a", "--cases", "nope.jsonl"], "--cases nope.jsonl: no such file"),
    (["--new-model"], "--new-model needs a value"),
])
def test_bad_usage_is_exit_2_before_anything_runs(tmp_path, args, message):
    r = gate(*args, "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and r.stdout == ""
    assert not (tmp_path / "out").exists() and not (tmp_path / "s").exists()


def test_inputs_from_the_environment(tmp_path):
    r = gate(env={"KITE_GATE_NEW_MODEL": "m", "KITE_GATE_STATES": "s", "KITE_GATE_OLD_MODEL": "a",
                  "KITE_GATE_CASES": "missing.jsonl"}, cwd=tmp_path)
    assert r.returncode == 2 and "--cases missing.jsonl: no such file" in r.stderr


def test_help_lists_every_step():
    r = gate("--help")
    assert r.returncode == 0 and all(s in r.stdout for s in STEPS)


def test_shipped_shadow_configs_are_one_pipeline():
    from kite.bench.shadow import load_shadow_config

    golden = load_shadow_config(ROOT / "configs" / "shadow_golden.yaml")
    candidate = load_shadow_config(ROOT / "configs" / "shadow_candidate.yaml")
    assert golden.model_copy(update={"name": None}) == candidate.model_copy(update={"name": None})
    assert golden.temperature == 0  # greedy: the noise floor is 0


# --- the reasons the summary gives, from each step's --json output ------------------------------

def _reason(tmp_path, step: str, rc: int, doc: dict | None, log: str = "") -> str:
    out, logf = tmp_path / f"{step}.json", tmp_path / f"{step}.log"
    out.write_text(json.dumps(doc) if doc is not None else "")
    logf.write_text(log)
    r = subprocess.run([sys.executable, str(REPORT), "reason", step, str(rc), str(out), str(logf)],
                       capture_output=True, text=True, check=True)
    return r.stdout.strip()


def test_reasons_name_what_failed(tmp_path):
    bench = {"cases": [{"state": {"file": "a.upc", "reused": True}}], "cases_total": 1, "error": None,
             "thresholds_source": "bench.yaml", "summary": {"overall": {}},
             "thresholds": [{"metric": "avg_latency_ms", "op": "max", "limit": 180.0, "value": 1036.93, "pass": False},
                            {"metric": "yoco_hit_rate", "op": "min", "limit": 0.72, "value": None, "pass": False},
                            {"metric": "memory_peak_gb", "op": "max", "limit": 42.0, "value": 1.2, "pass": True}]}
    assert _reason(tmp_path, "bench", 1, bench) == (
        "avg_latency_ms 1037 above its max 180; yoco_hit_rate not measured (limit min 0.72) (bench.yaml)")
    migrate = {"old": "3f4a7011d963", "new": "kite-fp1:3f4a7011d963aa", "files": [
        {"action": "skip", "reason": "already on the new fingerprint"},
        {"action": "skip", "reason": "made by 0123456789ab"}]}
    assert _reason(tmp_path, "migrate", 0, migrate) == (
        "nothing to move: 1 state already on 3f4a7011d963 (the old and new model have the same "
        "fingerprint); 1 made by other models left alone")
    refused = {"old": "aaaaaaaaaaaa", "new": "bbbbbbbbbbbb", "files": [
        {"action": "refuse", "reason": "the new model's KV geometry differs"}, {"action": "migrate", "reason": ""}]}
    assert _reason(tmp_path, "migrate", 1, refused) == "1 of 2 states refused: the new model's KV geometry differs"
    tune = {"points": [{}], "error": None, "best": None, "broken": [
        {"constraint": "f1 > 1", "points": [{"params": {"ratio": 4.0}, "why": "f1 0.5 (needs > 1)"}]}]}
    assert _reason(tmp_path, "tune", 1, tune) == (
        "no point of 1 meets the constraints: f1 > 1 broken by 1 (e.g. ratio=4: f1 0.5 (needs > 1))")
    # bad input (exit 2) or no JSON: the step's own one-line error, progress lines left out
    log = "error: cases.jsonl:2:14: invalid JSON\n[    3.0s] cases 1/2\n"
    assert _reason(tmp_path, "bench", 2, None, log) == "cases.jsonl:2:14: invalid JSON"


# --- end to end on the embedded model (slow) ----------------------------------------------------

def _env(home: Path) -> dict:
    return {"KITE_HOME": str(home)}


@pytest.fixture(scope="module")
def gate_inputs(tmp_path_factory):
    """A short contract asked two questions (qa, needle), lenient thresholds, a greedy 8-token
    shadow pipeline, and the previous release's states: `kite bench run` on the embedded model."""
    from kite.data import generate_contracts

    root = tmp_path_factory.mktemp("gate")
    (contract,) = generate_contracts(1, 500, seed=3)
    contract["questions"] = [next(q for q in contract["questions"] if q["family"] == fam) for fam in ("qa", "needle")]
    cases = root / "cases.jsonl"
    cases.write_text(json.dumps(contract) + "\n")
    thresholds = root / "bench.yaml"
    thresholds.write_text("thresholds:\n  compression_ratio: {min: 2, unit: x}\n  memory_peak_gb: {max: 42, unit: GB}\n")
    shadow = root / "shadow.yaml"
    shadow.write_text("method: fused\nratio: 4\ntemperature: 0\nmax_new_tokens: 8\n")
    states = root / "old-states"
    r = subprocess.run([KITE, "bench", "run", "--cases", str(cases), "--baselines", "full", "--max-cases", "1",
                        "--max-new-tokens", "4", "--threads", "1", "--upcycle", str(states), "--mkdir",
                        "--thresholds", str(thresholds), "--output", str(root / "previous.json")],
                       capture_output=True, text=True, env={**os.environ, **_env(root / "home")})
    assert r.returncode == 0, r.stderr
    assert len(list(states.glob("*.upc"))) == 1
    return {"root": root, "cases": cases, "thresholds": thresholds, "shadow": shadow, "states": states}


@pytest.fixture(scope="module")
def new_model(tmp_path_factory):
    """The embedded model's converted folder with the final norm's weight scaled by 1.01: other
    weights, other fingerprint, the same KV."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kite.model.convert import SOURCE_RECORD
    from kite.model.loader import load_config_only

    _, folder, _ = load_config_only("smollm2-135m")
    out = tmp_path_factory.mktemp("new-model") / "SmolLM2-135M-release"
    out.mkdir()
    for f in Path(folder).iterdir():
        if f.name not in ("model.safetensors", SOURCE_RECORD):
            shutil.copy2(f, out / f.name)
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as fh:
        meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.01
    save_file(tensors, str(out / "model.safetensors"), metadata=meta)
    yield out
    shutil.rmtree(out, ignore_errors=True)  # 538 MB


def _common(inputs: dict, tmp_path: Path, states: Path) -> list[str]:
    skip = [] if shutil.which(os.environ.get("CXX", "g++")) else ["--skip", "build-runtime"]
    return ["--states", str(states), "--cases", str(inputs["cases"]), "--out", str(tmp_path / "out"),
            "--thresholds", str(inputs["thresholds"]), "--golden", str(inputs["shadow"]),
            "--candidate", str(inputs["shadow"]), "--max-new-tokens", "8", "--threads", "1", *skip]


@pytest.mark.slow
def test_release_gate_end_to_end(gate_inputs, new_model, tmp_path):
    from kite.upcycle import StateFile

    states = tmp_path / "states"
    shutil.copytree(gate_inputs["states"], states)
    r = gate("--new-model", str(new_model), "--old-model", "smollm2-135m",
             *_common(gate_inputs, tmp_path, states), "--tune-param", "ratio=4,8",
             "--tune-objective", "f1", "--tune-constraint", "ppl_ratio < 20", "--json",
             env=_env(tmp_path / "home"))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary == json.loads((tmp_path / "out" / "release_gate.json").read_text())
    assert summary["passed"] and summary["exit_code"] == 0 and summary["failed_step"] is None
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == STEPS
    assert all(s["status"] == "passed" or (s["name"] == "build-runtime" and s["status"] == "skipped")
               for s in summary["steps"]), summary["steps"]
    new_fp, old_fp = steps["model-info"]["new_fingerprint"], steps["model-info"]["old_fingerprint"]
    assert new_fp != old_fp
    assert steps["migrate"]["reason"].startswith(f"moved 1 state {old_fp[9:21]} → {new_fp[9:21]}")
    (previous,) = gate_inputs["states"].glob("*.upc")
    with StateFile(states / previous.name) as sf:  # bench states keep their names: migrate rewrote it
        assert sf.meta["fingerprints"]["combined"] == new_fp
        assert sf.meta["fingerprints"]["migrated_from"] == old_fp
    assert "states: 1 reused, 0 made" in steps["bench"]["reason"]  # the migrated state, not a new one
    assert "substantive 0.0%" in steps["shadow"]["reason"]
    assert steps["tune"]["reason"].startswith("best of 2 points: ratio=")
    best = yaml.safe_load((tmp_path / "out" / "tune" / "best_config.yaml").read_text())
    assert best["features"]["upcycle_compression_ratio"] in (0.25, 0.125)
    assert "release gate: PASSED" in r.stderr


@pytest.mark.slow
def test_failing_bench_gate_stops_the_release(gate_inputs, tmp_path):
    """Old = new = the embedded model: migrate says there is nothing to move; an impossible F1
    threshold fails the bench gate: exit 1, named, and shadow and tune never run."""
    states = tmp_path / "states"
    shutil.copytree(gate_inputs["states"], states)
    impossible = tmp_path / "impossible.yaml"
    impossible.write_text("thresholds:\n  f1: {min: 1.5, unit: fraction}\n")
    args = _common(gate_inputs, tmp_path, states)
    args[args.index("--thresholds") + 1] = str(impossible)
    r = gate("--new-model", "smollm2-135m", "--old-model", "smollm2-135m", *args, "--max-cases", "1",
             env=_env(tmp_path / "home"))
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.rstrip().splitlines()[-1].startswith("release gate: bench failed (exit 1): f1 ")
    assert "release gate: FAILED at bench (exit 1)" in r.stdout
    summary = json.loads((tmp_path / "out" / "release_gate.json").read_text())
    assert (summary["passed"], summary["exit_code"], summary["failed_step"]) == (False, 1, "bench")
    assert "below its min 1.5" in summary["reason"]
    status = {s["name"]: s["status"] for s in summary["steps"]}
    assert (status["bench"], status["shadow"], status["tune"]) == ("failed", "not_run", "not_run")
    migrate = next(s for s in summary["steps"] if s["name"] == "migrate")
    assert migrate["reason"] == ("nothing to move: 1 state already on 3f4a7011d963 (the old and new model "
                                 "have the same fingerprint)")


@pytest.mark.slow
def test_bad_input_to_a_step_is_exit_2_and_names_it(gate_inputs, tmp_path):
    """A tune constraint naming no metric: kite tune refuses it (exit 2) before its model loads."""
    r = gate("--new-model", "smollm2-135m", *_common(gate_inputs, tmp_path, tmp_path / "states"),
             "--skip", "build-runtime,migrate,bench,shadow", "--tune-constraint", "ppl_detla < 0.5",
             env=_env(tmp_path / "home"))
    assert r.returncode == 2, r.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "release_gate.json").read_text())
    assert (summary["exit_code"], summary["failed_step"]) == (2, "tune")
    assert "did you mean 'ppl_delta'?" in summary["reason"]
    assert [s["status"] for s in summary["steps"]] == ["skipped", "passed", "skipped", "skipped", "skipped", "failed"]
