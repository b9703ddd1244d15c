"""Figures from per-case results: per method, overall and per case family; ratios to full
prefill; the fused pipeline's headline figures that thresholds check."""

from __future__ import annotations

import math
from statistics import mean

from kite.bench.cases import FAMILIES


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return round(mean(xs), 4) if xs else None


def method_figures(rows: list[dict], name: str) -> dict:
    """Means over `rows` (case results) of method `name`."""
    ms = [r["methods"][name] for r in rows if name in r["methods"]]
    if not ms:
        return {}
    out = {k: _mean([m.get(k) for m in ms]) for k in
           ("avg_latency_ms", "ttft_ms", "tokens_per_s", "f1", "exact_match", "ppl", "ppl_delta",
            "f1_delta", "kv_bytes", "kl_mean", "top1")}
    out["avg_latency_ms"] = _mean([m["latency_ms"] for m in ms])
    out["memory_peak_gb"] = max(m["memory_peak_gb"] for m in ms)
    raw = _mean([r["document_raw_kv_bytes"] for r in rows])
    out["compression_ratio"] = round(raw / out["kv_bytes"], 3) if raw and out["kv_bytes"] else None
    out["cases"] = len(ms)
    full = [r["methods"]["full"] for r in rows if "full" in r["methods"] and name in r["methods"]]
    if full:
        ft, fl = _mean([m["ttft_ms"] for m in full]), _mean([m["latency_ms"] for m in full])
        out["ttft_speedup"] = round(ft / out["ttft_ms"], 3) if out["ttft_ms"] else None
        out["latency_speedup"] = round(fl / out["avg_latency_ms"], 3) if out["avg_latency_ms"] else None
    if name == "fused":
        loads = [m for m in ms if m.get("loaded")]
        gains = [m["gain"] for m in loads if m.get("gain") is not None]
        out["loads"] = len(loads)
        out["yoco_hit_rate"] = round(sum(g > 0 for g in gains) / len(gains), 4) if gains else None
        out["upcycle_regenerate_rate"] = _mean([r["state"]["regenerate_rate"] for r in rows])
    return out


def summarize(rows: list[dict], methods: list[str]) -> dict:
    overall = {m: method_figures(rows, m) for m in methods}
    families = {}
    for fam in FAMILIES:
        sub = [r for r in rows if r["family"] == fam]
        if sub:
            families[fam] = {m: method_figures(sub, m) for m in methods}
    return {"overall": overall, "families": families, "fused": overall.get("fused", {})}


def targets(summary: dict) -> list[dict]:
    """The issue's targets: the fused pipeline beats every equal-size baseline on F1 and PPL
    delta, and its TTFT beats full prefill by ≥ 3×; per family and overall, with the margins."""
    rows = []
    groups = [("overall", summary["overall"])] + list(summary["families"].items())
    for group, figs in groups:
        fused = figs.get("fused") or {}
        if not fused:
            continue
        for base, bf in figs.items():
            if base in ("fused", "full") or not bf:
                continue
            for metric, better in (("f1", "higher"), ("ppl_delta", "lower")):
                a, b = fused.get(metric), bf.get(metric)
                if a is None or b is None:
                    continue
                margin = a - b if better == "higher" else b - a
                rows.append({"group": group, "target": f"{metric} vs {base}", "fused": a, "other": b,
                             "margin": round(margin, 4), "met": margin > 0})
        sp = fused.get("ttft_speedup")
        if sp is not None:
            rows.append({"group": group, "target": "ttft ≥ 3× full", "fused": fused.get("ttft_ms"),
                         "other": figs.get("full", {}).get("ttft_ms"), "margin": round(sp / 3.0, 3),
                         "met": sp >= 3.0})
    return rows


def results_table(result: dict):
    """A rich Table: per method, overall."""
    from rich.table import Table

    t = Table(title="kite bench: overall, per method", box=None)
    for col in ("method", "cases", "F1", "EM", "PPL Δ", "TTFT ms", "latency ms", "tok/s", "TTFT ×full",
                "KV bytes", "ratio"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for name, f in result["summary"]["overall"].items():
        if not f:
            continue
        t.add_row(name, str(f["cases"]), _f(f["f1"]), _f(f["exact_match"]), _f(f["ppl_delta"], "+.3f"),
                  _f(f["ttft_ms"], ".0f"), _f(f["avg_latency_ms"], ".0f"), _f(f["tokens_per_s"], ".1f"),
                  _f(f.get("ttft_speedup"), ".2f"), _f(f["kv_bytes"], ",.0f"), _f(f["compression_ratio"], ".2f"))
    return t


def family_table(result: dict):
    from rich.table import Table

    t = Table(title="per case family (F1 / PPL Δ / TTFT ms)", box=None)
    methods = [m for m, f in result["summary"]["overall"].items() if f]
    t.add_column("family")
    for m in methods:
        t.add_column(m, justify="right")
    for fam, figs in result["summary"]["families"].items():
        t.add_row(fam, *[f"{_f(figs[m].get('f1'))} / {_f(figs[m].get('ppl_delta'), '+.2f')} / "
                         f"{_f(figs[m].get('ttft_ms'), '.0f')}" if figs.get(m) else "-" for m in methods])
    return t


def threshold_table(result: dict):
    from rich.table import Table

    t = Table(title=f"thresholds ({result['thresholds_source']})", box=None)
    for col in ("metric", "limit", "fused", "result"):
        t.add_column(col)
    for row in result["thresholds"]:
        t.add_row(row["metric"], f"{'≤' if row['op'] == 'max' else '≥'} {row['limit']:g}",
                  _f(row["value"], ".4g"), "[green]pass[/]" if row["pass"] else "[red]FAIL[/]")
    return t


def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)
