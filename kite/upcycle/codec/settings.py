"""Codec settings: the concrete parameters of a state's codec, the presets by name, and ``ratio=R``.

Settings by name (:func:`settings_for`): ``"exact"`` (fp32, bit-exact), ``"fp32"``, ``"fp16"``,
``"bf16"``, ``"fp8"`` (raw casts), ``"int8"``, ``"int4"``, ``"int3"``, ``"int2"`` (plain
quantization of K and V, KIVI-style), and ``"ratio=R"`` / ``R`` for the PCA codec at compression
ratio R against raw fp16 KV (defaults chosen by ``benchmarks/codec_sweep.py``; docs/compression.md).
Every field is stored in each layer codec's meta, so a state decodes with the settings it was made with.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

@dataclass(frozen=True)
class CodecSettings:
    """Concrete codec parameters (every field is stored in the layer meta)."""

    name: str = "custom"
    k_mode: str = "pca"          # "pca" | "quant" | "raw"
    v_mode: str = "pca"
    k_bits: float = 4.0          # pca: budget in bits per original element (all bytes counted)
    v_bits: float = 4.0          # quant: the integer width (int2..int8)
    k_fmt: str = "fp16"          # raw mode: the float format of keys / values
    v_fmt: str = "fp16"
    group_size: int = 128        # tokens per quantization group (pca coefficients, quant keys)
    v_group_size: int = 64       # channels per group for values in quant mode (per token)
    basis_fmt: str = "int8"      # stored PCA basis: fp32 | fp16 | bf16 | int8 (per-column scale)
    max_bits: int = 8            # per component
    outliers: int = 0            # per part: tokens with the largest normalized energy kept in fp16
    sink_tokens: int = 1         # tokens at positions < sink_tokens kept in fp16 (attention sinks)
    part_tokens: int = 256       # expected tokens per encoded part (budgets its fixed costs)
    joint_heads: bool = False    # one PCA over the concatenated heads of a layer (H*d dims)
    center: bool = True          # subtract the per-head mean before PCA
    range_mode: str = "mse"      # pca coefficients: "mse" (clipped, Gaussian-optimal) | "minmax"
    even_groups: bool = False    # pca parts: ceil(T / group_size) groups of equal size (else group_size,
                                 # the last padded with copies of its last token: format.bitlayout)
    budget: str = "layer"        # pca bits: "layer" (k_bits / v_bits per layer and side) | "state" (one
                                 # budget for every layer's components, the parts' costs exact: codec.state_bits)
    k_weight: float = 1.0        # budget "state": the keys' relative errors weigh this much against the values'

    def to_json(self) -> dict:
        return asdict(self)

    def address_json(self) -> dict:
        """What a content address covers: :meth:`to_json` less the fields of :data:`ADDED_FIELDS` at
        their defaults, so a state made with settings that existed before them keeps its address."""
        return {k: v for k, v in self.to_json().items() if ADDED_FIELDS.get(k, _NONE) != v}


_NONE = object()
# fields added after content addresses existed, at the values that mean what states made before them did
ADDED_FIELDS = {"even_groups": False, "budget": "layer", "k_weight": 1.0}


def _pca(k_bits: float, v_bits: float, name: str, **kw) -> CodecSettings:
    return CodecSettings(name=name, k_mode="pca", v_mode="pca", k_bits=k_bits, v_bits=v_bits, **kw)


PRESETS: dict[str, CodecSettings] = {
    "exact": CodecSettings(name="exact", k_mode="raw", v_mode="raw", k_fmt="fp32", v_fmt="fp32"),
    "fp32": CodecSettings(name="fp32", k_mode="raw", v_mode="raw", k_fmt="fp32", v_fmt="fp32"),
    "fp16": CodecSettings(name="fp16", k_mode="raw", v_mode="raw", k_fmt="fp16", v_fmt="fp16"),
    "bf16": CodecSettings(name="bf16", k_mode="raw", v_mode="raw", k_fmt="bf16", v_fmt="bf16"),
    "fp8": CodecSettings(name="fp8", k_mode="raw", v_mode="raw", k_fmt="fp8", v_fmt="fp8"),
    "int8": CodecSettings(name="int8", k_mode="quant", v_mode="quant", k_bits=8, v_bits=8,
                          group_size=64, v_group_size=64),
    "int4": CodecSettings(name="int4", k_mode="quant", v_mode="quant", k_bits=4, v_bits=4,
                          group_size=32, v_group_size=32),
    "int3": CodecSettings(name="int3", k_mode="quant", v_mode="quant", k_bits=3, v_bits=3,
                          group_size=32, v_group_size=32),
    "int2": CodecSettings(name="int2", k_mode="quant", v_mode="quant", k_bits=2, v_bits=2,
                          group_size=32, v_group_size=32),
}

# ratio R -> the PCA codec's bits per element, all bytes counted (16 = raw fp16): k_bits + v_bits
# = 32 / R * RATIO_FILL (a margin for per-layer budgets: short parts cost more headers than
# budgeted; a state-wide budget counts them and takes no margin), of which keys get
# the share below (values are the more sensitive side).  Chosen by benchmarks/codec_sweep.py and
# re-tuned through the whole pipeline (`kite upcycle eval`; docs/compression.md and
# docs/PERFORMANCE.md have the sweeps); shares between tabled ratios interpolate in log-ratio.
RATIO_FILL = 0.99
RATIO_K_SHARE: dict[float, float] = {2.0: 0.375, 4.0: 0.375, 8.0: 0.25, 16.0: 0.3, 32.0: 0.3}
RATIO_DEFAULTS = dict(group_size=512, outliers=0, joint_heads=True, basis_fmt="int6", sink_tokens=1, budget="state",
                      even_groups=True)


# budget "state": the weight of the keys' relative error against the values' (codec.state_bits),
# by ratio, interpolated in log-ratio as the shares are. Chosen with benchmarks' codec_budget
# measurement on documents the held-out set does not hold (MPL-2.0, LGPL-2.1, a contract of seed 7;
# 1,024-token contexts, 2026-12-02): keys weighed 0.5 at 4-8x and 1 at 16-20x gave the lowest
# PPL deltas of 0.5, 0.75, 1 and 2.
RATIO_K_WEIGHT: dict[float, float] = {2.0: 0.5, 4.0: 0.5, 8.0: 0.5, 16.0: 1.0, 32.0: 1.0}


def _by_ratio(table: dict[float, float], ratio: float) -> float:
    pts = sorted(table)
    r = min(max(ratio, pts[0]), pts[-1])
    lo = max(p for p in pts if p <= r)
    hi = min(p for p in pts if p >= r)
    if hi == lo:
        return table[lo]
    w = (math.log(r) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return table[lo] * (1 - w) + table[hi] * w


def _ratio_bits(ratio: float, fill: float = RATIO_FILL) -> tuple[float, float]:
    total = 32.0 / ratio * fill
    share = _by_ratio(RATIO_K_SHARE, ratio)
    return total * share, total * (1 - share)


def at_ratio(s: CodecSettings, ratio: float) -> CodecSettings:
    """``s`` with the bit budgets (and basis format) of PCA ratio ``ratio`` > 1, its other fields kept."""
    # a state-wide budget counts every byte exactly (codec.state_bits): no margin
    kb, vb = _ratio_bits(ratio, 1.0 if s.budget == "state" else RATIO_FILL)
    # a finer basis pays at low ratios, where the coefficients are precise (measured). int5 columns
    # above 12x won on MPL-2.0, LGPL-2.1 and a contract (summed PPL delta 16x 4.75 -> 4.46, 20x
    # 8.40 -> 7.48) and lost on GPL-3 and Apache-2.0 (20x +4.70 -> +5.80, +1.90 -> +2.79; result
    # codec_budget_cpu2_20261202_b510f42.json, 2026-12-02): int6 stays
    basis = "fp16" if ratio <= 2.5 else ("int8" if ratio <= 5 else "int6")
    return replace(s, name=f"ratio={ratio:g}", k_bits=kb, v_bits=vb, basis_fmt=basis,
                   k_weight=round(_by_ratio(RATIO_K_WEIGHT, ratio), 4))


def ratio_of(s: CodecSettings | dict) -> float | None:
    """The PCA ratio R settings were made for (``ratio=R``), None for a preset or custom settings."""
    name = s.get("name", "") if isinstance(s, dict) else s.name
    try:
        return float(name[6:]) if name.startswith("ratio=") else None
    except ValueError:
        return None


def settings_for(spec: str | float | int | CodecSettings | None = None, **overrides) -> CodecSettings:
    """Settings from a name: a preset (``exact``, ``fp16``, ``int4`` ...), ``ratio=R`` or a number R.

    Keyword overrides replace fields (``settings_for("ratio=8", outliers=4)``).
    """
    if isinstance(spec, CodecSettings):
        s = spec
    elif spec is None:
        s = settings_for(4.0)
    elif isinstance(spec, (int, float)):
        ratio = float(spec)
        if not math.isfinite(ratio) or ratio < 1:
            raise ValueError(f"compression ratio must be a finite number >= 1, got {spec}")
        if ratio <= 1.0:
            s = PRESETS["fp16"]
        else:
            s = at_ratio(_pca(4.0, 4.0, name="", **RATIO_DEFAULTS), ratio)
    else:
        text = str(spec).strip().lower()
        if text in PRESETS:
            s = PRESETS[text]
        else:
            t = text[6:] if text.startswith("ratio=") else text.rstrip("x")
            try:
                ratio = float(t)
            except ValueError:
                raise ValueError(f"unknown codec setting {spec!r}: use a ratio (e.g. ratio=8) or one of "
                                 + ", ".join(PRESETS)) from None
            s = settings_for(ratio)
    return replace(s, **overrides) if overrides else s
