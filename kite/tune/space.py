"""What `kite tune` can vary: every tunable parameter (its type, bounds, what it acts on, its value
now), and the ranges a command asks for, checked and turned into the values a grid tries or the
distributions Optuna samples.

A parameter acts on the **state** (another value makes other `.upc` states: ratio, precision,
clusters, span bounds) or on the **request** (the same states, another decision: the minimum
predicted gain, a rule's threshold). Request parameters reuse every state of the point before.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from kite.errors import BadInput

STATE, REQUEST = "state", "request"
# The memory-budgeted cache's parameter: measured by the bench's `budget` method, which reads no
# state and no rules, so it is tuned alone.
BUDGET = "kv_budget_tokens"


@dataclass(frozen=True, slots=True)
class Param:
    """One tunable parameter. `low`/`high` are inclusive bounds unless `low_open` (None: none)."""

    name: str
    kind: str  # "float" | "int" | "choice"
    acts_on: str  # STATE | REQUEST
    doc: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    current: Any = None  # the value in force when it is not tuned
    source: str = ""  # where `current` comes from

    def bounds(self) -> str:
        """The allowed range in words: `≥ 1`, `(0, 1]`, `1-256`, `one of a, b`."""
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        lo = "" if self.low is None else f"{'(' if self.low_open else '['}{self.low:g}"
        if self.low is not None and self.high is not None:
            return f"{lo}, {self.high:g}]"
        if self.low is not None:
            return f"{'>' if self.low_open else '≥'} {self.low:g}"
        return f"≤ {self.high:g}" if self.high is not None else "any"

    def check(self, value: Any, flag: str) -> Any:
        """`value` as this parameter's type, inside its bounds; else BadInput naming `flag`."""
        if self.kind == "choice":
            text = str(value).strip().lower()
            if text not in self.choices:
                raise BadInput(f"{flag}: {self.name} {value!r} is not {self.bounds()}")
            return text
        x = float(value)
        if self.kind == "int" and x != int(x):
            raise BadInput(f"{flag}: {self.name} takes whole numbers, got {value}")
        low_bad = self.low is not None and (x <= self.low if self.low_open else x < self.low)
        if low_bad or (self.high is not None and x > self.high) or not math.isfinite(x):
            raise BadInput(f"{flag}: {self.name} {value} is outside its range {self.bounds()}")
        return int(x) if self.kind == "int" else x

    def to_dict(self) -> dict:
        return {"name": self.name, "type": self.kind, "acts_on": self.acts_on, "range": self.bounds(),
                "low": self.low, "high": self.high, "choices": list(self.choices) or None,
                "current": self.current, "source": self.source, "doc": self.doc}


# The ones that are not a rule's threshold (those are read from the rule file: rule_params).
def builtin_params(cfg=None, kite_cfg=None) -> list[Param]:
    """The fixed parameters, with the values in force now (`cfg`: the upcycle config; `kite_cfg`:
    the KITE config; None: the defaults)."""
    from kite.config import DEFAULT_MIN_HIT_GAIN
    from kite.upcycle import codec, load_upcycle_config, min_budget

    if cfg is None:
        cfg = load_upcycle_config(None)[0]
    c = cfg.compression
    fraction = kite_cfg.features.upcycle_compression_ratio if kite_cfg is not None else None
    gain = kite_cfg.features.yoco_min_hit_gain if kite_cfg is not None else DEFAULT_MIN_HIT_GAIN
    size_src = "features.upcycle_compression_ratio" if fraction is not None else "compression.svd_ratio"
    fraction_now = fraction if fraction is not None else (None if c.precision else c.svd_ratio)
    return [
        Param("ratio", "float", STATE, "a state R times smaller than the document's raw fp16 KV (--ratio)",
              low=1.0, current=round(1 / fraction_now, 6) if fraction_now else None, source=size_src),
        Param("upcycle_compression_ratio", "float", STATE,
              "the seed's spelling of the same knob: the fraction of raw fp16 KV kept (= 1 / ratio)",
              low=0.0, high=1.0, low_open=True, current=fraction_now, source=size_src),
        Param("precision", "choice", STATE, "a codec preset instead of a ratio (--precision)",
              choices=tuple(codec.PRESETS), current=c.precision, source="compression.precision"),
        Param("cluster_num", "int", STATE, "k-means clusters of spans; each loads on its own",
              low=1, high=256, current=c.cluster_num, source="compression.cluster_num"),
        Param("min_span_tokens", "int", STATE, "shortest span a document is cut into (tokens)",
              low=4, current=c.min_span_tokens, source="compression.min_span_tokens"),
        Param("max_span_tokens", "int", STATE, "longest span (tokens); above min_span_tokens",
              low=8, current=c.max_span_tokens, source="compression.max_span_tokens"),
        Param("yoco_min_hit_gain", "float", REQUEST, "a load predicted to gain less is skipped",
              low=0.0, current=gain, source="features.yoco_min_hit_gain"),
        Param(BUDGET, "int", REQUEST, "the memory-budgeted cache (--kv-budget-tokens): tokens held raw, older ones "
              "upcycled in blocks; no state: its figures are the bench's `budget` method's, not the fused "
              "pipeline's", low=min_budget(), current=None, source="kite generate / serve --kv-budget-tokens"),
    ]


