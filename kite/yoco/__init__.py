"""YOCO: decide per request, in microseconds, whether to load a state, which of its clusters,
into which layers and at which precision.

Signals (`signals`, `health`, `watermark`, `novelty`) feed a rule set (`rules`: YAML + a Lark
condition language, checked and compiled once) that `engine.decide` runs to a `LoadPlan`.
"""

from __future__ import annotations

from kite.yoco.engine import StateInfo, decide, predict_gain
from kite.yoco.health import HealthStore
from kite.yoco.plan import LoadPlan
from kite.yoco.rules import ActiveRules, RuleSet, RuleSetError, load_rules, parse_rules
from kite.yoco.signals import SIGNAL_FIELDS, HardwareWatermark, Signals
from kite.yoco.watermark import WatermarkReading, WatermarkSampler

# kite.yoco.novelty (NoveltyTracker) imports numpy; import it from there where it is needed.

__all__ = [
    "ActiveRules",
    "HardwareWatermark",
    "HealthStore",
    "LoadPlan",
    "RuleSet",
    "RuleSetError",
    "SIGNAL_FIELDS",
    "Signals",
    "StateInfo",
    "WatermarkReading",
    "WatermarkSampler",
    "decide",
    "load_rules",
    "parse_rules",
    "predict_gain",
]
