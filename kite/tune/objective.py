"""What a sweep optimizes, over the figures of one point (the fused pipeline's overall figures in
its bench run, kite.bench.report, plus `qps` and `bytes`): the metric names, each with a
direction. What it must respect is in kite.tune.constraints."""

from __future__ import annotations

from dataclasses import dataclass

from kite.errors import BadInput


def metrics() -> dict[str, str]:
    """Every metric an objective or constraint may name, with its meaning."""
    from kite.bench.thresholds import METRICS

    return {**METRICS,
            "qps": "requests per second one stream serves: 1000 / avg_latency_ms (load + prompt prefill + decode)",
            "bytes": "mean state bytes per case (the .upc the fused pipeline reads from; for kv_budget_tokens, "
                     "the document's share of the budgeted cache)"}


# Which way is better. The seed's objectives are qps, ttft_ms, f1, ppl_delta and bytes.
MAXIMIZE = frozenset({"qps", "tokens_per_s", "compression_ratio", "yoco_hit_rate", "load_helped_rate", "f1",
                      "exact_match", "f1_delta", "ttft_speedup", "latency_speedup"})


@dataclass(frozen=True, slots=True)
class Objective:
    name: str
    maximize: bool

    @property
    def direction(self) -> str:
        return "maximize" if self.maximize else "minimize"

    def better(self, a: float, b: float) -> bool:
        return a > b if self.maximize else a < b

    def to_dict(self) -> dict:
        return {"name": self.name, "direction": self.direction}


def parse_objective(name: str) -> Objective:
    """An objective by metric name (`qps`, `ttft_ms`, `f1`, `ppl_delta`, `bytes`, or any bench
    metric); BadInput with a did-you-mean for another name."""
    from kite.yoco.signals import suggest

    name = name.strip()
    known = metrics()
    if name not in known:
        hint = suggest(name, list(known))
        raise BadInput(f"--objective {name!r}: unknown metric" + (f"; did you mean {hint!r}?" if hint else "")
                       + f" (metrics: {', '.join(known)})")
    return Objective(name, name in MAXIMIZE)


def figures_of(bench_result: dict, method: str = "fused") -> dict:
    """A point's figures: `method`'s overall figures in its bench run (the fused pipeline's, or
    `budget`'s when the point tunes the memory-budgeted cache), the run's peak memory, `qps` and
    `bytes`."""
    fused = dict(((bench_result.get("summary") or {}).get("overall") or {}).get(method) or {})
    rows = bench_result.get("cases") or []
    out = {k: fused.get(k) for k in metrics() if k in fused}
    if rows:
        out["memory_peak_gb"] = max(r["memory_peak_gb"] for r in rows)
    lat = fused.get("avg_latency_ms")
    out["qps"] = round(1000.0 / lat, 4) if lat else None
    out["bytes"] = fused.get("kv_bytes")
    return out
