"""benchmarks/serve_gpu.py --cpu-smoke end to end: a tiny random Qwen2 folder, `kite serve` started
for the `none` and `raw` modes (lanes skipped on the CPU, with its reason), states uploaded over HTTP,
1 and 4 streamed clients; the result file reads back through the library with a row of each kind
per mode and client count, the raw mode's rows measured against `none` at the same count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kite.bench.results import load_attached, load_result

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow   # two `kite serve` processes and an upload: ~35 s on the 2-core machine


def test_the_cpu_smoke_run_serves_both_modes_and_writes_every_row(tmp_path):
    out = tmp_path / "serve_gpu.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_gpu.py"), "--cpu-smoke", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "lanes: skipped: " in run.stdout
    res = load_result(out)
    assert res.benchmark == "serve_gpu" and res.machine["kind"] == "cpu"
    rows = {r.name: r for r in res.rows}
    for mode in ("none", "raw"):
        for clients in (1, 4):
            tag = f"{mode}, {clients} clients"
            assert rows[f"{tag}: completion tokens/s"].value > 0
            assert 0 < rows[f"{tag}: TTFT p50"].value <= rows[f"{tag}: TTFT p99"].value
            assert rows[f"{tag}: decode step, server mean"].value > 0
            assert rows[f"{tag}: requests refused"].value == 0
            assert rows[f"{tag}: requests not finished by the deadline"].value == 0
    for clients in (1, 4):
        tag = f"raw, {clients} clients"
        assert rows[f"{tag}: answered without the state"].value == 0
        assert rows[f"{tag}: TTFT p50"].baseline == f"none, {clients} clients: TTFT p50"
        assert rows[f"{tag}: completion tokens/s"].x_baseline is not None
    assert not any(name.startswith("lanes") for name in rows)
    runs = res.raw["runs"]
    assert res.raw["attached"] == {"records": "serve_gpu.records.json.gz"}
    records = load_attached(res, "records")          # every request, beside the result file
    assert set(records) == {"none", "raw"} and "records" not in runs["raw"]["rounds"]["4"]
    recs = records["raw"]["4"]
    assert len(recs) == 4 and all(r["status"] == "ok" and 1 <= r["tokens"] <= 8 for r in recs)
    assert all(r["kite"]["loaded"] and r["kite"]["load"]["resident"] == "raw" for r in recs)
    assert runs["raw"]["rounds"]["4"]["loads_from_prefix_cache"] == 4     # every document asked about once before
    assert [s["tokens"] for s in runs["raw"]["states"]] == [256, 256]
    assert {r["doc"] for r in recs} == {0, 1}
    # every request's TTFT splits into the server's part and the rest, which the client's part bounds
    for r in recs:
        k = r["kite"]
        inside = k["wait_ms"] + k["timings_ms"]["signals_and_decision"] + k["timings_ms"]["load"] + \
            k["generation"]["ttft_ms"]
        assert 0 < inside <= r["ttft_s"] * 1e3
    round4 = runs["raw"]["rounds"]["4"]
    assert 0 < round4["ttft_in_server_p50_ms"] and round4["ttft_outside_server_p50_ms"] >= 0
    # the collector's pauses in the server during the round (the generations that ran; the young one
    # runs every few hundred allocations)
    pauses = round4["gc_pauses"]
    assert pauses["0"]["count"] >= 1 and all(p["count"] >= 1 and p["total_ms"] >= 0 for p in pauses.values())


@pytest.mark.parametrize("flags, says", [(["--modes", "vllm"], "--modes 'vllm'"),
                                         (["--clients", "1,x"], "--clients '1,x'"),
                                         (["--clients", "0"], "--clients '0'"),
                                         (["--tokens", "0"], "--tokens must be at least 1")])
def test_a_bad_flag_fails_before_any_model_is_written(tmp_path, flags, says):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_gpu.py"), "--cpu-smoke", *flags,
                          "--out", str(tmp_path / "x.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and says in run.stderr, run.stderr[-2000:]
    assert "writing a random-weight" not in run.stdout
    assert not (tmp_path / "x.json").exists()


def test_the_baselines_ttft_floor_is_its_documents_prefill_at_the_gpus_rate():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from harness.floors import flops_ms
    from serve_gpu import prefill_floor

    info = {"params": 7_615_616_512, "layers": 28, "hidden": 3584}
    floor = prefill_floor(info, 16384)
    flops = 2 * 7_615_616_512 * 16384 + 2 * 28 * 16384 ** 2 * 3584     # weights' products + causal attention
    assert floor["floor_value"] == pytest.approx(flops_ms(flops))
    assert 250 < floor["floor_value"] < 600        # ~3e14 FLOPs: a few hundred ms on an H200-class GPU
    assert f"{flops:.3g} FLOPs" in floor["floor"]
