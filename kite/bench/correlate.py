"""`kite report correlate`: across bench runs, how YOCO's hit rate moves with the regenerate rate
(MB of .upc per 1,000 context tokens), and whether there is a knee where the seed claims one
(0.85): a coefficient with its interval and the number of runs behind it, a hinge against a
straight line, and a plot. Runs come from the results history and from result files."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kite.bench import stats
from kite.bench.history import read_history, run_status
from kite.errors import BadInput

SEED_KNEE = 0.85  # the seed's claim: MB of .upc per 1,000 tokens
# The y the report may read, fused-pipeline figures of a run (kite/bench/report.py): the seed's hit
# rate (a load's measured gain > 0), and the same question asked of quality.
HIT_RATES = {"yoco_hit_rate": "YOCO hit rate (loads whose measured gain was > 0)",
             "load_helped_rate": "loads whose reference PPL beat no document"}
MIN_CORRELATION_RUNS = 3   # a coefficient at all (two points always lie on a line)
MIN_INTERVAL_RUNS = 4      # Fisher's z needs n - 3 > 0
MIN_KNEE_RUNS = 6          # a hinge has 4 parameters (with its knee): 2 residual df at least
MIN_DISTINCT_RATES = 5     # two runs on or below a knee and two above, at more than one knee
MIN_SIDE_RUNS = 2          # runs each side of the tested knee (one would fit exactly)
LEVEL = 0.95


@dataclass(frozen=True, slots=True)
class RunPoint:
    """One bench run: its regenerate rate (x) and hit rate (y: HIT_RATES), with where it came from."""

    run_id: str
    source: str
    started_at: str | None
    model: str
    status: str
    regenerate_rate: float
    hit_rate: float
    loads: int | None
    ratio: float | None


@dataclass(frozen=True, slots=True)
class Skipped:
    run_id: str
    source: str
    why: str


@dataclass(frozen=True, slots=True)
class Coefficient:
    value: float | None
    interval: tuple[float, float] | None
    p: float | None


@dataclass
class Correlation:
    """What the runs say. `verdict` and `knee["verdict"]` are the sentences to print."""

    runs: int
    points: list[RunPoint]
    skipped: list[Skipped]
    knee_at: float
    hit_rate: str = "yoco_hit_rate"  # which of HIT_RATES
    pearson: Coefficient | None = None
    spearman: Coefficient | None = None
    line: dict | None = None
    knee: dict = field(default_factory=dict)
    verdict: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _run_id(result: dict, source: str) -> str:
    import hashlib

    body = json.dumps([result.get("started_at"), (result.get("model") or {}).get("fingerprint"), source])
    return hashlib.sha256(body.encode()).hexdigest()[:12]


def _point(rec: dict, fused: dict | None, run_id: str, source: str, hit_rate: str) -> RunPoint | Skipped:
    status = run_status(rec)
    if status in ("interrupted", "error"):
        return Skipped(run_id, source, f"the run did not finish ({status})")
    if not fused:
        return Skipped(run_id, source, "no fused-pipeline figures")
    x, y = fused.get("upcycle_regenerate_rate"), fused.get(hit_rate)
    if x is None:
        return Skipped(run_id, source, "no regenerate rate")
    if y is None:
        return Skipped(run_id, source, f"no {hit_rate}: no state was loaded" if not fused.get("loads")
                       else f"no {hit_rate} recorded")
    cfg = rec.get("config") or {}
    return RunPoint(run_id, source, rec.get("started_at"), (rec.get("model") or {}).get("fingerprint", "?"),
                    status, float(x), float(y), fused.get("loads"), cfg.get("ratio"))


def _from_file(path: Path, hit_rate: str) -> list[RunPoint | Skipped]:
    """A result JSON (`kite bench run --output`) or a history JSONL (`$KITE_HOME/results/bench.jsonl`)."""
    if not path.is_file():
        raise BadInput(f"--results {path}: no such file")
    text = path.read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and "summary" in doc:
        fused = (doc.get("summary") or {}).get("overall", {}).get("fused")
        return [_point(doc, fused, _run_id(doc, str(path.resolve())), str(path), hit_rate)]
    if doc is None or (isinstance(doc, dict) and "run_id" in doc):
        return [_point(rec, (rec.get("figures") or {}).get("fused"), rec.get("run_id") or "?", str(path), hit_rate)
                for rec in read_history(path)]
    raise BadInput(f"--results {path}: neither a bench result (kite bench run --output) nor a results history "
                   "(bench.jsonl)")


def collect(results: list[Path] = (), history: Path | None = None,
            hit_rate: str = "yoco_hit_rate") -> tuple[list[RunPoint], list[Skipped]]:
    """The runs of `history` (a results history; None: none) and of each result or history file in
    `results`, each run once (by start time and model: a result file also in the history counts
    once), those without both figures set aside with the reason. `hit_rate`: one of HIT_RATES."""
    if hit_rate not in HIT_RATES:
        raise BadInput(f"hit rate {hit_rate!r}: one of {', '.join(HIT_RATES)}")
    found: list[RunPoint | Skipped] = []
    if history is not None:
        found += [_point(rec, (rec.get("figures") or {}).get("fused"), rec.get("run_id") or "?", str(history),
                         hit_rate) for rec in read_history(history)]
    for path in results:
        found += _from_file(Path(path), hit_rate)
    points: list[RunPoint] = []
    skipped: list[Skipped] = []
    seen: set = set()
    for item in found:
        if isinstance(item, Skipped):
            skipped.append(item)
            continue
        key = (item.started_at, item.model) if item.started_at else (item.run_id,)
        if key in seen:
            continue
        seen.add(key)
        points.append(item)
    return points, skipped


def _coefficient(r: float | None, n: int, se_scale: float) -> Coefficient | None:
    if r is None:
        return None
    interval = stats.fisher_interval(r, n, LEVEL, se_scale)
    return Coefficient(round(r, 4), None if interval is None else (round(interval[0], 4), round(interval[1], 4)),
                       None if n < 3 else round(stats.r_pvalue(r, n), 4))


def correlate(points: list[RunPoint], skipped: list[Skipped] = (), knee_at: float = SEED_KNEE,
              boot: int = 999, hit_rate: str = "yoco_hit_rate") -> Correlation:
    """Pearson and Spearman coefficients of hit rate on regenerate rate, with 95 % intervals; a
    straight line; a hinge at `knee_at` tested against the line (nested F-test); and a knee
    anywhere (sup-F, bootstrapped), with its 95 % interval. Each part says when there are too few
    runs for it."""
    import numpy as np

    n = len(points)
    out = Correlation(n, list(points), list(skipped), knee_at, hit_rate)
    x = np.array([p.regenerate_rate for p in points])
    y = np.array([p.hit_rate for p in points])
    if n < MIN_CORRELATION_RUNS:
        out.verdict = (f"too few runs for a correlation: {n} (at least {MIN_CORRELATION_RUNS}; a confidence "
                       f"interval needs {MIN_INTERVAL_RUNS}, a knee test {MIN_KNEE_RUNS})")
        out.knee = {"tested": False, "verdict": f"not tested: too few runs ({n})"}
        return out
    if np.ptp(x) == 0:
        out.verdict = (f"no correlation can be computed: every one of the {n} runs has the same regenerate rate "
                       f"({x[0]:g}); runs at other compression settings are needed")
        out.knee = {"tested": False, "verdict": "not tested: the regenerate rate does not vary"}
        return out
    if np.ptp(y) == 0:
        below, above = int(np.sum(x <= knee_at)), int(np.sum(x > knee_at))
        out.verdict = (f"no correlation can be computed: the hit rate is {y[0]:g} in every one of the {n} runs, "
                       f"at regenerate rates from {x.min():.3g} to {x.max():.3g}; runs whose hit rate differs "
                       "are needed")
        out.knee = {"tested": False, "verdict": (
            f"none in these runs: the hit rate is flat ({y[0]:g}) on both sides of {knee_at:g} ({_runs(below)} at or "
            f"below it, {above} above)" if below and above else
            f"not tested: the hit rate does not vary and every run lies {'above' if above else 'at or below'} "
            f"{knee_at:g}")}
        return out
    out.pearson = _coefficient(stats.pearson(x, y), n, 1.0)
    out.spearman = _coefficient(stats.spearman(x, y), n, math.sqrt(1.06))
    line = stats.fit_line(x, y)
    out.line = {"intercept": round(line.coef[0], 6), "slope": round(line.coef[1], 6), "rss": line.rss}
    out.verdict = _verdict(out.pearson, out.spearman, n)
    out.knee = _knee(x, y, line, knee_at, boot)
    noise = _counting_noise(points)
    if noise is not None and out.knee.get("tested"):
        sigma = math.sqrt(stats.fit_hinge(x, y, out.knee["knee"]).rss / (n - 4))
        out.knee.update(scatter=round(sigma, 4), counting_noise=round(noise, 4))
        if sigma < noise:
            loads = sorted({p.loads for p in points})
            out.knee["caveat"] = (
                f"the runs scatter around the hinge by {sigma:.2g}, less than a hit rate counted over "
                f"{loads[0] if len(loads) == 1 else f'{loads[0]}-{loads[-1]}'} loads is uncertain by (about "
                f"{noise:.2g}): the test and the interval take the runs as more precise than they are; more "
                "loads per run, and more runs near the knee, would settle it")
    return out


def _counting_noise(points: list[RunPoint]) -> float | None:
    """The mean standard error of the runs' hit rates as fractions of their loads (binomial, the
    rate kept half a load from 0 and 1); None when a run's loads are not recorded."""
    if not points or any(not p.loads for p in points):
        return None
    ses = []
    for p in points:
        rate = min(max(p.hit_rate, 0.5 / p.loads), 1 - 0.5 / p.loads)
        ses.append(math.sqrt(rate * (1 - rate) / p.loads))
    return sum(ses) / len(ses)


