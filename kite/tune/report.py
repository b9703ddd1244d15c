"""Showing a judged sweep: the points table, what reuse saved, the Pareto PNG."""

from __future__ import annotations

from pathlib import Path

from kite.tune.judge import measured, pareto_front
from kite.tune.constraints import Constraint
from kite.tune.objective import Objective

__all__ = ["pareto_png", "points_table", "reuse_line", "shown_metrics"]


def _fmt(x, fmt: str = ".4g") -> str:
    return "-" if not measured(x) else format(x, fmt)


def shown_metrics(doc: dict) -> list[str]:
    """The metrics a table shows: the objectives, then what the constraints read."""
    from kite.tune.constraints import parse_constraint

    names = [o["name"] for o in doc["objectives"]]
    for text in doc["constraints"]:
        for name in parse_constraint(text).fields():
            if name not in names:
                names.append(name)
    return names


def points_table(doc: dict):
    """A rich Table: one row a point, its parameters, the metrics, states made/reused, verdict."""
    from rich.table import Table

    params = [r["name"] for r in doc["space"]]
    metrics = shown_metrics(doc)
    best = (doc.get("best") or {}).get("id")
    front = set(doc.get("pareto") or [])
    t = Table(title=f"kite tune: {len(doc['points'])} points, {doc.get('feasible', 0)} meet every constraint",
              box=None)
    for col in ["point", *params, *metrics, "states", "s", "verdict"]:
        t.add_column(col, justify="left" if col in ("point", "verdict") else "right")
    for p in doc["points"]:
        f = p.get("figures") or {}
        if p["id"] == best:
            verdict = "[bold green]best[/]"
        elif p.get("feasible"):
            verdict = "[green]ok[/]" + (" · front" if p["id"] in front and len(doc["objectives"]) > 1 else "")
        else:
            verdict = "[red]" + "; ".join(b["constraint"] for b in p.get("broken", [])) + "[/]"
        states = "resumed" if p["status"] == "resumed" else f"{p.get('states_made', 0)}+{p.get('states_reused', 0)}r"
        t.add_row(p["id"], *[_fmt(p["params"].get(k)) if not isinstance(p["params"].get(k), str)
                             else p["params"][k] for k in params],
                  *[_fmt(f.get(m)) for m in metrics], states, _fmt(p.get("wall_s"), ".1f"), verdict)
    return t


def reuse_line(doc: dict) -> str:
    """What reuse saved, in one line."""
    r = doc["reuse"]
    if not doc["settings"].get("reuse", True):
        return (f"reuse off (--no-reuse): every point loaded the model, prefilled its documents and made its "
                f"{r['states_made']} states afresh ({doc.get('wall_s') or 0:.0f} s)")
    ran = sum(p["status"] == "measured" for p in doc["points"])
    if not ran:
        return f"no point measured in this run: {len(doc['points'])} read from the results file"
    saved = r.get("saved_s", 0.0)
    wall = doc.get("wall_s") or 0.0
    parts = [f"{r['references']} full-prefill references ({r['reference_s']:.1f} s)",
             f"{r['prefills']} document prefills ({r['prefill_s']:.1f} s)",
             f"{r['states_reused']} states ({r['state_reused_s']:.1f} s"
             + (f"; {r['states_reused_unknown']} made before this sweep, not counted" if r["states_reused_unknown"] else "")
             + ")",
             f"{r['model_loads']} model loads (not timed: the sweep's one load, {r['model_load_first_s']:.1f} s, "
             "paid one-time imports too)"]
    share = f", {saved / (saved + wall):.0%} of the {saved + wall:.0f} s it would have taken" if wall else ""
    return f"reuse saved {saved:.1f} s{share}: " + ", ".join(parts) + f"; {r['states_made']} states made"


