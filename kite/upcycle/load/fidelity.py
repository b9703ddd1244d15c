"""How far a load is from what its state was made for: the warnings a load reports.

A state is made (and its compression tuned) for a load of its clusters into every layer of the
model, at the precision it was stored with. Choosing clusters is what states are for; two other
restrictions move a load away from that point, and each gives one warning
(docs/upc-format.md, "Loads far from the state"):

* **layers**: the load goes into fewer than ``FAR_LAYER_SHARE`` of the model's layers. The layers
  left out see the query without the document, and the model's layers no longer agree on what came
  before it: measured by benchmarks/partial_loads.py, leaving out a layer or two costs little, a
  quarter of them most of what the state gave (docs/PERFORMANCE.md, "Loads far from the state").
* **precision**: a lossy load precision (fp8, int8, int4) with fewer bits per value than the state
  holds (a raw state: its float format's; a quantized one: its integer width; a PCA-coded one: its
  bit budget per value, the mean of keys' and values'): the load throws away what the state kept.
"""

from __future__ import annotations

FAR_LAYER_SHARE = 0.9
PRECISION_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}
LOSSY_PRECISIONS = ("fp8", "int8", "int4")


def state_bits(codec: dict) -> float:
    """Bits per stored value of a state's codec section (the mean of the keys' and values' sides)."""
    sides = []
    for side in ("k", "v"):
        if codec.get(f"{side}_mode") == "raw":
            sides.append(PRECISION_BITS.get(codec.get(f"{side}_fmt", "fp16"), 16))
        else:
            sides.append(float(codec.get(f"{side}_bits", 4.0)))
    return sum(sides) / len(sides)


def load_warnings(meta: dict, n_layers: int, layers, precision: str | None) -> list[str]:
    """The warnings for loading the state with header `meta` into `layers` (of `n_layers`) at
    `precision` (None: the state's own). Empty when the load is near what the state was made for."""
    out = []
    k = len(layers)
    if 0 < k < FAR_LAYER_SHARE * n_layers:
        out.append(f"the state goes into {k} of the model's {n_layers} layers: with fewer than "
                   f"{FAR_LAYER_SHARE:.0%}, the layers left out see no document and answers fall toward (or "
                   f"below) those without the state")
    if precision in LOSSY_PRECISIONS:
        have = state_bits(meta.get("codec") or {})
        if PRECISION_BITS[precision] < have:
            out.append(f"precision {precision} ({PRECISION_BITS[precision]} bits) is below the state's own "
                       f"({(meta.get('codec') or {}).get('name', '?')}: {have:.3g} bits per value): the load "
                       f"loses what the state kept")
    return out
