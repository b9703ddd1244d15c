"""Traffic analysis for rule writers: how a sample of queries spreads over intent entropy and
clause labels, where thresholds would cut it, and which rule each query would hit.

Pure functions over the per-query signals (`kite.yoco.intent.query_signals`) that return
JSON-able dicts; `kite yoco analyze` prints them and `plot_entropy` draws the histogram.

Coverage needs the signals a query does not carry itself. Unless told otherwise they take the
neutral defaults in `neutral_signals()`: a new state's prior health (no record yet, the health
store's prior gain), an idle device (every watermark field 0, no spike). The query's novelty is
measured in traffic order with a `NoveltyTracker`, as the server would see it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any, Iterable, Sequence

import numpy as np

from kite.yoco.intent import QuerySignals
from kite.yoco.signals import HardwareWatermark, Signals

QUANTILES = (0.05, 0.10, 0.25, 0.50, 0.75, 0.90, 0.95, 0.99)
CUT_QUANTILES = (0.25, 0.50, 0.75, 0.90)
ENTROPY_FIELD = "intent_entropy"


def neutral_signals() -> Signals:
    """The non-query signals coverage assumes by default: prior health, idle hardware."""
    from kite.yoco.health import DEFAULT_PRIOR_GAIN, health_from_gain

    return Signals(state_health_score=health_from_gain(DEFAULT_PRIOR_GAIN),
                   hardware_watermark=HardwareWatermark())


def distribution(values: Sequence[float], bins: int = 20) -> dict[str, Any]:
    """Count, mean, std, min, max, quantiles p5..p99 and an equal-width histogram of `values`."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {"count": 0, "mean": None, "std": None, "min": None, "max": None, "quantiles": {},
                "histogram": {"edges": [], "counts": []}}
    lo, hi = float(v.min()), float(v.max())
    counts, edges = np.histogram(v, bins=bins, range=(lo, hi if hi > lo else lo + 1e-9))
    return {"count": int(v.size), "mean": float(v.mean()), "std": float(v.std()), "min": lo, "max": hi,
            "quantiles": {f"p{round(q * 100)}": float(x) for q, x in zip(QUANTILES, np.quantile(v, QUANTILES))},
            "histogram": {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}}


