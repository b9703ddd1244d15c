"""A part's own bit widths: how a cluster is coded at its label's ratio inside a state of another.

The layer codec allocates bits to the principal components of the whole document (:mod:`.bits`).
A per-label ratio (``compression.label_ratios``, ``kite upcycle retune``) scales what one cluster's
parts cost: a part whose widths ``cap`` were made for ratio ``from_ratio`` gets ``from_ratio / ratio``
of those bytes (coefficients, their group scales, the blob header and the fp16 sinks), spent by the
same greedy allocation, on the variances of *this part's* coefficients on the layer's stored
columns (the basis is the layer's, paid once). So a cluster of a 4× state retuned to 6× costs
two thirds of what it did, and a cluster of a state fitted at 4× coded at 8× half. A part never gets
more bits on a column than ``cap``: a width the stored form never had cannot be recovered.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from kite.upcycle.codec.bits import allocate_bits
from kite.upcycle.codec.blob import LayerCodec
from kite.upcycle.codec.coders import PcaSide, coder
from kite.upcycle.format.bitlayout import group_shape

PART_HEADER_BITS = 8 * 160   # a part blob's header, about (as the layer budget counts it)


def part_cost_bits(widths: torch.Tensor, T: int, group_size: int, n_sinks: int, H: int, d: int,
                   even: bool = False) -> float:
    """What a part of T tokens coded at ``widths`` [R] stores, in bits: each coded column's codes
    and its fp16 scale and minimum per group, the blob header and the fp16 sinks."""
    gs, padded = group_shape(T, group_size, even)
    groups = padded // gs if gs else 0
    w = widths[widths > 0].double()
    return float((w * padded + groups * 32).sum()) + PART_HEADER_BITS + n_sinks * H * d * 16


def part_widths(lc: LayerCodec, side: str, X: torch.Tensor, ratio: float, *, from_ratio: float,
                positions: torch.Tensor | None = None, cap: torch.Tensor | None = None) -> torch.Tensor:
    """Bit widths [R] for the part X [H, T, d] (pre-RoPE keys or values at document ``positions``)
    of a PCA-coded side at ratio ``ratio``, scaled from its cost at widths ``cap`` [R] (default:
    the layer's), which were made for ``from_ratio``."""
    if not (ratio > 1 and from_ratio > 1 and math.isfinite(ratio)):
        raise ValueError(f"ratios must be > 1, got {ratio:g} (from {from_ratio:g})")
    side_coder = coder(lc.meta[side]["mode"])
    if not isinstance(side_coder, PcaSide):
        raise ValueError(f"per-part widths need a PCA side, this one is {lc.meta[side]['mode']}")
    s = lc.settings
    H, T, d = X.shape
    cap = (PcaSide.layer_widths(lc, side) if cap is None else torch.as_tensor(cap)).long().cpu()
    if T == 0 or cap.numel() == 0 or ratio <= from_ratio:
        return cap.clone()
    C = side_coder.coefficients(lc, side, X).cpu()                   # [T, R]
    sinks = torch.zeros(T, dtype=torch.bool)
    if positions is not None and s.sink_tokens > 0:
        sinks = torch.as_tensor(positions).reshape(-1).cpu() < s.sink_tokens
    coded = C[~sinks] if bool((~sinks).any()) else C
    variances = coded.var(dim=0, unbiased=False)[None, :]            # one block of R columns
    n_sinks = int(sinks.sum())
    fixed = PART_HEADER_BITS + n_sinks * H * d * 16
    budget = part_cost_bits(cap, T, s.group_size, n_sinks, H, d, s.even_groups) * from_ratio / ratio - fixed
    # one part of T tokens: its groups are what the allocation's first-bit cost counts
    one_part = replace(s, part_tokens=max(T, 1))
    widths = allocate_bits(variances, budget, T, C.shape[1], one_part, basis_stored=False)[0]
    return torch.minimum(widths, cap)