def _verdict(pearson: Coefficient, spearman: Coefficient | None, n: int) -> str:
    r = pearson.value
    if pearson.interval is None:
        return (f"Pearson r = {r:+.2f} over {_runs(n)}: too few runs for a confidence interval "
                f"(at least {MIN_INTERVAL_RUNS}), so no conclusion")
    lo, hi = pearson.interval
    rho = f", Spearman rho = {spearman.value:+.2f}" if spearman and spearman.value is not None else ""
    head = f"Pearson r = {r:+.2f} (95 % interval {lo:+.2f} to {hi:+.2f}){rho}, {n} runs"
    if lo > 0:
        return f"{head}: hit rate rises with regenerate rate"
    if hi < 0:
        return f"{head}: hit rate falls as regenerate rate rises"
    return f"{head}: the interval spans 0, so these runs show no correlation either way"


def _knee(x, y, line: stats.Fit, knee_at: float, boot: int) -> dict:
    import numpy as np

    n = len(x)
    out: dict = {"tested": False}
    # The seed's knee, at its place: a hinge there against the line (nested: one parameter more).
    below, above = int(np.sum(x <= knee_at)), int(np.sum(x > knee_at))
    if min(below, above) >= MIN_SIDE_RUNS and n >= 5:
        h = stats.fit_hinge(x, y, knee_at)
        f, p = stats.nested_f(line.rss, h.rss, 1, n - 3)
        out["at_claim"] = {"knee": knee_at, "slope_below": round(h.coef[1], 6),
                           "slope_above": round(h.coef[1] + h.coef[2], 6), "f": round(f, 4),
                           "p": round(p, 4), "runs_below": below, "runs_above": above}
    else:
        out["at_claim"] = {"knee": knee_at, "runs_below": below, "runs_above": above,
                           "why_not": f"{_runs(below)} at or below {knee_at:g} and {above} above it "
                                      f"(a hinge there needs {MIN_SIDE_RUNS} each side and 5 in all)"}
    distinct = len(np.unique(x))
    if n < MIN_KNEE_RUNS or distinct < MIN_DISTINCT_RATES:
        out["verdict"] = (f"too few runs to test for a knee: {_runs(n)}, {distinct} distinct regenerate rates "
                          f"(at least {MIN_KNEE_RUNS} runs and {MIN_DISTINCT_RATES} distinct rates)")
        return out
    scan = stats.scan_knee(x, y, stats.knee_candidates(x), boot=boot)
    lo, hi = scan.interval
    out.update(tested=True, knee=round(scan.knee, 4), interval=(round(lo, 4), round(hi, 4)),
               sup_f=round(scan.sup_f, 4), p=round(scan.p, 4), bootstrap=scan.boot,
               slope_below=round(scan.fit.coef[1], 6), slope_above=round(scan.fit.coef[1] + scan.fit.coef[2], 6),
               claim_inside=lo <= knee_at <= hi)
    if scan.p < 1 - LEVEL:
        where = (f"{knee_at:g} lies inside it" if lo <= knee_at <= hi
                 else f"{knee_at:g} lies outside it: the knee is not where the seed puts it")
        out["verdict"] = (f"a knee at {scan.knee:.3g} MB/1k tokens (95 % interval {lo:.3g} to {hi:.3g}; slope "
                          f"{scan.fit.coef[1]:+.3g} below, {scan.fit.coef[1] + scan.fit.coef[2]:+.3g} above; "
                          f"sup-F p = {scan.p:.3g}): {where}")
    else:
        out["verdict"] = (f"no knee: two lines meeting at the best place ({scan.knee:.3g}) fit no better than "
                          f"one straight line would by chance (sup-F p = {scan.p:.3g}, {scan.boot} bootstraps)")
    return out


