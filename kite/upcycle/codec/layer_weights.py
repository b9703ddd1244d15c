"""Layer weights: how much a relative error in each layer's keys and values costs the model, measured
once per model, so the state-wide bit allocation (:mod:`.state_bits`) spends its bits where they pay.

The allocation minimises the sum over layers and sides of each one's relative squared error. Layers
are not equal: on SmolLM2-135M a layer side made exact in a 16x state lowers the continuation's KL by
anything from nothing to 0.06, and isotropic noise says the opposite of the codec's own error (late
layers feel noise most; early and middle layers' values feel the codec most). So the weights are
measured with the codec's own error at its operating point (:func:`kite.upcycle.weigh.measure_layer_weights`): each calibration
document is coded at ``ratio``, decoded, and each layer side in turn is put back exact; its weight is
the KL it wins divided by the relative squared error it had (KL per unit relative error), averaged
over the documents, floored, raised to ``alpha`` and normalised to a mean of 1.

A state's bytes depend on the weights (its header names their fingerprint, and so does its address);
a state decodes without them (they only move bits between layers). On disk: one JSON file
(``{"format": "kite-layer-weights", "version": 1, "k": [...], "v": [...], "meta": {...}}``).

KITE ships the weights of the embedded model (kite/data/layer_weights/, measured by `kite upcycle
weigh` with its defaults); :func:`shipped_for` finds the file made for a model by its fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kite.errors import BadInput
from kite.model.fingerprint import PREFIX

FORMAT = "kite-layer-weights"
VERSION = 1
ALPHA = 0.75      # the measured KL per unit relative error, to this power (1: the first-order optimum; 0.75
                  # the best of 0.25-1 on documents neither calibrating nor judging, docs/compression.md)
FLOOR = 0.05      # a layer side whose exact values won nothing still gets this share of the mean

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "layer_weights"   # kite/data/layer_weights
OFF = "none"      # what a config or flag names to allocate without weights (no shipped ones either)

__all__ = ["ALPHA", "FLOOR", "OFF", "LayerWeights", "shipped_for"]


@dataclass(frozen=True)
class LayerWeights:
    """Per layer, the weight of its keys' and its values' relative error (mean 1 over both)."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        for side, w in (("k", self.k), ("v", self.v)):
            if not w or not all(isinstance(x, (int, float)) and x > 0 and x == x and x != float("inf") for x in w):
                raise BadInput(f"layer weights: {side} must be positive numbers, one per layer")
        if len(self.k) != len(self.v):
            raise BadInput(f"layer weights: {len(self.k)} key weights but {len(self.v)} value weights")

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def fingerprint(self) -> str:
        """``kite-fp1:`` + sha256 of the canonical weights (what a state and its address name)."""
        body = json.dumps({"k": list(self.k), "v": list(self.v)}, separators=(",", ":"))
        return PREFIX + hashlib.sha256(body.encode()).hexdigest()

    def side(self, side: str) -> torch.Tensor:
        return torch.tensor(self.k if side == "k" else self.v, dtype=torch.float64)

    def check(self, n_layers: int, model_fingerprint: str | None = None) -> None:
        """Refuse weights made for another number of layers or, when they name one, another model."""
        if self.n_layers != n_layers:
            raise BadInput(f"layer weights {self.fingerprint.removeprefix(PREFIX)[:12]} are for {self.n_layers} "
                           f"layers, the model has {n_layers}")
        made_for = self.meta.get("model_fingerprint")
        if made_for and model_fingerprint and made_for != model_fingerprint:
            raise BadInput(f"layer weights {self.fingerprint.removeprefix(PREFIX)[:12]} were measured on another "
                           "model; measure them for this one (`kite upcycle weigh`)")

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "k": list(self.k), "v": list(self.v), "meta": self.meta}

    def save(self, path: str | Path) -> Path:
        from kite.atomic import write_text

        path = Path(path)
        write_text(path, json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "LayerWeights":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise BadInput(f"layer weights {path}: no such file") from None
        except (OSError, ValueError) as e:
            raise BadInput(f"layer weights {path}: not readable JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise BadInput(f"layer weights {path}: not a {FORMAT} file of version {VERSION}")
        try:
            return cls(tuple(float(x) for x in data["k"]), tuple(float(x) for x in data["v"]), dict(data.get("meta") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise BadInput(f"layer weights {path}: {e}") from None


def shipped_for(model_fingerprint: str) -> LayerWeights | None:
    """The weights KITE ships for the model of this fingerprint (its base weights'), or None."""
    for path in sorted(SHIPPED.glob("*.json")):
        weights = LayerWeights.load(path)
        if weights.meta.get("model_fingerprint") == model_fingerprint:
            return weights
    return None
