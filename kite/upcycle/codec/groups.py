"""States coded on bases shared across layers: a grouped regenerator's (``kite upcycle train
--layer-group G``, :class:`kite.upcycle.codec.Regenerator`).

A group of ``g`` adjacent layers is coded as one layer of ``g*H*d`` features (each token's keys,
or values, of those layers side by side, heads joint): one layer codec per group -- per side the
document's mean, the layer scales, the bits of each of the regenerator's components -- and one
part per (cluster, group, side) holding the coefficients. The layer codec is an ordinary ``rpca``
one whose geometry is ``H = 1, d = g*H*d`` (:func:`group_geometry`), so the coders, the checks and
the blob format are the per-layer codec's. Its blobs are stored under the group's first layer
(``L{start}``, ``c{c}/L{start}/K``); the state's header lists the groups (``layer_groups``).

The bits are allocated over the whole state at once (:func:`kite.upcycle.codec.state_bits.allocate_state`,
no basis column to pay for), on the document's variance along each calibrated component, in the
regenerator's weighted space (each layer's features over its calibration variance), so that a bit
goes where it removes the most relative error of any layer; the parts are coded from that same
projection (:class:`GroupFit`). Decoding a layer decodes its group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kite.errors import BadInput
from kite.kernels.quant import quantize_plan
from kite.upcycle.codec.blob import Blob, EncodedPart, LayerCodec
from kite.upcycle.codec.coders import PcaSide, attach_regenerator, blocks, coder, set_apart, sinks
from kite.upcycle.codec.layer import state_budgeted
from kite.upcycle.codec.settings import CodecSettings, settings_for
from kite.upcycle.codec.state_bits import allocate_state, container_overhead
from kite.upcycle.format.bitlayout import parts_layout

__all__ = ["GroupFit", "encode_groups", "encode_side", "fit_groups", "group_blocks", "group_geometry", "split_group"]


def group_geometry(group: tuple[int, int], H: int, d: int) -> tuple[int, int]:
    """(H, d) of a group's layer codec: one head of every layer's features side by side."""
    return 1, (group[1] - group[0]) * H * d


def group_blocks(xs: list[torch.Tensor]) -> torch.Tensor:
    """Layers' [H, T, d] -> the group's [1, T, g*H*d] (a token's layers side by side, heads joint)."""
    return torch.cat([blocks(x.float(), True) for x in xs], dim=2)


def split_group(Y: torch.Tensor, H: int, d: int, i: int | None = None) -> list[torch.Tensor] | torch.Tensor:
    """A group's decoded [1, T, g*H*d] -> each layer's [H, T, d] (views); ``i``: its i-th layer's only."""
    T, W = Y.shape[1], H * d
    if i is not None:
        return Y[0, :, i * W:(i + 1) * W].reshape(T, H, d).permute(1, 0, 2)
    return [split_group(Y, H, d, j) for j in range(Y.shape[2] // W)]


@dataclass
class GroupFit:
    """One group's layer codec and what its parts are coded from: the group's keys and values
    [1, T, D] (for the sink rows) and every token's coefficients on each side's stored columns
    [T, R] (the projection the bit allocation measured, reused for the parts)."""

    codec: LayerCodec
    blocks: dict[str, torch.Tensor]
    coefficients: dict[str, torch.Tensor]

    @property
    def lead(self) -> int:
        """The layer the group's blobs are stored under (its first)."""
        return int(self.codec.meta["layers"][0])


def fit_groups(keys_pre: list[torch.Tensor], values: list[torch.Tensor], settings: CodecSettings | str | float,
               token_sets: list[torch.Tensor], regenerator, overhead_bytes: int | None = None) -> list[GroupFit]:
    """One layer codec per group of ``regenerator.layer_groups`` (pre-RoPE keys and values [H, T, d]
    per layer), every component's bits allocated over the whole state's budget, exact for the parts
    ``token_sets``; each codec's regenerator columns attached. ``overhead_bytes``: the container
    header's expected size (the layer scales each (group, side) stores are added here)."""
    s = settings_for(settings)
    if not state_budgeted(s) or not s.joint_heads:
        raise BadInput(f"codec {s.name}: a regenerator with bases across layers codes states at a ratio "
                       f"(PCA keys and values, joint heads, a state-wide budget)")
    groups = regenerator.layer_groups
    if groups[-1][1] != len(keys_pre):
        raise BadInput(f"the regenerator's groups cover {groups[-1][1]} layers, the document has {len(keys_pre)}")
    H, T, d = keys_pre[0].shape
    _, D = group_geometry(groups[0], H, d)
    if any(group_geometry(g, H, d)[1] != D for g in groups):
        raise BadInput("the regenerator's layer groups are not all of one size")
    Xs, projected, bases, evals = {}, {}, {}, {}
    for side, layers in (("k", keys_pre), ("v", values)):
        ev = []
        for a, b in groups:
            Xg = group_blocks(layers[a:b])                                            # [1, T, D]
            U = bases[(a, side)] = regenerator.basis_on(a, side, Xg.device)
            w = regenerator.weights(a)[side].to(Xg.device, torch.float32)
            mean = Xg.mean(dim=1, keepdim=True) if s.center else torch.zeros_like(Xg[:, :1])
            # the mean and weights as the state stores them (fp16): the coefficients the parts hold
            mean = mean.to(torch.float16).float() if s.basis_fmt != "fp32" else mean
            P = ((Xg - mean) * w[:, None, :]).matmul(U)[0]                               # [T, D]
            ev.append(P.pow(2).mean(dim=0, keepdim=True))
            Xs[(a, side)], projected[(a, side)] = Xg, P
        evals[side] = torch.stack(ev)                                                 # [G, 1, D]
    sets = [torch.as_tensor(t).reshape(-1) for t in token_sets]
    if overhead_bytes is None:
        overhead_bytes = container_overhead(len(groups) * (1 + 2 * len(sets)), len(sets))
    # the layer scales each (group, side) stores ({side}.w, fp16) are paid like the header
    bits = allocate_state(evals, s, 1, D, sets, overhead_bytes + 2 * len(groups) * D * 2, basis_stored=False)
    out = []
    for gi, (a, b) in enumerate(groups):
        tensors: dict = {}
        meta: dict = {"settings": s.to_json(), "H": 1, "d": D, "T_fit": T, "layers": [a, b]}
        coefs = {}
        for side in ("k", "v"):
            side_bits = bits[side][gi].cpu()
            coder("rpca").fit(side, Xs[(a, side)], s, tensors, meta, pca=regenerator.side(a, side),
                              weights=regenerator.weights(a)[side], bits=side_bits)
            P = projected.pop((a, side))
            coefs[side] = P[:, torch.nonzero(side_bits.reshape(-1) > 0).flatten().to(P.device)]   # [T, R]
        lc = LayerCodec(tensors=tensors, meta=meta)
        # the columns gathered where the document is (a GPU's copy of the basis is kept there)
        attach_regenerator(lc, {side: bases.pop((a, side)) for side in ("k", "v")})
        out.append(GroupFit(lc, {side: Xs[(a, side)] for side in ("k", "v")}, coefs))
    return out


def encode_groups(fits: list[GroupFit], token_sets: list[torch.Tensor]):
    """Every part of every group (:func:`fit_groups`): yields (group's first layer, cluster,
    :class:`kite.upcycle.codec.EncodedPart`) for the clusters' token indices ``token_sets``, each
    part's coefficients taken from the group's projection (none computed again), each side's parts
    coded together (:func:`encode_side`)."""
    ats = [torch.as_tensor(idx, dtype=torch.long).reshape(-1) for idx in token_sets]
    sets_on: dict[torch.device, list[torch.Tensor]] = {}      # the sets on each device, copied there at once
    for fit in fits:
        dev = fit.codec.tensors["k.mean"].device
        if dev not in sets_on:
            sets_on[dev] = list(torch.cat(ats).to(dev).split([len(a) for a in ats])) if ats else []
        k, v = (encode_side(fit, side, ats, sets_on[dev]) for side in ("k", "v"))
        for c in range(len(ats)):
            yield fit.lead, c, EncodedPart(k[c], v[c])


def encode_side(fit: GroupFit, side: str, ats: list[torch.Tensor], ons: list[torch.Tensor]) -> list[Blob]:
    """One side's part of every cluster (token indices ``ats`` on the host, ``ons`` where the group
    is), as :meth:`kite.upcycle.codec.coders.PcaSide.encode` codes each from the group's projection,
    the same bytes: its sinks (and, with ``outliers``, its most extreme tokens) kept in fp16 with
    their rows set to the mean of the others, then every part's coefficients quantized by one launch
    (:func:`kite.kernels.quant.quantize_plan`) into one buffer, each part's codes a slice of it at
    the layout a lone part has (:func:`kite.upcycle.format.bitlayout.parts_layout`). Nothing here
    waits for the device unless ``outliers`` asks for tokens chosen by their values."""
    lc, s = fit.codec, fit.codec.settings
    X, P = fit.blocks[side], fit.coefficients[side]
    dev = P.device
    colbits = PcaSide.layer_widths(lc, side).cpu()
    blobs, coded = [], []               # coded: (blob, its coefficients [T, R]) of the parts with codes
    for at, on in zip(ats, ons):
        T = int(at.numel())
        tensors: dict[str, torch.Tensor] = {}
        C = P[on].float()                                                        # [T, R] (a copy)
        idx = set_apart(C, sinks(at, s), s.outliers)
        if idx is not None:
            tensors["out.idx"] = idx.to(torch.int32 if T > 32767 else torch.int16)
            tensors["out.x"] = X[:, on[idx], :].float().to(torch.float16).contiguous()          # [1, n, D]
        blob = Blob(tensors, {"T": T})
        blobs.append(blob)
        if T > 0:
            coded.append((blob, C))
    cols = torch.nonzero(colbits > 0).flatten()
    if cols.numel() and coded:
        _quantize_parts(coded, cols, colbits[cols], s, dev)
    return blobs


def _quantize_parts(coded: list, cols: torch.Tensor, row_bits: torch.Tensor, s, dev: torch.device) -> None:
    """The codes, scales and minima of every part of ``coded`` ((blob, coefficients [T, R])), at the
    columns ``cols`` of widths ``row_bits``, by one :func:`quantize_plan`, set in each blob."""
    R = int(cols.numel())
    Ts = [int(C.shape[0]) for _, C in coded]
    bitoff, goff, gs = parts_layout(row_bits.numpy(), Ts, s.group_size, s.even_groups)   # [P, R], [P, R], [P]
    padded = [-(-t // int(g)) * int(g) for t, g in zip(Ts, gs)]
    counts = torch.bincount(row_bits, minlength=s.max_bits + 1).tolist()
    n_bytes = [sum((n * p * w + 7) // 8 for w, n in enumerate(counts)) for p in padded]
    n_scales = [R * (p // int(g)) for p, g in zip(padded, gs)]
    byte0, sc0, col0 = (np.cumsum([0] + x[:-1]) for x in (n_bytes, n_scales, padded))
    groups = torch.tensor([[c, g, int(col0[c]) + g * int(gs[c]), int(gs[c])]
                           for c in range(len(coded)) for g in range(padded[c] // int(gs[c]))], dtype=torch.int64)
    base_bit = torch.from_numpy(bitoff.T + 8 * byte0[None, :])                 # [R, P]: each part from its first byte
    base_sc = torch.from_numpy(goff.T + sc0[None, :])
    # the plan goes to the device in one copy from pinned memory, which does not wait for the device
    plan = torch.cat([cols, row_bits, base_bit.reshape(-1), base_sc.reshape(-1), groups.reshape(-1)])
    if dev.type == "cuda":
        plan = plan.pin_memory().to(dev, non_blocking=True)
    P = len(coded)
    cols_d, bits_d, bb_d, bs_d, groups_d = plan.split([R, R, R * P, R * P, groups.numel()])
    rows = []
    for (_, C), t, p in zip(coded, Ts, padded):
        src = C[:, cols_d].t()                                                 # [R, T]
        rows.append(torch.cat([src, src[:, -1:].expand(-1, p - t)], dim=1) if p > t else src)
    codes, scale, mn = quantize_plan(torch.cat(rows, dim=1).float().contiguous(), bits_d, bb_d.reshape(R, P),
                                     bs_d.reshape(R, P), groups_d.reshape(-1, 4), s.range_mode, sum(n_bytes),
                                     sum(n_scales), whole_bytes=False)
    for c, (blob, _) in enumerate(coded):
        blob.tensors["codes"] = codes[int(byte0[c]):int(byte0[c]) + n_bytes[c]]
        blob.tensors["scale"] = scale[int(sc0[c]):int(sc0[c]) + n_scales[c]]
        blob.tensors["min"] = mn[int(sc0[c]):int(sc0[c]) + n_scales[c]]
