"""What a compression setting costs in quality and saves in memory, as intervals fitted on measured
runs: the results history (`kite bench history`) first, this project's own measurements (the
packaged calibration kite/tune/calibration/quality_smollm2.json: the embedded model, each point
citing its result file under benchmarks/results) when the history has none for a setting, and
analytic bounds, marked as such, when neither has.

A setting is a codec name as states record it: ``ratio=R`` (the PCA codec at R× smaller than raw
fp16 KV) or a plain quantization preset (``int8``, ``int4`` ...). A point is one measured run of a
setting: the ratio it reached (raw KV bytes / state bytes) and its PPL Δ against full prefill.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from functools import cache
from statistics import mean, stdev

from kite.errors import BadInput

# Bits per value of the quantization presets, all bytes counted: the codes plus an fp16 scale and
# minimum per group (kite/upcycle/codec/settings.py PRESETS: int8 in groups of 64, int2-int4 of
# 32; a test holds these to the presets). Their analytic ratio is 16 / bits.
PRESET_BITS = {"int8": 8 + 32 / 64, "int4": 4 + 32 / 32, "int3": 3 + 32 / 32, "int2": 2 + 32 / 32}
RATIOS = (2.0, 4.0, 8.0, 16.0)  # the PCA codec's settings the plan always shows
MIN_RUNS = 2  # a setting is recommended on at least this many measured runs (one has no spread)


@dataclass(frozen=True, slots=True)
class QualityPoint:
    """One measured run of a setting. `method`: ``state`` (the whole state), ``fused`` (YOCO's
    loads), ``eval`` (`kite upcycle eval`), ``bytes`` (a file's size only: no PPL) or ``gpu-bytes``
    (the state as staged on a GPU: what a resident state occupies)."""

    setting: str
    achieved_ratio: float | None
    ppl_delta: float | None
    method: str
    model: str
    source: str
    min_hit_gain: float | None = None
    ttft_speedup: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


QUALITY_SCHEMA = "kite.tune.quality/1"
METHODS = ("state", "fused", "eval", "bytes", "gpu-bytes")
_CITED = ("achieved_ratio", "ppl_delta", "state_bytes", "min_hit_gain", "ttft_speedup")
_RESULT = re.compile(r"[a-z0-9_]+_[a-z0-9-]+_\d{8}_[0-9a-f]{7}(?:_[A-Za-z0-9_-]+)?\.json")


@dataclass(frozen=True, slots=True)
class QualityCalibration:
    """This project's measured points (package data kite/tune/calibration/<name>.json): each cites
    the result file under benchmarks/results, its rows, the commit and the day of its run."""

    model: str
    workload: str
    points: tuple[QualityPoint, ...]
    commits: tuple[str, ...]     # full hashes, in the order of the points' days
    dates: tuple[str, ...]       # YYYY-MM-DD, sorted

    @property
    def name(self) -> str:
        """The calibration by name: its model, the days and commits of its runs."""
        span = self.dates[0] if len(self.dates) == 1 else f"{self.dates[0]} to {self.dates[-1]}"
        return f"{self.model} quality calibration of {span} (commits {', '.join(c[:7] for c in self.commits)})"

    def to_dict(self) -> dict:
        return {"name": self.name, "model": self.model, "workload": self.workload,
                "points": [p.to_dict() for p in self.points]}


def _bad(where: str, why: str) -> BadInput:
    return BadInput(f"{where}: not a {QUALITY_SCHEMA} calibration: {why}")


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def parse_quality_calibration(obj, where: str = "quality calibration") -> QualityCalibration:
    """The points an object holds; BadInput (one line, starting with `where`) when it is not the
    schema: a setting the fit knows, a method of METHODS, its figures (the bytes ratio > 0, the PPL Δ;
    a ``gpu-bytes`` point: raw and state bytes, the ratio theirs), a row of the result file for each
    figure, a full commit and a YYYY-MM-DD date."""
    if not isinstance(obj, dict) or obj.get("schema") != QUALITY_SCHEMA:
        raise _bad(where, "no schema line")
    for k in ("model", "workload"):
        if not (isinstance(obj.get(k), str) and obj[k]):
            raise _bad(where, f"{k} must be a non-empty string")
    raw = obj.get("points")
    if not isinstance(raw, list) or not raw:
        raise _bad(where, "points must be a non-empty list")
    points = []
    for i, p in enumerate(raw):
        at = f"points[{i}]"
        if not isinstance(p, dict):
            raise _bad(where, f"{at} must be an object")
        if not isinstance(p.get("setting"), str) or nominal_ratio(p["setting"]) is None:
            raise _bad(where, f"{at}: setting {p.get('setting')!r} is neither ratio=R nor a preset "
                       f"({', '.join(PRESET_BITS)})")
        if p.get("method") not in METHODS:
            raise _bad(where, f"{at}: method must be one of {', '.join(METHODS)}")
        for k in ("model", "run"):
            if not (isinstance(p.get(k), str) and p[k]):
                raise _bad(where, f"{at}: {k} must be a non-empty string")
        for k in _CITED:
            if p.get(k) is not None and not _is_num(p[k]):
                raise _bad(where, f"{at}: {k} must be a number or null")
        ratio = p.get("achieved_ratio")
        if p["method"] == "gpu-bytes":
            raw_b, state_b = p.get("raw_kv_bytes"), p.get("state_bytes")
            if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in (raw_b, state_b)):
                raise _bad(where, f"{at}: a gpu-bytes point needs raw_kv_bytes and state_bytes, whole bytes > 0")
            if ratio is not None:
                raise _bad(where, f"{at}: a gpu-bytes point's ratio is raw_kv_bytes / state_bytes, not given")
            ratio = raw_b / state_b
        elif ratio is not None and ratio <= 0:
            raise _bad(where, f"{at}: achieved_ratio must be positive")
        if ratio is None and p.get("ppl_delta") is None:
            raise _bad(where, f"{at}: neither a ratio nor a PPL delta")
        rows = p.get("rows")
        if not isinstance(rows, dict):
            raise _bad(where, f"{at}: rows must be an object (figure -> the result's row)")
        for k in _CITED:
            wanted = p.get(k) is not None
            if wanted and not (isinstance(rows.get(k), str) and rows[k]):
                raise _bad(where, f"{at}: rows.{k} must name the result's row of {k}")
            if not wanted and k in rows:
                raise _bad(where, f"{at}: rows.{k} cites a figure the point does not have")
        if not (isinstance(p.get("result"), str) and _RESULT.fullmatch(p["result"])):
            raise _bad(where, f"{at}: result must name a file of benchmarks/results")
        if not (isinstance(p.get("commit"), str) and re.fullmatch(r"[0-9a-f]{40}", p["commit"])):
            raise _bad(where, f"{at}: commit must be a full git hash")
        if not (isinstance(p.get("date"), str) and re.fullmatch(r"\d{4}-\d\d-\d\d", p["date"])):
            raise _bad(where, f"{at}: date must be YYYY-MM-DD")
        points.append((p, QualityPoint(
            p["setting"], float(ratio) if ratio is not None else None,
            float(p["ppl_delta"]) if p.get("ppl_delta") is not None else None, p["method"], p["model"],
            f"{p['run']} (benchmarks/results/{p['result']}, commit {p['commit'][:7]}, {p['date']})",
            _num(p.get("min_hit_gain")), _num(p.get("ttft_speedup")))))
    if len({q.source for _, q in points}) != len(points):
        raise _bad(where, "two points name the same run")
    by_day = sorted(points, key=lambda x: x[0]["date"])
    return QualityCalibration(obj["model"], obj["workload"], tuple(q for _, q in points),
                              tuple(dict.fromkeys(p["commit"] for p, _ in by_day)),
                              tuple(sorted({p["date"] for p, _ in points})))


def load_quality_calibration(name: str = "quality_smollm2") -> QualityCalibration:
    """The packaged calibration kite/tune/calibration/<name>.json, validated (BadInput, one line,
    when missing or not the schema)."""
    from kite.tune.gpus import read_packaged_calibration

    return parse_quality_calibration(*read_packaged_calibration(name))


@cache
def reference() -> QualityCalibration:
    """This project's measured points: the packaged calibration (the embedded SmolLM2-135M; GPU bytes
    at Qwen2-7B geometry on the H200)."""
    return load_quality_calibration()


def nominal_ratio(setting: str) -> float | None:
    """The ratio a setting aims at: R of ``ratio=R``; 16 / bits of a quantization preset."""
    if setting.startswith("ratio="):
        try:
            return float(setting[6:])
        except ValueError:
            return None
    bits = PRESET_BITS.get(setting)
    return 16 / bits if bits else None


def setting_of(config: dict) -> str | None:
    """The setting a bench run's config names (its codec; its --ratio when the codec is not
    recorded)."""
    codec = config.get("codec")
    if isinstance(codec, str) and (codec.startswith("ratio=") or codec in PRESET_BITS):
        return f"ratio={float(codec[6:]):g}" if codec.startswith("ratio=") else codec
    ratio = config.get("ratio")
    if isinstance(ratio, (int, float)) and ratio > 1:
        return f"ratio={float(ratio):g}"
    return None


def points_from_history(runs: list[dict]) -> list[QualityPoint]:
    """The measured points of `kite bench history`'s runs: the whole state's and YOCO's (fused)
    figures of each run that finished at least one case."""
    out = []
    for run in runs:
        config, figures = run.get("config") or {}, run.get("figures") or {}
        setting = setting_of(config) if isinstance(config, dict) else None
        if setting is None or not isinstance(figures, dict) or not run.get("cases"):
            continue
        model = (run.get("model") or {}).get("spec") or "?"
        for method in ("state", "fused"):
            f = figures.get(method)
            if not isinstance(f, dict):
                continue
            ratio, delta = _num(f.get("compression_ratio")), _num(f.get("ppl_delta"))
            if ratio is None and delta is None:
                continue
            out.append(QualityPoint(setting, ratio, delta, method, str(model), f"run {run.get('run_id', '?')}",
                                    _num(config.get("yoco_min_hit_gain")) if method == "fused" else None,
                                    _num(f.get("ttft_speedup")) if method == "fused" else None))
    return out


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


# Two-sided 90 % Student t quantiles by degrees of freedom (1.645 past 30).
_T90 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812,
        12: 1.782, 15: 1.753, 20: 1.725, 30: 1.697}


def _t90(df: int) -> float:
    return next((_T90[k] for k in sorted(_T90) if k >= df), 1.645)


@dataclass(frozen=True, slots=True)
class Interval:
    """[low, high] of a quantity; None is unbounded. `basis`: history | history + reference |
    reference | analytic; `n`: the measured points it rests on, `runs`: the runs they come from (a
    bench run gives two: the whole state's and YOCO's); `how`: in words."""

    low: float | None
    high: float | None
    basis: str
    n: int
    how: str
    runs: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def fit_interval(values: list[float], basis: str, runs: int | None = None) -> Interval:
    """A 90 % prediction interval for the next run from three or more points (mean ± t·sd·√(1+1/n),
    never narrower than the points), the range of one or two."""
    n = len(values)
    runs = n if runs is None else runs
    if n >= 3:
        half = _t90(n - 1) * stdev(values) * math.sqrt(1 + 1 / n)
        m = mean(values)
        return Interval(min(m - half, min(values)), max(m + half, max(values)), basis, n,
                        f"90 % prediction interval of {n} points from {runs} runs", runs)
    return Interval(min(values), max(values), basis, n, f"range of {n} point{'s' if n > 1 else ''}", runs)


@dataclass(slots=True)
class SettingFit:
    """What a setting is predicted to reach: its ratio (raw / state bytes) and PPL Δ."""

    setting: str
    nominal: float | None
    ratio: Interval
    ppl_delta: Interval
    points: list[QualityPoint] = field(default_factory=list)
    gpu_ratio: float | None = None  # measured: raw KV / the state's bytes as staged on a GPU

    @property
    def saving(self) -> tuple[float | None, float | None]:
        """Memory saved against raw KV, as fractions (low, high)."""
        lo, hi = self.ratio.low, self.ratio.high
        return (1 - 1 / lo if lo else None, 1 - 1 / hi if hi else None)

    def ratio_point(self) -> float | None:
        """The ratio to size with: what a state of this setting took on a GPU where measured, else
        the mean of the measured ratios, else the nominal one."""
        got = [p.achieved_ratio for p in self.points if p.achieved_ratio]
        return self.gpu_ratio or (mean(got) if got else self.nominal)

    def to_dict(self) -> dict:
        lo, hi = self.saving
        return {"setting": self.setting, "nominal_ratio": self.nominal, "ratio": self.ratio.to_dict(),
                "ratio_point": self.ratio_point(), "gpu_ratio": self.gpu_ratio,
                "memory_saving": {"low": lo, "high": hi, "basis": self.ratio.basis},
                "ppl_delta": self.ppl_delta.to_dict(), "points": [p.to_dict() for p in self.points]}


def fit_settings(history: list[QualityPoint], use_reference: bool = True) -> list[SettingFit]:
    """Every setting the plan shows (RATIOS, the presets, and any the points name), fitted on the
    history's points where they come from MIN_RUNS runs, pooled with the reference points (when
    `use_reference`) where it has fewer, else bounded analytically: the ratio by its nominal value,
    the PPL Δ from below by the largest fitted low of a setting with a smaller nominal ratio (more
    compression is assumed to lose no less) and not at all from above."""
    names = [f"ratio={r:g}" for r in RATIOS] + list(PRESET_BITS)
    names += [p.setting for p in (*history, *(reference().points if use_reference else ()))]
    fits = [_fit_one(name, history, use_reference) for name in dict.fromkeys(names)]
    _bound_unmeasured(fits)
    return sorted(fits, key=lambda f: (f.nominal or 0, f.setting))


def _fit_one(name: str, history: list[QualityPoint], use_reference: bool) -> SettingFit:
    nominal = nominal_ratio(name)
    mine = [p for p in history if p.setting == name]
    ref = [p for p in reference().points if use_reference and p.setting == name]
    ratio = _interval([p for p in mine if p.achieved_ratio], [p for p in ref if p.achieved_ratio],
                      lambda p: p.achieved_ratio)
    ppl = _interval([p for p in mine if p.ppl_delta is not None], [p for p in ref if p.ppl_delta is not None],
                    lambda p: p.ppl_delta)
    points = list(dict.fromkeys([*ratio[1], *ppl[1]]))
    r_int = ratio[0] or (Interval(nominal, nominal, "analytic", 0, "the nominal ratio (the codec's byte budget); "
                                  "not measured") if nominal else Interval(None, None, "analytic", 0, "unknown"))
    gpu = [p.achieved_ratio for p in reference().points if use_reference and p.setting == name
           and p.method == "gpu-bytes"]
    return SettingFit(name, nominal, r_int, ppl[0] or Interval(None, None, "analytic", 0, "not measured"),
                      points, gpu[0] if gpu else None)


def _interval(mine: list[QualityPoint], ref: list[QualityPoint], value) -> tuple[Interval | None, list]:
    """The history's points alone when they come from MIN_RUNS runs; from fewer, pooled with this
    project's reference points (the basis says so)."""
    if _runs(mine) >= MIN_RUNS or (mine and not ref):
        return fit_interval([value(p) for p in mine], "history", _runs(mine)), mine
    pool = mine + ref
    if not pool:
        return None, []
    return fit_interval([value(p) for p in pool], "history + reference" if mine else "reference", _runs(pool)), pool


