"""Judging a sweep's points, and showing them: which points meet every constraint, the best one
and why, the Pareto front, which points broke which constraint; the table and the Pareto PNG."""

from __future__ import annotations

import math
from pathlib import Path

from kite.tune.objective import Constraint, Objective


def _ok(x) -> bool:
    return isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x))


def feasible(rec: dict, objectives: list[Objective], constraints: list[Constraint]) -> bool:
    f = rec.get("figures") or {}
    return all(_ok(f.get(o.name)) for o in objectives) and all(c.holds(f) for c in constraints)


def _key(rec: dict, objectives: list[Objective]) -> tuple:
    """Sort key, best first: the objectives in order, then fewer state bytes."""
    f = rec["figures"]
    key = tuple(-f[o.name] if o.maximize else f[o.name] for o in objectives)
    return key + (f.get("bytes") if _ok(f.get("bytes")) else math.inf,)


def dominates(a: dict, b: dict, objectives: list[Objective]) -> bool:
    fa, fb = a["figures"], b["figures"]
    at_least = all(not o.better(fb[o.name], fa[o.name]) for o in objectives)
    return at_least and any(o.better(fa[o.name], fb[o.name]) for o in objectives)


def pareto_front(points: list[dict], objectives: list[Objective]) -> list[dict]:
    """The points no other point dominates (for one objective: the best ones)."""
    return [p for p in points if not any(dominates(q, p, objectives) for q in points if q is not p)]


def best_point(points: list[dict], objectives: list[Objective], constraints: list[Constraint]) -> dict | None:
    """The best feasible point: by the first objective (a tie: the second, then fewer state
    bytes); with two objectives it is on the Pareto front. None when no point is feasible."""
    ok = [p for p in points if feasible(p, objectives, constraints)]
    return min(ok, key=lambda p: _key(p, objectives)) if ok else None


def params_text(params: dict) -> str:
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def judge(doc: dict, objectives: list[Objective], constraints: list[Constraint]) -> dict:
    """Mark every point of a results document (feasible, the constraints it broke and why) and
    set `best` (with why it won), `pareto` (ids) and `broken` (per constraint, the points that
    broke it). Returns `doc`."""
    points = doc["points"]
    for p in points:
        f = p.get("figures") or {}
        p["feasible"] = feasible(p, objectives, constraints)
        p["broken"] = [{"constraint": c.text, "why": c.why_broken(f)} for c in constraints if not c.holds(f)]
        missing = [o.name for o in objectives if not _ok(f.get(o.name))]
        if missing:
            p["broken"].append({"constraint": "objective measured", "why": f"{', '.join(missing)} not measured"})
    ok = [p for p in points if p["feasible"]]
    front = pareto_front(ok, objectives)
    doc["pareto"] = [p["id"] for p in sorted(front, key=lambda p: _key(p, objectives))]
    doc["feasible"] = len(ok)
    doc["broken"] = [{"constraint": c.text,
                      "points": [{"id": p["id"], "params": p["params"], "why": c.why_broken(p.get("figures") or {})}
                                 for p in points if not c.holds(p.get("figures") or {})]}
                     for c in constraints]
    best = best_point(points, objectives, constraints)
    doc["best"] = None if best is None else {"id": best["id"], "params": best["params"],
                                             "figures": best["figures"],
                                             "why": why_won(best, ok, front, objectives, constraints, len(points))}
    return doc


def why_won(best: dict, ok: list[dict], front: list[dict], objectives: list[Objective],
            constraints: list[Constraint], n_points: int) -> list[str]:
    """Lines saying why `best` won, against the other feasible points."""
    o = objectives[0]
    v = best["figures"][o.name]
    lines = [f"best {o.name} ({o.direction}) among the {len(ok)} of {n_points} points that met every constraint: "
             f"{v:.4g}"]
    if len(objectives) > 1:
        o2 = objectives[1]
        lines.append(f"on the Pareto front of {o.name} and {o2.name} ({len(front)} points), the best {o.name}; "
                     f"its {o2.name} is {best['figures'][o2.name]:.4g}")
    others = sorted((p for p in ok if p is not best), key=lambda p: _key(p, objectives))
    if others:
        r = others[0]
        rv = r["figures"][o.name]
        rel = f" ({(v - rv) / abs(rv):+.1%})" if rv else ""
        if v != rv:
            lines.append(f"runner-up {params_text(r['params'])}: {o.name} {rv:.4g}; the winner is "
                         f"{abs(v - rv):.4g} {'higher' if v > rv else 'lower'}{rel}")
        else:
            lines.append(f"ties on {o.name} with {params_text(r['params'])}; won on "
                         + (f"{objectives[1].name}, then " if len(objectives) > 1 else "")
                         + "fewer state bytes, then order")
    for c in constraints:
        shown = ", ".join(f"{name} {best['figures'][name]:.4g}" for name in c.fields()
                          if _ok(best["figures"].get(name)))
        lines.append(f"meets {c.text} ({shown})")
    return lines


# ---------------------------------------------------------------------------- showing

def _fmt(x, fmt: str = ".4g") -> str:
    return "-" if not _ok(x) else format(x, fmt)


def shown_metrics(doc: dict) -> list[str]:
    """The metrics a table shows: the objectives, then what the constraints read."""
    from kite.tune.objective import parse_constraint

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
    measured = sum(p["status"] == "measured" for p in doc["points"])
    if not measured:
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
    from kite.tune.objective import parse_constraint

    objectives = doc["objectives"]
    y = objectives[0]["name"]
    constraints = [parse_constraint(c) for c in doc["constraints"]]
    if len(objectives) > 1:
        x = objectives[1]["name"]
    else:
        fields = [f for c in constraints for f in c.fields() if f != y]
        x = fields[0] if fields else "bytes"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = [p for p in doc["points"] if _ok((p.get("figures") or {}).get(x)) and _ok((p.get("figures") or {}).get(y))]
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
