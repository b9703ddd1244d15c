"""The bit allocation over a whole state's byte budget (``budget="state"``, the ``ratio=R`` presets).

A state at ratio R may store ``1/R`` of the raw fp16 KV, every byte counted. The bytes that do not
depend on the allocation come off first (:func:`fixed_bits`: the container's header, each layer
blob's and part blob's header, the means and bit tables, the fp16 attention sinks); what is left
goes to the principal components of every layer and both sides at once, by the greedy reverse
water-filling of :func:`kite.upcycle.codec.bits.allocate_bits_batched` on their priorities
(:func:`priorities`). Each bit's cost is exact for the state's parts: a component's first bit pays
its codes in every part (each part padded to whole groups), a scale and minimum per group and its
stored basis column; every later bit its codes. The distortion model (variance x the Gaussian
quantizer's relative error at b bits) is convex in b, so the greedy order is the optimal allocation
of the whole budget (what a dynamic programme over layers would find) up to two edges: a first bit
costs more than the later ones (a component's bits are taken in order, bits.allocate_bits_batched's
cummin), and the last increments where the budget runs out.

The per-layer codec (:func:`fit_state`'s callers) and the batched encoder call the same function on
the same numbers, so their allocations are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from kite.upcycle.codec.bits import allocate_bits_batched
from kite.upcycle.codec.settings import CodecSettings
from kite.upcycle.format import codec_blob

# the container's header: the JSON index of every blob (key, offset, lengths, codec, checksum) and
# the state's metadata (fingerprints, geometry, settings, clusters); callers that know better pass
# their own estimate (compress_document does)
# (measured on the embedded model's states of 1,024 tokens in 8 clusters on 2026-12-02: 38-40 KB
# for 510 blobs)
INDEX_ENTRY_BYTES = 72
HEADER_BASE_BYTES = 2500
CLUSTER_BYTES = 300


def container_overhead(n_blobs: int, n_clusters: int = 0) -> int:
    """Bytes the container's header is expected to take for ``n_blobs`` blobs and ``n_clusters``
    clusters (their labels, token ranges, previews)."""
    return HEADER_BASE_BYTES + INDEX_ENTRY_BYTES * n_blobs + CLUSTER_BYTES * n_clusters


def _layer_header_bytes(s: CodecSettings, H: int, d: int, T: int, B: int, D: int, basis: bool = True) -> int:
    meta = {"settings": s.to_json(), "H": H, "d": d, "T_fit": T}
    table = []
    for side in ("k", "v"):
        table.append((f"{side}.mean", "f16", [B, D]))
        if not basis:
            pass
        elif s.basis_fmt.startswith("int"):
            table += [(f"{side}.basis.codes", "u8", [D * D]), (f"{side}.basis.scale", "f16", [D]),
                      (f"{side}.basis.min", "f16", [D])]
            meta[f"{side}.basis"] = {"fmt": s.basis_fmt, "shape": [D, D], "group_size": D, "axis": -2,
                                     "n": D * D, "padded_cols": D}
        else:
            table.append((f"{side}.basis", "f16", [D, D]))
        table.append((f"{side}.bits", "u8", [B, D]))
        meta[side] = {"mode": "pca", "blocks": B, "dim": D, "rank_max": D}
    return codec_blob.PREFIX_BYTES + len(codec_blob.header_bytes(meta, table))


def basis_header_bits(s: CodecSettings, H: int, d: int, B: int, D: int) -> int:
    """Bits a side's stored basis takes in its layer blob's header (its table rows and meta): what a
    side coded on a regenerator's basis does not store, and may spend on its components."""
    return 8 * (_layer_header_bytes(s, H, d, 0, B, D) - _layer_header_bytes(s, H, d, 0, B, D, basis=False)) // 2


def _part_header_bytes(n: int, D: int, n_sinks: int) -> int:
    table = [("codes", "u8", [n * D]), ("scale", "f16", [n]), ("min", "f16", [n])]
    if n_sinks:
        table = [("out.idx", "i16", [n_sinks]), ("out.x", "f16", [1, n_sinks, 1])] + table
    return codec_blob.PREFIX_BYTES + len(codec_blob.header_bytes({"T": n}, table))


def fixed_bits(s: CodecSettings, L: int, H: int, d: int, B: int, D: int, sets: list[torch.Tensor],
               overhead_bytes: int | None = None) -> float:
    """Bits of a state that do not depend on the allocation: per layer its blob's header, each
    side's mean and bit table; per (part, layer, side) the part blob's header, its sinks (fp16 and
    their indices) and about half a byte per width class where its codes end mid-byte; the
    container's header (``overhead_bytes``, default :func:`container_overhead`)."""
    T = sum(int(t.numel()) for t in sets)
    mean_bits = 32 if s.basis_fmt == "fp32" else 16
    per_layer = 8 * _layer_header_bytes(s, H, d, T, B, D) + 2 * B * D * (mean_bits + 8)
    per_part = 0.0
    for t in sets:
        n = int(t.numel())
        if not n:
            continue
        n_sinks = int((t < s.sink_tokens).sum()) if s.sink_tokens > 0 else 0
        per_part += 2 * (8 * _part_header_bytes(n, D, n_sinks) + n_sinks * (H * d * 16 + 16) + 4 * s.max_bits)
    if overhead_bytes is None:
        overhead_bytes = container_overhead(L * (1 + 2 * len(sets)), len(sets))
    return L * (per_layer + per_part) + 8 * overhead_bytes