def label_distribution(signals: Sequence[QuerySignals]) -> list[dict[str, Any]]:
    """Per query label (`""` = no label: no tagger, or the query names no clause type): count,
    share and mean label entropy (bits), most first."""
    counts = Counter(s.query_label for s in signals)
    ent: dict[str, float] = {}
    for s in signals:
        ent[s.query_label] = ent.get(s.query_label, 0.0) + s.label_entropy
    n = max(1, len(signals))
    return [{"label": lab, "count": c, "share": c / n, "mean_label_entropy": ent[lab] / c}
            for lab, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def otsu_cut(values: Sequence[float]) -> dict[str, Any] | None:
    """The split of `values` into two groups that maximizes the between-group variance (Otsu,
    exact over the sorted values): cut (midway between the groups), each side's share and mean,
    and the separation (between-group variance / total variance, 0-1). None for < 2 distinct."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    if v.size < 2 or v[0] == v[-1]:
        return None
    n = v.size
    k = np.arange(1, n)  # sizes of the lower group
    csum = np.cumsum(v)[:-1]
    m0 = csum / k
    m1 = (v.sum() - csum) / (n - k)
    between = (k / n) * ((n - k) / n) * (m0 - m1) ** 2
    between[v[1:] == v[:-1]] = -1.0  # a cut must fall between distinct values
    best = int(np.argmax(between))
    size = best + 1
    var = float(v.var())
    return {"value": float((v[best] + v[best + 1]) / 2), "below": size / n, "above": 1 - size / n,
            "mean_below": float(m0[best]), "mean_above": float(m1[best]),
            "separation": float(between[best] / var) if var > 0 else 0.0}


def entropy_thresholds(ruleset) -> list[dict[str, Any]]:
    """Every `intent_entropy OP number` comparison in the rules: rule name, operator, value."""
    from kite.yoco.rules.parser import And, Compare, Field, Literal, Not, Or, parse_condition

    flip = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "==": "==", "!=": "!="}
    out = []

    def walk(node, rule: str) -> None:
        if isinstance(node, (And, Or)):
            for item in node.items:
                walk(item, rule)
        elif isinstance(node, Not):
            walk(node.item, rule)
        elif isinstance(node, Compare):
            left, right, op = node.left, node.right, node.op
            if isinstance(right, Field) and isinstance(left, Literal):
                left, right, op = right, left, flip.get(op, op)
            if (isinstance(left, Field) and left.name == ENTROPY_FIELD and isinstance(right, Literal)
                    and right.type == "number"):
                out.append({"rule": rule, "op": op, "value": float(right.value)})

    for rule in ruleset.rules:
        if ENTROPY_FIELD in rule.fields:
            walk(parse_condition(rule.condition), rule.name)
    return out


def split_at(values: Sequence[float], cut: float) -> dict[str, float]:
    """Shares of `values` at or below `cut` and above it."""
    v = np.asarray(values, dtype=np.float64)
    below = float((v <= cut).mean()) if v.size else 0.0
    return {"below": below, "above": 1.0 - below if v.size else 0.0}


def suggest_cuts(values: Sequence[float], ruleset=None) -> dict[str, Any]:
    """Candidate `intent_entropy` thresholds: quantile cuts, the Otsu split, and the current
    rules' thresholds, each with the share of traffic on either side."""
    v = np.asarray(values, dtype=np.float64)
    quant = [] if v.size == 0 else [
        {"quantile": q, "value": float(x), **split_at(v, float(x))}
        for q, x in zip(CUT_QUANTILES, np.quantile(v, CUT_QUANTILES))]
    current = [{**t, **split_at(v, t["value"])} for t in entropy_thresholds(ruleset)] if ruleset else []
    return {"quantiles": quant, "otsu": otsu_cut(v), "rules": current}


def query_novelties(queries: Iterable[str]) -> list[float]:
    """Each query's novelty against the ones before it (traffic order), as the server sees it."""
    from kite.yoco.novelty import NoveltyTracker

    tracker = NoveltyTracker()
    return [tracker.observe(q) for q in queries]


def matched_rules(signals: Sequence[QuerySignals], ruleset, base: Signals | None = None,
                  novelty: Sequence[float] | None = None) -> list[str]:
    """The rule each query would hit: its own signals (entropy, label, label entropy, novelty)
    over `base` (default `neutral_signals()`) for everything else."""
    base = base or neutral_signals()
    out = []
    for i, q in enumerate(signals):
        s = replace(base, intent_entropy=q.intent_entropy, query_label=q.query_label,
                    label_entropy=q.label_entropy,
                    query_novelty=novelty[i] if novelty is not None else base.query_novelty)
        out.append(ruleset.match(s).name)
    return out


def coverage(matched: Sequence[str], ruleset, groups: Sequence[str | None] | None = None) -> dict[str, Any]:
    """Count and share per rule, in rule order (rules no query hits included); with `groups`
    (e.g. the traffic's `family` field) also a count per group and rule."""
    counts = Counter(matched)
    n = max(1, len(matched))
    table = [{"rule": r.name, "count": counts.get(r.name, 0), "share": counts.get(r.name, 0) / n,
              "default": r.is_default} for r in ruleset.rules]
    out: dict[str, Any] = {"rules": table, "unmatched_rules": [t["rule"] for t in table if not t["count"]]}
    if groups is not None:
        by: dict[str, Counter] = {}
        for g, rule in zip(groups, matched):
            by.setdefault("(none)" if g is None else str(g), Counter())[rule] += 1
        out["by_group"] = {g: dict(c) for g, c in sorted(by.items())}
    return out


def analyze(signals: Sequence[QuerySignals], ruleset=None, *, queries: Sequence[str] | None = None,
            base: Signals | None = None, groups: Sequence[str | None] | None = None,
            bins: int = 20) -> dict[str, Any]:
    """The whole report for one traffic sample (see the module docstring)."""
    ent = [s.intent_entropy for s in signals]
    tokens = [s.tokens for s in signals]
    report: dict[str, Any] = {
        "queries": len(signals),
        "distinct_queries": len(set(queries)) if queries is not None else None,
        "tokens": {"total": int(sum(tokens)), "mean": sum(tokens) / len(tokens) if tokens else 0.0},
        "intent_entropy": distribution(ent, bins),
        "label_entropy": {k: v for k, v in distribution([s.label_entropy for s in signals], bins).items()
                          if k != "histogram"},
        "labels": label_distribution(signals),
        "cuts": suggest_cuts(ent, ruleset),
    }
    if ruleset is not None:
        base = base or neutral_signals()
        nov = query_novelties(queries) if queries is not None else None
        matched = matched_rules(signals, ruleset, base, nov)
        assumed = {k: v for k, v in base.flat().items()
                   if k not in ("intent_entropy", "query_label", "label_entropy", "query_novelty")}
        report["coverage"] = {"rules_source": ruleset.source, "rules_version": ruleset.version,
                              "rules_sha256": ruleset.sha256, "assumed": assumed,
                              "novelty": "traffic order" if nov is not None else base.query_novelty,
                              **coverage(matched, ruleset, groups)}
    if groups is not None:
        report["by_group"] = group_entropy(ent, groups)
    return report


def group_entropy(values: Sequence[float], groups: Sequence[str | None]) -> dict[str, dict[str, float]]:
    """Per group (e.g. the traffic's `family`): count, mean, p10, median and p90 of intent entropy,
    to see whether a threshold separates the kinds of query at all."""
    by: dict[str, list[float]] = {}
    for v, g in zip(values, groups):
        by.setdefault("(none)" if g is None else str(g), []).append(v)
    out = {}
    for g, vs in sorted(by.items()):
        p10, p50, p90 = np.quantile(np.asarray(vs), (0.1, 0.5, 0.9))
        out[g] = {"count": len(vs), "mean": float(np.mean(vs)), "p10": float(p10), "p50": float(p50),
                  "p90": float(p90)}
    return out


def plot_entropy(report: dict[str, Any], path, title: str | None = None) -> None:
    """A PNG histogram of intent entropy with the rules' thresholds and the Otsu cut marked
    (matplotlib, Agg backend; written atomically)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kite.atomic import write_bytes

    dist = report["intent_entropy"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    edges, counts = dist["histogram"]["edges"], dist["histogram"]["counts"]
    if counts:
        ax.stairs(counts, edges, fill=True, alpha=0.6, label=f"{dist['count']} queries")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, t in enumerate(report["cuts"]["rules"]):
        ax.axvline(t["value"], color=colours[(k + 1) % len(colours)], lw=1.8,
                   label=f"{t['rule']}: {ENTROPY_FIELD} {t['op']} {t['value']:g} "
                         f"({100 * t['below']:.0f}% | {100 * t['above']:.0f}%)")
    otsu = report["cuts"]["otsu"]
    if otsu:
        ax.axvline(otsu["value"], color="black", ls="--", lw=1.2,
                   label=f"Otsu split {otsu['value']:.2f} ({100 * otsu['below']:.0f}% | "
                         f"{100 * otsu['above']:.0f}%)")
    ax.set_xlabel("intent entropy (bits, mean next-token entropy over the query)")
    ax.set_ylabel("queries")
    ax.set_title(title or "Intent entropy of the traffic sample")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes(path, buf.getvalue())
