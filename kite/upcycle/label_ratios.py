"""Per-label compression ratios: which clause types a state codes tighter or looser than its ratio.

A map ``{label: ratio}`` (ratio R > 1: the cluster's parts take about 1/R of their raw fp16 KV;
the shared per-layer codec is paid once for the whole state). It is written in the upcycle config
(``compression.label_ratios``: the map itself, or a YAML file of it relative to the config), given
on the command line (``kite upcycle compress --label-ratio LABEL=R``), or made from the health
store by ``kite upcycle retune``, which keeps it in ``label_ratios.yaml`` beside the states.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from kite.errors import BadInput

FILE_NAME = "label_ratios.yaml"


def check_ratios(ratios: dict, where: str) -> dict[str, float]:
    """The map with float ratios; BadInput naming ``where`` for a bad label or a ratio ≤ 1."""
    if not isinstance(ratios, dict):
        raise BadInput(f"{where}: expected a map of clause label → compression ratio, got {type(ratios).__name__}")
    out: dict[str, float] = {}
    for label, r in ratios.items():
        if not isinstance(label, str) or not label.strip():
            raise BadInput(f"{where}: a label must be a non-empty string, got {label!r}")
        try:
            value = float(r)
        except (TypeError, ValueError):
            raise BadInput(f"{where}: {label}: ratio {r!r} is not a number") from None
        if not math.isfinite(value) or value <= 1:
            raise BadInput(f"{where}: {label}: ratio {r!r} must be > 1 (8 = an eighth of raw fp16 KV)")
        out[label] = value
    return out


def read_label_ratios(path: str | Path) -> dict[str, float]:
    """A label-ratio file: YAML ``{label: ratio}`` (``retune`` writes ``{label_ratios: {...}}``
    with its reasons beside; both read)."""
    from kite.yaml_model import read_utf8

    path = Path(path)
    try:
        data = yaml.safe_load(read_utf8(path, "label-ratio file")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise BadInput(f"{path}:{mark.line + 1 if mark else 1}: not YAML ({getattr(exc, 'problem', exc)})") from None
    if isinstance(data, dict) and isinstance(data.get("label_ratios"), dict):
        data = data["label_ratios"]
    return check_ratios(data, str(path))


def parse_label_ratio_flags(flags: list[str] | None) -> dict[str, float]:
    """``["Confidentiality=12", ...]`` → a checked map (``--label-ratio`` flags)."""
    raw = {}
    for flag in flags or []:
        label, sep, value = flag.rpartition("=")
        if not sep or not label.strip():
            raise BadInput(f"--label-ratio {flag!r}: expected LABEL=RATIO (e.g. Confidentiality=12)")
        raw[label.strip()] = value.strip()
    return check_ratios(raw, "--label-ratio")
