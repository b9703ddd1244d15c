"""Pass/fail limits on the fused pipeline's overall figures (`thresholds:` in bench.yaml).

Each entry is `metric: {max: X}` or `metric: {min: X}` (both allowed). The defaults are the seed's
table: avg_latency_ms ≤ 180, upcycle_regenerate_rate ≥ 0.85, yoco_hit_rate ≥ 0.72,
memory_peak_gb ≤ 42.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from pathlib import Path

from kite.errors import BadInput

# Every figure of the fused pipeline's summary a threshold may name (kite.bench.report).
METRICS: dict[str, str] = {
    "avg_latency_ms": "mean end-to-end time per case (load + prompt prefill + decode), ms",
    "ttft_ms": "mean time to first token, ms",
    "tokens_per_s": "mean decode speed after the first token",
    "memory_peak_gb": "peak memory (CUDA max allocated, or peak RSS on the CPU), GB",
    "upcycle_regenerate_rate": "MB of .upc per 1,000 document tokens",
    "compression_ratio": "raw fp16 KV bytes / state bytes",
    "yoco_hit_rate": "among loads, the fraction with a positive measured gain",
    "load_helped_rate": "among loads, the fraction whose reference PPL beats no document at all",
    "f1": "mean answer token F1",
    "exact_match": "mean exact match",
    "ppl": "mean teacher-forced PPL of the reference",
    "ppl_delta": "mean PPL of the reference minus full prefill's",
    "ppl_ratio": "geometric mean of PPL / full prefill's PPL (exp of the mean log-PPL delta)",
    "f1_delta": "mean F1 minus full prefill's",
    "ttft_speedup": "full prefill's mean TTFT / the fused pipeline's",
    "latency_speedup": "full prefill's mean latency / the fused pipeline's",
}

SEED_DEFAULTS = {"avg_latency_ms": {"max": 180.0}, "upcycle_regenerate_rate": {"min": 0.85},
                 "yoco_hit_rate": {"min": 0.72}, "memory_peak_gb": {"max": 42.0}}


@dataclass(frozen=True, slots=True)
class Threshold:
    metric: str
    op: str  # "max" (value ≤ limit) | "min" (value ≥ limit)
    limit: float

    def check(self, value: float | None) -> bool:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return False
        return value <= self.limit if self.op == "max" else value >= self.limit

    def describe(self) -> str:
        return f"{'≤' if self.op == 'max' else '≥'} {self.limit:g}"


def _parse(data: dict, where: str, lines: dict[str, int]) -> list[Threshold]:
    out = []
    for metric, spec in data.items():
        at = f"{where}:{lines.get('thresholds.' + str(metric), '?')}"
        if metric not in METRICS:
            near = difflib.get_close_matches(str(metric), METRICS, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise BadInput(f"{at}: thresholds.{metric}: unknown metric ({hint}known: {', '.join(METRICS)})")
        if not isinstance(spec, dict) or not spec or set(spec) - {"max", "min"}:
            raise BadInput(f"{at}: thresholds.{metric}: expected {{max: X}} and/or {{min: X}}")
        for op, limit in spec.items():
            if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit):
                raise BadInput(f"{at}: thresholds.{metric}.{op}: expected a finite number, got {limit!r}")
            out.append(Threshold(str(metric), op, float(limit)))
    return out


def load_thresholds(path: str | Path | None) -> tuple[list[Threshold], str]:
    """Thresholds from `path` (its `thresholds:` mapping), else configs/bench.yaml of the
    checkout, else the seed's defaults. Returns them and where they came from."""
    from kite.yaml_model import parse_yaml, read_utf8

    if path is None:
        from kite.paths import repo_root

        root = repo_root()
        default = root / "configs" / "bench.yaml" if root else None
        if default is None or not default.exists():
            return _parse(SEED_DEFAULTS, "defaults", {}), "seed defaults"
        path = default
    path = Path(path)
    data, lines = parse_yaml(path, read_utf8(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise BadInput(f"{path}: expected a mapping with a 'thresholds:' key")
    th = data.get("thresholds", SEED_DEFAULTS if "thresholds" not in data else None)
    if not isinstance(th, dict):
        raise BadInput(f"{path}:{lines.get('thresholds', '?')}: 'thresholds' must be a mapping of "
                       "metric: {max: X} / {min: X}")
    return _parse(th, str(path), lines), str(path)


def evaluate(thresholds: list[Threshold], figures: dict) -> list[dict]:
    """One row per threshold: metric, limit, value, pass."""
    return [{"metric": t.metric, "op": t.op, "limit": t.limit, "value": figures.get(t.metric),
             "pass": t.check(figures.get(t.metric))} for t in thresholds]
