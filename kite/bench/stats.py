"""Small statistics for reports over bench runs (numpy only): Pearson and Spearman coefficients
with Fisher-z intervals, Student t / F tail probabilities, a straight line against a hinge (two
lines meeting at a knee), and the sup-F test for a knee anywhere, bootstrapped under the line."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np


def pearson(x, y) -> float | None:
    """Pearson's r; None when either side is constant (or fewer than 3 points)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(np.clip(np.corrcoef(x, y)[0, 1], -1.0, 1.0))


def ranks(v) -> np.ndarray:
    """Ranks 1..n, ties given their average rank."""
    v = np.asarray(v, float)
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v))
    r[order] = np.arange(1, len(v) + 1)
    for value in np.unique(v):
        tied = v == value
        r[tied] = r[tied].mean()
    return r


def spearman(x, y) -> float | None:
    """Spearman's rho: Pearson's r of the ranks."""
    return pearson(ranks(x), ranks(y)) if len(x) >= 3 else None


def fisher_interval(r: float, n: int, level: float = 0.95, se_scale: float = 1.0) -> tuple[float, float] | None:
    """A `level` interval for a correlation from Fisher's z, standard error se_scale / sqrt(n - 3)
    (Pearson: 1; Spearman: sqrt(1.06), Fieller et al. 1957). None for n < 4."""
    if n < 4:
        return None
    z = math.atanh(max(min(r, 1 - 1e-12), -1 + 1e-12))
    half = NormalDist().inv_cdf(0.5 + level / 2) * se_scale / math.sqrt(n - 3)
    return math.tanh(z - half), math.tanh(z + half)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def f_sf(f: float, d1: float, d2: float) -> float:
    """P(F > f) for F(d1, d2)."""
    if f <= 0:
        return 1.0
    if math.isinf(f):
        return 0.0
    return betainc(d2 / 2.0, d1 / 2.0, d2 / (d2 + d1 * f))


def f_ppf(q: float, d1: float, d2: float) -> float:
    """The q-quantile of F(d1, d2) (bisection on f_sf)."""
    lo, hi = 0.0, 1.0
    while f_sf(hi, d1, d2) > 1 - q:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f_sf(mid, d1, d2) > 1 - q else (lo, mid)
    return (lo + hi) / 2


def r_pvalue(r: float, n: int) -> float:
    """Two-sided p of Pearson's r = 0 (t with n - 2 degrees of freedom)."""
    if abs(r) >= 1:
        return 0.0
    t2 = r * r * (n - 2) / (1 - r * r)
    return f_sf(t2, 1, n - 2)


def _rss(design: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    return coef, float(resid @ resid)


def line_design(x) -> np.ndarray:
    x = np.asarray(x, float)
    return np.column_stack([np.ones_like(x), x])


def hinge_design(x, knee: float) -> np.ndarray:
    """y = a + b·x + c·max(0, x − knee): two lines that meet at `knee`; c is the change of slope."""
    x = np.asarray(x, float)
    return np.column_stack([np.ones_like(x), x, np.maximum(0.0, x - knee)])


@dataclass(frozen=True, slots=True)
class Fit:
    coef: tuple[float, ...]
    rss: float


def fit_line(x, y) -> Fit:
    coef, rss = _rss(line_design(x), np.asarray(y, float))
    return Fit(tuple(float(c) for c in coef), rss)


def fit_hinge(x, y, knee: float) -> Fit:
    coef, rss = _rss(hinge_design(x, knee), np.asarray(y, float))
    return Fit(tuple(float(c) for c in coef), rss)


def nested_f(rss_small: float, rss_big: float, extra: int, df_big: int) -> tuple[float, float]:
    """F and its p for a model with `extra` more parameters (residual df `df_big`) against the
    smaller one it contains."""
    if df_big <= 0:
        return math.nan, math.nan
    if rss_big <= 1e-15 * max(rss_small, 1e-300):
        return (math.inf, 0.0) if rss_small > 1e-15 else (math.nan, math.nan)
    f = ((rss_small - rss_big) / extra) / (rss_big / df_big)
    return f, f_sf(max(f, 0.0), extra, df_big)


def knee_candidates(x, points: int = 200) -> np.ndarray:
    """Knees to try: from the second lowest distinct x to the third highest, so at least two runs
    lie on or below a knee and two above it (fewer would fit a hinge exactly)."""
    d = np.unique(np.asarray(x, float))
    if len(d) < 4:
        return np.empty(0)
    return np.unique(np.concatenate([np.linspace(d[1], d[-3], points), d[1:-2]]))


def _rss_many(x: np.ndarray, ys: np.ndarray, knees: np.ndarray) -> np.ndarray:
    """RSS of a hinge at each knee (columns) for each row of `ys` (rows)."""
    out = np.empty((ys.shape[0], len(knees)))
    for j, k in enumerate(knees):
        q, _ = np.linalg.qr(hinge_design(x, k))
        fitted = (ys @ q) @ q.T
        out[:, j] = ((ys - fitted) ** 2).sum(axis=1)
    return out


@dataclass(frozen=True, slots=True)
class KneeScan:
    """The best knee over `knees`, the sup-F statistic of a hinge against a line, its p-value
    bootstrapped under the line (residuals resampled, `boot` times), and the knees a 95 % profile
    F interval keeps (lo, hi: the hull of them)."""

    knee: float
    fit: Fit
    sup_f: float
    p: float
    boot: int
    interval: tuple[float, float]


def scan_knee(x, y, knees: np.ndarray, boot: int = 999, seed: int = 0) -> KneeScan:
    """Where a hinge fits best and whether it beats a straight line by more than a line's noise
    would: the sup-F test (Andrews 1993), the null distribution bootstrapped from the line's own
    residuals, as the knee's position is searched (a plain F-test at the best knee calls knees in
    straight lines too often)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    n = len(x)
    line = fit_line(x, y)
    rss = _rss_many(x, y[None, :], knees)[0]
    j = int(np.argmin(rss))
    best = fit_hinge(x, y, float(knees[j]))
    sup_f, _ = nested_f(line.rss, best.rss, 1, n - 3)
    rng = np.random.default_rng(seed)
    fitted = line_design(x) @ np.asarray(line.coef)
    resid = y - fitted
    ys = fitted + rng.choice(resid, size=(boot, n), replace=True)
    qs, _ = np.linalg.qr(line_design(x))
    line_rss = ((ys - (ys @ qs) @ qs.T) ** 2).sum(axis=1)
    hinge_rss = _rss_many(x, ys, knees).min(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        boot_f = (line_rss - hinge_rss) / (hinge_rss / (n - 3))
    boot_f = np.nan_to_num(boot_f, nan=0.0, posinf=np.inf)
    p = float((1 + np.sum(boot_f >= sup_f - 1e-12)) / (boot + 1)) if math.isfinite(sup_f) else 1 / (boot + 1)
    if n > 4 and best.rss > 0:
        keep = (rss - best.rss) / (best.rss / (n - 4)) <= f_ppf(0.95, 1, n - 4)
        interval = (float(knees[keep].min()), float(knees[keep].max()))
    else:
        interval = (float(knees[j]), float(knees[j]))
    return KneeScan(float(knees[j]), best, float(sup_f), p, boot, interval)