def _runs(points: list[QualityPoint]) -> int:
    return len({p.source for p in points})


def _bound_unmeasured(fits: list[SettingFit]) -> None:
    measured = [f for f in fits if f.ppl_delta.basis != "analytic" and f.nominal]
    for f in fits:
        if f.ppl_delta.basis != "analytic" or not f.nominal:
            continue
        below = [m for m in measured if m.nominal < f.nominal and m.ppl_delta.low is not None]
        if below:
            b = max(below, key=lambda m: m.nominal)
            low = max(0.0, b.ppl_delta.low)
            f.ppl_delta = Interval(low, None, "analytic", 0,
                                   f"not measured: at least {b.setting}'s low ({low:+.3f}), no upper bound")
        else:
            f.ppl_delta = Interval(0.0, None, "analytic", 0, "not measured: no upper bound")


def recommend(fits: list[SettingFit], tolerance: float) -> SettingFit | None:
    """The setting that saves the most memory (its interval's low end) whose PPL Δ interval lies
    under `tolerance` and rests on at least MIN_RUNS measured runs; None when none does."""
    ok = [f for f in fits if f.ppl_delta.basis != "analytic" and f.ppl_delta.runs >= MIN_RUNS
          and f.ppl_delta.high is not None and f.ppl_delta.high <= tolerance and f.saving[0] is not None]
    return max(ok, key=lambda f: (f.saving[0], f.setting.startswith("ratio=")), default=None)


