"""`LoadPlan`: what YOCO decided for one request, and why."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """The decision for one request.

    clusters: labels to load, or "all"; empty when `skipped`.
    layers: layer numbers to load into, or None for every layer.
    precision: fp32|fp16|bf16|fp8|int8|int4, or None for the state's own.
    predicted_gain: expected quality gain of this load (same unit as the health store's gains,
      e.g. F1 as a fraction); see `kite.yoco.engine.predict_gain`.
    skipped / skip_reason: nothing is loaded, and why (a skip rule, a label the state lacks, or
      a predicted gain below `yoco_min_hit_gain`).
    """

    clusters: list[str] | Literal["all"]
    layers: list[int] | None
    precision: str | None
    enable_micro_sampling: bool
    matched_rule: str
    reason: str
    predicted_gain: float
    skipped: bool = False
    skip_reason: str | None = None

    @property
    def loads(self) -> bool:
        return not self.skipped

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