def state_budget_bits(s: CodecSettings, L: int, H: int, d: int, B: int, D: int, sets: list[torch.Tensor],
                      overhead_bytes: int | None = None) -> float:
    """Bits the components of every layer and side may take: ``k_bits + v_bits`` per (token, head,
    dim) of every layer (the state's whole budget), less :func:`fixed_bits`."""
    T = sum(int(t.numel()) for t in sets)
    return (s.k_bits + s.v_bits) * L * H * T * d - fixed_bits(s, L, H, d, B, D, sets, overhead_bytes)


def priorities(evals: dict[str, torch.Tensor], k_weight: float = 1.0, layer_weights=None) -> dict[str, torch.Tensor]:
    """What the allocation compares, per side [L, B, D]: each component's variance relative to its
    (layer, side)'s total variance, times the (layer, side)'s weight, so that the allocation
    minimises the sum over layers and sides of each one's weighted relative squared error. The
    weight: ``layer_weights``' (:class:`.layer_weights.LayerWeights`, measured per model) when given,
    else 1 for values and ``k_weight`` for keys. Absolute variances starve whole layers whose KV is
    small (measured: PPL deltas several times larger)."""
    out = {}
    for side, ev in evals.items():
        ev = ev.double().clamp_min(0)
        ev = ev / ev.sum(dim=(1, 2), keepdim=True).clamp_min(1e-30)
        if layer_weights is not None:
            out[side] = ev * layer_weights.side(side).to(ev.device)[:, None, None]
        else:
            out[side] = ev * k_weight if side == "k" else ev
    return out


def allocate_state(evals: dict[str, torch.Tensor], s: CodecSettings, H: int, d: int, sets: list[torch.Tensor],
                   overhead_bytes: int | None = None, layer_weights=None,
                   basis_stored: bool = True) -> dict[str, torch.Tensor]:
    """Each component's bits over the whole state: ``evals`` per side [L, B, D] (any device) ->
    int64 bits per side [L, B, D] on the same device. Keys and values share one budget
    (``k_bits + v_bits`` per element; how the settings split it does not matter here).
    ``layer_weights``: each (layer, side)'s weight in :func:`priorities`. ``basis_stored`` False:
    the components are a regenerator's (no basis column to pay for)."""
    sides = list(evals)
    L, B, D = evals[sides[0]].shape
    T = sum(int(t.numel()) for t in sets)
    parts = [int(t.numel()) for t in sets if t.numel()]
    if layer_weights is not None and layer_weights.n_layers != L:
        raise ValueError(f"layer weights for {layer_weights.n_layers} layers, the state has {L}")
    prio = priorities(evals, s.k_weight, layer_weights)
    budget = state_budget_bits(s, L, H, d, B, D, sets, overhead_bytes)
    flat = torch.cat([prio[side].reshape(L * B, D) for side in sides])[None]       # [1, sides*L*B, D]
    bits = allocate_bits_batched(flat, [budget], T, D, s, basis_stored=basis_stored, parts=parts)[0]
    return {side: bits[i * L * B:(i + 1) * L * B].reshape(L, B, D) for i, side in enumerate(sides)}


PASSES = 4            # codings of a state at a ratio, at most: the first, then the budget refilled
TOLERANCE = 0.01      # of the blobs' budget: close enough to stop

Coded = TypeVar("Coded")


def within_budget(code: Callable[[int], Coded], size: Callable[[Coded], int],
                  budget: Callable[[], float] | None) -> Coded:
    """``code(bonus)``, coded again until its blobs take the state's budget within TOLERANCE (at most
    PASSES codings); the coding nearest the budget. ``bonus``: bytes the allocation may spend beyond
    (or, negative, short of) what its own estimate of the fixed bytes leaves. The estimate is exact
    where the components take most of the state (one coding); in a short document at a high ratio,
    parts that get no component store less than it counts, so the size is not linear in the bonus:
    the next bonus adds the miss (``budget()``, called after the first coding, less ``size``) until
    a coding above and one below the budget bracket it, then interpolates between them. A coding
    whose size does not move is the last (the document's floor, or every component at its most
    bits)."""
    coded = code(0)
    limit = budget() if budget is not None else None
    if limit is None:
        return coded
    spent = size(coded)
    best = (abs(limit - spent), coded)
    under: tuple[int, int] | None = (0, spent) if spent <= limit else None     # (bonus, size)
    over: tuple[int, int] | None = (0, spent) if spent > limit else None
    bonus = 0
    for _ in range(PASSES - 1):
        if abs(limit - spent) <= TOLERANCE * limit:
            break
        if under is not None and over is not None and over[1] > under[1]:
            bonus = int(under[0] + (limit - under[1]) * (over[0] - under[0]) / (over[1] - under[1]))
        else:
            bonus += int(limit - spent)
        coded, before = code(bonus), spent
        spent = size(coded)
        if abs(limit - spent) < best[0]:
            best = (abs(limit - spent), coded)
        if spent == before:
            break
        if spent <= limit:
            under = (bonus, spent)
        else:
            over = (bonus, spent)
    return best[1]


__all__ = ["PASSES", "TOLERANCE", "allocate_state", "container_overhead", "fixed_bits", "priorities",
           "state_budget_bits", "within_budget"]
