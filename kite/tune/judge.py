"""Judging a sweep's points: which meet every constraint, the best one and why, the Pareto front,
which points broke which constraint."""

from __future__ import annotations

import math

from kite.tune.constraints import Constraint
from kite.tune.objective import Objective


def measured(x) -> bool:
    """A figure that was measured: a number, not None or NaN."""
    return isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x))


def feasible(rec: dict, objectives: list[Objective], constraints: list[Constraint]) -> bool:
    f = rec.get("figures") or {}
    return all(measured(f.get(o.name)) for o in objectives) and all(c.holds(f) for c in constraints)


def _key(rec: dict, objectives: list[Objective]) -> tuple:
    """Sort key, best first: the objectives in order, then fewer state bytes."""
    f = rec["figures"]
    key = tuple(-f[o.name] if o.maximize else f[o.name] for o in objectives)
    return key + (f.get("bytes") if measured(f.get("bytes")) else math.inf,)


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
        missing = [o.name for o in objectives if not measured(f.get(o.name))]
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
                          if measured(best["figures"].get(name)))
        lines.append(f"meets {c.text} ({shown})")
    return lines