@dataclass(frozen=True, slots=True)
class MinHitGain:
    value: float
    basis: str
    n: int
    how: str

    def to_dict(self) -> dict:
        return asdict(self)


def recommend_min_hit_gain(history: list[QualityPoint], tolerance: float, default: float) -> MinHitGain:
    """The `yoco_min_hit_gain` of the history's fused runs whose PPL Δ stayed under `tolerance` with
    the best mean TTFT speedup; `default` when no measured runs compare values."""
    by: dict[float, list[QualityPoint]] = {}
    for p in history:
        if p.method == "fused" and p.min_hit_gain is not None and p.ppl_delta is not None:
            by.setdefault(p.min_hit_gain, []).append(p)
    if len(by) < 2:
        n = sum(len(v) for v in by.values())
        return MinHitGain(default, "default", n, "the default: no measured runs compare values"
                          if not by else f"the default: every measured run ({n}) used one value")
    ok = {g: ps for g, ps in by.items() if max(p.ppl_delta for p in ps) <= tolerance}
    if not ok:
        return MinHitGain(default, "default", sum(len(v) for v in by.values()),
                          "the default: no value's runs stayed under the tolerance")
    best = max(ok, key=lambda g: (mean([p.ttft_speedup or 0 for p in ok[g]]), g))
    return MinHitGain(best, "history", len(ok[best]),
                      f"best mean TTFT speedup under the tolerance among {len(by)} values measured")