# Parameters that set the same thing: a point may hold one of each group.
EXCLUSIVE = (("ratio", "upcycle_compression_ratio", "precision"),)


@dataclass(frozen=True, slots=True)
class Range:
    """What a command asked to try for one parameter: grid `values`, and for Optuna the same
    values (choice, or a stepped range) or a continuous range (`step` None)."""

    param: Param
    values: tuple  # the grid (empty for a continuous range: Optuna only)
    low: float | None = None
    high: float | None = None
    step: float | None = None
    explicit: bool = False  # given as --values

    @property
    def name(self) -> str:
        return self.param.name

    def describe(self) -> str:
        if self.explicit or self.param.kind == "choice":
            return ", ".join(_show(v) for v in self.values)
        if self.step is None:
            return f"{_show(self.low)}..{_show(self.high)} (continuous)"
        return f"{_show(self.low)}..{_show(self.high)} step {_show(self.step)} ({len(self.values)} values)"

    def to_dict(self) -> dict:
        return {"name": self.name, "values": list(self.values), "low": self.low, "high": self.high,
                "step": self.step, "explicit": self.explicit}


@dataclass
class RangeSpec:
    """One `--param NAME` and the flags after it, as given (strings)."""

    name: str
    min: str | None = None
    max: str | None = None
    step: str | None = None
    values: str | None = None
    flags: list[str] = field(default_factory=list)