def pareto_png(doc: dict, path: str | Path) -> str:
    """The objective against the first constraint's metric (or the second objective), every
    point drawn: feasible ones as dots, infeasible as red crosses, the best as a star, the
    Pareto front as a line, a constraint's limit as a dashed line. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kite.atomic import atomic_writer
    from kite.tune.constraints import parse_constraint

    objectives = doc["objectives"]
    y = objectives[0]["name"]
    constraints = [parse_constraint(c) for c in doc["constraints"]]
    if len(objectives) > 1:
        x = objectives[1]["name"]
    else:
        fields = [f for c in constraints for f in c.fields() if f != y]
        x = fields[0] if fields else "bytes"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = [p for p in doc["points"] if measured((p.get("figures") or {}).get(x)) and measured((p.get("figures") or {}).get(y))]
    ok = [p for p in pts if p.get("feasible")]
    bad = [p for p in pts if not p.get("feasible")]
    if ok:
        ax.scatter([p["figures"][x] for p in ok], [p["figures"][y] for p in ok], s=40, label="meets the constraints")
    if bad:
        ax.scatter([p["figures"][x] for p in bad], [p["figures"][y] for p in bad], s=50, marker="x", color="red",
                   label="breaks a constraint")
    if len(objectives) > 1:  # the front of the points that meet every constraint
        front, what = [p for p in ok if p["id"] in set(doc.get("pareto") or [])], "Pareto front"
    else:  # the trade-off between the objective and the constraint's metric, over every point
        from kite.tune.objective import MAXIMIZE

        plane = [Objective(y, y in MAXIMIZE), Objective(x, x in MAXIMIZE)]
        front, what = pareto_front(pts, plane), f"Pareto front of {y} and {x}"
    if len(front) > 1:
        front.sort(key=lambda p: p["figures"][x])
        ax.plot([p["figures"][x] for p in front], [p["figures"][y] for p in front], "--", color="gray",
                label=what)
    best = next((p for p in pts if p["id"] == (doc.get("best") or {}).get("id")), None)
    if best is not None:
        ax.scatter([best["figures"][x]], [best["figures"][y]], s=220, marker="*", color="gold",
                   edgecolors="black", zorder=5, label="best")
    for c in constraints:
        limit = _limit_on(c, x)
        if limit is not None:
            ax.axvline(limit, color="red", linestyle=":", linewidth=1, label=f"{c.text}")
    at: dict[tuple, list[str]] = {}  # points at the same place share one label
    for p in pts:
        at.setdefault((p["figures"][x], p["figures"][y]), []).append(_short(p["params"]))
    for xy, labels in at.items():
        ax.annotate(labels[0] + (f" (+{len(labels) - 1})" if len(labels) > 1 else ""), xy,
                    textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set(xlabel=x, ylabel=f"{y} ({objectives[0]['direction']})",
           title=f"kite tune: {y} vs {x} ({len(doc['points'])} points)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_writer(path) as fh:
        fig.savefig(fh, format="png", dpi=110)
    plt.close(fig)
    return str(path)


def _limit_on(c: Constraint, metric: str) -> float | None:
    """The number a constraint `metric OP number` compares `metric` with (None for any other shape)."""
    from kite.yoco.rules.parser import Compare, Field, Literal

    t = c.tree
    if isinstance(t, Compare):
        for a, b in ((t.left, t.right), (t.right, t.left)):
            if isinstance(a, Field) and a.name == metric and isinstance(b, Literal) and b.type == "number":
                return float(b.value)
    return None


def _short(params: dict) -> str:
    abbrev = {"ratio": "r", "upcycle_compression_ratio": "f", "precision": "", "cluster_num": "k",
              "min_span_tokens": "lo", "max_span_tokens": "hi", "yoco_min_hit_gain": "g"}
    out = []
    for k, v in params.items():
        name = abbrev.get(k, k.rsplit(".", 1)[-1])
        out.append(f"{name}{'=' if name else ''}{v:g}" if isinstance(v, float) else f"{name}{'=' if name else ''}{v}")
    return ",".join(out)
