"""One point of a sweep as a bench run: its parameters turned into `BenchSettings` (the ratio
flag, the minimum gain, and copies of the upcycle config and the rule file carrying the values
that live there), and the run's figures read back."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

from kite.tune.rule_params import PREFIX, write_variant
from kite.tune.space import BUDGET

# Parameters that live in the upcycle config's `compression:` section.
COMPRESSION_KEYS = ("precision", "cluster_num", "min_span_tokens", "max_span_tokens")
SIZE_KEYS = ("ratio", "upcycle_compression_ratio", "precision")


def point_ratio(params: dict) -> float | None:
    """The `--ratio` a point sets (upcycle_compression_ratio is its fraction kept), or None."""
    if "ratio" in params:
        return float(params["ratio"])
    if "upcycle_compression_ratio" in params:
        return 1.0 / float(params["upcycle_compression_ratio"])
    return None


def upcycle_variant(cfg, cfg_path: Path | None, params: dict, folder: Path) -> Path | None:
    """A copy of the upcycle config with the point's `compression:` values (None when the point
    sets none), written atomically into `folder` and named by its content. Paths in it (adapter,
    regenerator, examples file) are made absolute, so they still name the same files there."""
    import yaml

    from kite.atomic import write_text
    from kite.upcycle import load_upcycle_config

    mine = {k: params[k] for k in COMPRESSION_KEYS if k in params}
    if not mine:
        return None
    data = variant_data(cfg, cfg_path, mine)
    what = ", ".join(f"{k} = {v}" for k, v in sorted(mine.items()))
    source = cfg_path.name if cfg_path else "the default upcycle config"
    text = (f"# {source} with {what} (written by kite tune)\n"
            + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000))
    path = folder / f"{cfg_path.stem if cfg_path else 'upcycle_config'}.{hashlib.sha256(text.encode()).hexdigest()[:8]}.yaml"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_text(path, text)
    load_upcycle_config(path)  # checked like any upcycle config
    return path


def variant_data(cfg, cfg_path: Path | None, compression: dict) -> dict:
    """The upcycle config as data, with `compression` applied and its paths made absolute."""
    data = cfg.model_dump(mode="json")
    data["compression"].update(compression)
    for section, key in (("adapter", "path"), ("semantic_tagging", "examples_file")):
        if data[section].get(key):
            data[section][key] = str(cfg.resolve(data[section][key], cfg_path))
    if data.get("regenerator"):
        data["regenerator"] = str(cfg.resolve(data["regenerator"], cfg_path))
    return data


def bench_settings(base, params: dict, cfg, cfg_path: Path | None, rules_path: Path, folder: Path, output: Path):
    """The bench run of one point: `base` (kite.bench.runner.BenchSettings) with the point's values applied. A point that sets a
    state's size (ratio, fraction or precision) sets it alone: the KITE config's
    features.upcycle_compression_ratio, which would otherwise win over a precision, is left out."""
    ratio = point_ratio(params)
    sized = any(k in params for k in SIZE_KEYS)
    ucfg = upcycle_variant(cfg, cfg_path, params, folder / "upcycle")
    rules = (write_variant(rules_path, params, folder / "rules")
             if any(k.startswith(PREFIX) for k in params) else rules_path)
    budget = params.get(BUDGET)
    return replace(base, output=str(output), ratio=ratio if ratio is not None else base.ratio,
                   kv_budget_tokens=int(budget) if budget is not None else base.kv_budget_tokens,
                   kept_fraction=None if sized else base.kept_fraction,
                   upcycle_config=str(ucfg) if ucfg else base.upcycle_config, rules=str(rules),
                   min_hit_gain=float(params.get("yoco_min_hit_gain", base.min_hit_gain)))