def _show(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _decimal(text: str, flag: str) -> Decimal:
    try:
        d = Decimal(str(text).strip())
    except InvalidOperation:
        raise BadInput(f"{flag} {text!r}: not a number") from None
    if not d.is_finite():
        raise BadInput(f"{flag} {text!r}: not a finite number")
    return d


def parse_range(spec: RangeSpec, params: dict[str, Param], continuous_ok: bool) -> Range:
    """Check one parameter's range. BadInput for an unknown name (listing the tunable ones), an
    empty or inverted range, a step that is not positive or does not divide the range, values
    outside the parameter's bounds. `continuous_ok` (Optuna): a range without --step is sampled
    continuously; the grid needs a step."""
    from kite.yoco.signals import suggest

    p = params.get(spec.name)
    if p is None:
        hint = suggest(spec.name, list(params))
        raise BadInput(f"--param {spec.name}: not a tunable parameter" + (f"; did you mean {hint!r}?" if hint else "")
                       + f" (tunable: {', '.join(params)}; `kite tune params` lists them)")
    flag = f"--param {p.name}"
    ranged = [x for x in (spec.min, spec.max, spec.step) if x is not None]
    if spec.values is not None:
        if ranged:
            raise BadInput(f"{flag}: give either --values or --min/--max/--step, not both")
        items = [v.strip() for v in spec.values.split(",") if v.strip()]
        if not items:
            raise BadInput(f"{flag} --values {spec.values!r}: no value given")
        vals = tuple(dict.fromkeys(p.check(_decimal(v, f"{flag} --values") if p.kind != "choice" else v,
                                           f"{flag} --values") for v in items))
        nums = [v for v in vals if not isinstance(v, str)]
        return Range(p, vals, min(nums) if nums else None, max(nums) if nums else None, None, explicit=True)
    if p.kind == "choice":
        raise BadInput(f"{flag}: a choice ({p.bounds()}); give --values, e.g. --values "
                       f"{','.join(p.choices[-3:])}")
    if spec.min is None or spec.max is None:
        missing = "--min" if spec.min is None else "--max"
        raise BadInput(f"{flag}: {missing} is missing; give --min A --max B --step S (or --values a,b,c)")
    lo, hi = _decimal(spec.min, f"{flag} --min"), _decimal(spec.max, f"{flag} --max")
    if lo > hi:
        raise BadInput(f"{flag}: the range is inverted (--min {spec.min} > --max {spec.max}); write "
                       f"--min {spec.max} --max {spec.min}")
    if lo == hi:
        raise BadInput(f"{flag}: the range is empty (--min = --max = {spec.min}); give two different "
                       f"bounds, or --values {spec.min} to fix one value")
    p.check(lo, f"{flag} --min")
    p.check(hi, f"{flag} --max")
    if spec.step is None:
        if continuous_ok:
            kind_step = 1 if p.kind == "int" else None
            return Range(p, (), p.check(lo, flag), p.check(hi, flag), kind_step)
        raise BadInput(f"{flag}: --step is missing (the grid search tries min, min + step, ... max); "
                       f"or sample the range with --search optuna")
    step = _decimal(spec.step, f"{flag} --step")
    if step <= 0:
        raise BadInput(f"{flag} --step {spec.step}: the step must be positive")
    if p.kind == "int" and step != step.to_integral_value():
        raise BadInput(f"{flag} --step {spec.step}: {p.name} takes whole numbers")
    n = (hi - lo) / step
    if n != n.to_integral_value():
        below = lo + step * int(n)
        raise BadInput(f"{flag}: --step {spec.step} does not divide the range {spec.min}..{spec.max} "
                       f"(({spec.max} - {spec.min}) / {spec.step} = {float(n):g}); the grid would stop at "
                       f"{below} and never try --max: use --max {below}, or a step that divides it")
    vals = tuple(p.check(lo + step * i, flag) for i in range(int(n) + 1))
    return Range(p, vals, vals[0], vals[-1], int(step) if p.kind == "int" else float(step))


def parse_ranges(specs: list[RangeSpec], params: list[Param], continuous_ok: bool = False) -> list[Range]:
    """Every `--param`, checked (see :func:`parse_range`), plus: a parameter given twice, and two
    parameters that set the same thing (ratio, upcycle_compression_ratio, precision)."""
    if not specs:
        raise BadInput("give at least one --param NAME with --min/--max/--step or --values "
                       "(`kite tune params` lists the tunable ones)")
    by_name = {p.name: p for p in params}
    seen: set[str] = set()
    out = []
    for spec in specs:
        if spec.name in seen:
            raise BadInput(f"--param {spec.name} is given twice; give each parameter once")
        seen.add(spec.name)
        out.append(parse_range(spec, by_name, continuous_ok))
    for group in EXCLUSIVE:
        both = [n for n in group if n in seen]
        if len(both) > 1:
            raise BadInput(f"--param {both[0]} and --param {both[1]} both set a state's size; tune one of "
                           f"{', '.join(group)}")
    if BUDGET in seen and len(seen) > 1:
        other = next(n for n in seen if n != BUDGET)
        raise BadInput(f"--param {BUDGET} measures the memory-budgeted cache, which reads no state and no rules: "
                       f"tune it alone, not with --param {other}")
    return out


def point_problem(point: dict, base: dict | None = None) -> str | None:
    """Why a combination of values cannot be run (None: it can). `base`: the values in force for
    the parameters the point does not set."""
    both = {**(base or {}), **point}
    lo, hi = both.get("min_span_tokens"), both.get("max_span_tokens")
    if lo is not None and hi is not None and lo >= hi:
        return f"min_span_tokens {lo} ≥ max_span_tokens {hi}"
    return None


def grid(ranges: list[Range], base: dict | None = None) -> tuple[list[dict], list[tuple[dict, str]]]:
    """The full grid, in order (the last parameter varies fastest): (points to run, points
    skipped with why; `base` as for :func:`point_problem`). A continuous range has no grid: BadInput."""
    for r in ranges:
        if not r.values:
            raise BadInput(f"--param {r.name}: a continuous range has no grid; give --step")
    points, skipped = [], []
    for combo in itertools.product(*(r.values for r in ranges)):
        point = dict(zip((r.name for r in ranges), combo))
        why = point_problem(point, base)
        if why:
            skipped.append((point, why))
        else:
            points.append(point)
    if not points:
        raise BadInput(f"every point of the grid is impossible (e.g. {skipped[0][1]}); change the ranges")
    return points, skipped
