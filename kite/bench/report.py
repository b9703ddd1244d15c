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
    # PPL deltas of short references are dominated by a few cases; the geometric mean of the PPL
    # ratio to full prefill (= exp of the mean log-PPL delta) is the robust companion figure.
    logs = [math.log(r["methods"][name]["ppl"] / r["methods"]["full"]["ppl"]) for r in rows
            if name in r["methods"] and "full" in r["methods"]
            and _finite_pos(r["methods"][name]["ppl"]) and _finite_pos(r["methods"]["full"]["ppl"])]
    out["ppl_ratio"] = round(math.exp(mean(logs)), 4) if logs else None
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
        # The same question asked of quality: among loads, the fraction whose reference PPL is
        # lower than with no document at all.
        helped = [m["beats_no_document"] for m in loads if "beats_no_document" in m]
        out["load_helped_rate"] = round(sum(helped) / len(helped), 4) if helped else None
        out["upcycle_regenerate_rate"] = _mean([r["state"]["regenerate_rate"] for r in rows])
    return out


def _finite_pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def summarize(rows: list[dict], methods: list[str]) -> dict:
    overall = {m: method_figures(rows, m) for m in methods}
    families = {}
    for fam in FAMILIES:
        sub = [r for r in rows if r["family"] == fam]
        if sub:
            families[fam] = {m: method_figures(sub, m) for m in methods}
    return {"overall": overall, "families": families, "fused": overall.get("fused", {})}


# Methods the targets do not compare the fused pipeline with: itself, the reference, the state it
# reads, and the memory-budgeted cache (its bytes are its own budget's, not the state's).
NOT_EQUAL_SIZE = ("fused", "full", "state", "budget")


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
            if base in NOT_EQUAL_SIZE or not bf:
                continue
            for metric, better in (("f1", "higher"), ("ppl_delta", "lower"), ("ppl_ratio", "lower")):
                a, b = fused.get(metric), bf.get(metric)
                if a is None or b is None:
                    continue
                margin = a - b if better == "higher" else b - a
                rows.append({"group": group, "target": f"{metric} vs {base}", "fused": a, "other": b,
                             "margin": round(margin, 4), "met": margin > 0})
        sp = fused.get("ttft_speedup")
        if sp is not None:
            rows.append({"group": group, "target": "TTFT speedup ≥ 3× (margin: speedup − 3)", "fused": fused.get("ttft_ms"),
                         "other": figs.get("full", {}).get("ttft_ms"), "margin": round(sp - 3.0, 3),
                         "met": sp >= 3.0})
    return rows


def results_table(result: dict):
    """A rich Table: per method, overall."""
    from rich.table import Table

    t = Table(title="kite bench: overall, per method", box=None)
    for col in ("method", "cases", "F1", "EM", "PPL Δ", "PPL ×", "TTFT ms", "latency ms", "tok/s", "TTFT ×full",
                "KV bytes", "ratio"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for name, f in result["summary"]["overall"].items():
        if not f:
            continue
        t.add_row(name, str(f["cases"]), _f(f["f1"]), _f(f["exact_match"]), _f(f["ppl_delta"], "+.3f"),
                  _f(f.get("ppl_ratio"), ".3f"),
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
        t.add_row(row["metric"], f"{'≤' if row['op'] == 'max' else '≥'} {row['limit']:g} {row.get('unit', '')}".rstrip(),
                  _f(row["value"], ".4g"), "[green]pass[/]" if row["pass"] else "[red]FAIL[/]")
    return t


def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def targets_table(result: dict):
    """The issue's targets, group by group, with the margin (fused − other; > 0 = met)."""
    from rich.table import Table

    t = Table(title="targets: fused vs equal-size baselines (margin > 0 = met), TTFT vs full", box=None)
    for col in ("group", "target", "fused", "other", "margin", "met"):
        t.add_column(col)
    for row in result["targets"]:
        t.add_row(row["group"], row["target"], _f(row["fused"], ".4g"), _f(row["other"], ".4g"),
                  _f(row["margin"], "+.4g"), "[green]yes[/]" if row["met"] else "[red]no[/]")
    return t


def markdown(result: dict) -> str:
    """The overall, per-family and target tables as Markdown (for docs/PERFORMANCE.md)."""
    ov = {m: f for m, f in result["summary"]["overall"].items() if f}
    lines = ["| method | F1 | EM | PPL Δ | PPL × full | TTFT ms | TTFT × full | latency ms | latency × full "
             "| tok/s | KV bytes | compression |", "|---" * 12 + "|"]
    for m, f in ov.items():
        lines.append(f"| {m} | {_f(f['f1'])} | {_f(f['exact_match'])} | {_f(f['ppl_delta'], '+.2f')} | "
                     f"{_f(f.get('ppl_ratio'))} | {_f(f['ttft_ms'], ',.0f')} | {_f(f.get('ttft_speedup'), '.2f')} | "
                     f"{_f(f['avg_latency_ms'], ',.0f')} | {_f(f.get('latency_speedup'), '.2f')} | "
                     f"{_f(f['tokens_per_s'], '.2f')} | {_f(f['kv_bytes'], ',.0f')} | {_f(f['compression_ratio'], '.2f')}× |")
    lines += ["", "| family (cases) | " + " | ".join(ov) + " |", "|---" * (len(ov) + 1) + "|"]
    for fam, figs in result["summary"]["families"].items():
        n = next((f["cases"] for f in figs.values() if f), 0)
        cells = [f"{_f(figs[m].get('f1'), '.2f')} / {_f(figs[m].get('ppl_ratio'), '.2f')} / "
                 f"{_f(figs[m].get('ttft_ms'), ',.0f')}" if figs.get(m) else "-" for m in ov]
        lines.append(f"| {fam} ({n}) | " + " | ".join(cells) + " |")
    lines += ["", "| group | F1: fused − best equal-size baseline | PPL Δ: best baseline − fused | "
              "PPL ×: best baseline − fused | TTFT speedup vs full (target ≥ 3×) |", "|---" * 5 + "|"]
    groups = [("overall", result["summary"]["overall"])] + list(result["summary"]["families"].items())
    for group, figs in groups:
        fused = figs.get("fused") or {}
        base = {m: f for m, f in figs.items() if m not in NOT_EQUAL_SIZE and f}
        if not fused or not base:
            continue
        cells = []
        for metric, higher in (("f1", True), ("ppl_delta", False), ("ppl_ratio", False)):
            vals = {m: f.get(metric) for m, f in base.items() if f.get(metric) is not None}
            if fused.get(metric) is None or not vals:
                cells.append("-")
                continue
            best = (max if higher else min)(vals, key=vals.get)
            margin = fused[metric] - vals[best] if higher else vals[best] - fused[metric]
            cells.append(f"{margin:+.3g} vs {best} ({'met' if margin > 0 else '**missed**'})")
        sp = fused.get("ttft_speedup")
        cells.append("-" if sp is None else f"{sp:.2f}× ({'met' if sp >= 3 else '**missed**'})")
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