def write_plot(c: Correlation, path: str | Path) -> str:
    """A PNG: the runs, the straight line, the best hinge when a knee was tested, the claimed
    knee's place; the title carries n, r and the verdicts. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from kite.atomic import atomic_writer

    fig, ax = plt.subplots(figsize=(8, 5))
    x = np.array([p.regenerate_rate for p in c.points])
    y = np.array([p.hit_rate for p in c.points])
    if len(x):
        ax.scatter(x, y, s=40, zorder=3, label=f"bench runs ({len(x)})")
        if len(x) <= 15:
            for p in c.points:
                ax.annotate(p.run_id[:6], (p.regenerate_rate, p.hit_rate), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, alpha=0.7)
        lo, hi = min(x.min(), c.knee_at), max(x.max(), c.knee_at)
        wide = lo > 0 and hi / lo > 10  # ratios 2-48 span 20x: a log axis keeps the low rates apart
        grid = np.geomspace(lo, hi, 300) if wide else np.linspace(lo, hi, 300)
        if wide:
            ax.set_xscale("log")
        if c.line:
            ax.plot(grid, c.line["intercept"] + c.line["slope"] * grid, "--", color="grey", label="straight line")
        if c.knee.get("tested"):
            h = stats.fit_hinge(x, y, c.knee["knee"])
            ax.plot(grid, stats.hinge_design(grid, c.knee["knee"]) @ np.asarray(h.coef), color="C1",
                    label=f"hinge at {c.knee['knee']:.3g} (p = {c.knee['p']:.3g})")
            ax.axvspan(*c.knee["interval"], color="C1", alpha=0.1, label="95 % interval of the knee")
    ax.axvline(c.knee_at, color="C3", linestyle=":", label=f"claimed knee ({c.knee_at:g})")
    ax.set(xlabel="regenerate rate (MB of .upc per 1,000 context tokens)", ylabel=HIT_RATES[c.hit_rate],
           title=f"{c.hit_rate} vs regenerate rate, {c.runs} runs")
    caption = "\n".join(_wrap(t) for t in (c.verdict, "knee: " + c.knee.get("verdict", ""),
                                            "caveat: " + c.knee["caveat"] if c.knee.get("caveat") else "") if t)
    fig.text(0.01, 0.01, caption, fontsize=7, va="bottom")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout(rect=(0, 0.03 * (caption.count("\n") + 2), 1, 1))  # room for the caption below
    with atomic_writer(path) as fh:
        fig.savefig(fh, format="png", dpi=110)
    plt.close(fig)
    return str(path)


def _runs(n: int) -> str:
    return "1 run" if n == 1 else f"{n} runs"


def _wrap(text: str, width: int = 120) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))
