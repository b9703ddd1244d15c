"""Bench gates (kite.bench.thresholds): each limit in its metric's unit (another unit refused, one
line), per device class, and the CPU defaults met by a measured CPU run of the embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest

from kite.bench.results import load_result
from kite.bench.thresholds import (DEFAULT_GATES, DEVICE_CLASSES, METRICS, UNITS, device_class, evaluate,
                                   load_thresholds)
from kite.errors import BadInput

ROOT = Path(__file__).resolve().parent.parent
CPU_RUN = ROOT / "benchmarks" / "results" / "bench_run_cpu2_20261202_f89cf9e.json"


def gates(tmp_path, text: str, device: str = "cpu"):
    path = tmp_path / "bench.yaml"
    path.write_text(text)
    return load_thresholds(path, device)


def refusal(tmp_path, text: str) -> str:
    with pytest.raises(BadInput) as err:
        gates(tmp_path, text)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_every_metric_has_a_unit():
    assert set(UNITS) == set(METRICS)


def test_a_limit_in_another_unit_is_refused(tmp_path):
    why = refusal(tmp_path, "thresholds:\n  upcycle_regenerate_rate: {min: 0.85, unit: x}\n")
    assert why.endswith("bench.yaml:2: thresholds.upcycle_regenerate_rate: unit 'x' is not the metric's "
                        "(MB/1K tokens: MB of .upc per 1,000 document tokens); a limit is compared only with a "
                        "figure in its own unit")
    assert "unit 's' is not the metric's (ms" in refusal(tmp_path, "thresholds:\n  cpu:\n    ttft_ms: {max: 1, unit: s}\n")


def test_a_limit_without_a_unit_is_refused(tmp_path):
    assert "give the limit's unit (unit: GB, the unit of memory_peak_gb)" in refusal(
        tmp_path, "thresholds:\n  memory_peak_gb: {max: 4}\n")
    assert "expected {max: X, unit: fraction}" in refusal(tmp_path, "thresholds:\n  f1: {unit: fraction}\n")


def test_gates_per_device_class(tmp_path):
    text = ("thresholds:\n  cpu:\n    avg_latency_ms: {max: 9000, unit: ms}\n"
            "  gpu:\n    avg_latency_ms: {max: 180, unit: ms}\n    f1: {min: 0.5, unit: fraction}\n")
    cpu, source = gates(tmp_path, text, "cpu")
    assert [(t.metric, t.limit, t.unit) for t in cpu] == [("avg_latency_ms", 9000.0, "ms")]
    assert source.endswith("bench.yaml (cpu)")
    assert [t.describe() for t in gates(tmp_path, text, "gpu")[0]] == ["≤ 180 ms", "≥ 0.5 fraction"]
    flat = "thresholds:\n  f1: {min: 0.5, unit: fraction}\n"
    assert gates(tmp_path, flat, "cpu")[0] == gates(tmp_path, flat, "gpu")[0]
    assert "not metrics beside them" in refusal(tmp_path, "thresholds:\n  cpu: {}\n  f1: {min: 1, unit: fraction}\n")
    assert device_class("cuda:1") == "gpu" and device_class("cpu") == "cpu"


def test_the_shipped_bench_yaml_is_the_defaults():
    for device in DEVICE_CLASSES:
        shipped, _ = load_thresholds(ROOT / "configs" / "bench.yaml", device)
        assert [(t.metric, t.op, t.limit, t.unit) for t in shipped] == [
            (metric, op, float(limit), spec["unit"]) for metric, spec in DEFAULT_GATES[device].items()
            for op, limit in spec.items() if op != "unit"]


def test_a_measured_cpu_run_meets_the_cpu_defaults():
    run = load_result(CPU_RUN)
    assert run.machine["kind"] == "cpu"
    figures = {r.name.removeprefix("fused "): r.value for r in run.rows}
    units = {r.name.removeprefix("fused "): r.unit for r in run.rows}
    rows = evaluate(load_thresholds(ROOT / "configs" / "bench.yaml", "cpu")[0], figures)
    assert rows and all(r["pass"] for r in rows), rows
    assert all(units[r["metric"]] == r["unit"] for r in rows)
    # the seed's GPU latency limit is what every CPU run failed
    gpu = {r["metric"]: r["pass"] for r in evaluate(load_thresholds(ROOT / "configs" / "bench.yaml", "gpu")[0], figures)}
    assert gpu["avg_latency_ms"] is False
