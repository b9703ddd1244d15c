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

import torch

from kite.errors import BadInput
from kite.upcycle.codec.blob import EncodedPart, LayerCodec
from kite.upcycle.codec.coders import attach_regenerator, blocks, coder
from kite.upcycle.codec.layer import state_budgeted
from kite.upcycle.codec.settings import CodecSettings, settings_for
from kite.upcycle.codec.state_bits import allocate_state, container_overhead

__all__ = ["GroupFit", "encode_groups", "fit_groups", "group_blocks", "group_geometry", "split_group"]


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
    part's coefficients taken from the group's projection (none computed again)."""
    pca = coder("rpca")
    ats = [torch.as_tensor(idx, dtype=torch.long).reshape(-1) for idx in token_sets]
    sets_on: dict[torch.device, list[torch.Tensor]] = {}      # the sets on each device, copied there at once
    for fit in fits:
        dev = fit.codec.tensors["k.mean"].device
        if dev not in sets_on:
            sets_on[dev] = list(torch.cat(ats).to(dev).split([len(a) for a in ats])) if ats else []
        for c, (at, on) in enumerate(zip(ats, sets_on[dev])):
            yield fit.lead, c, EncodedPart(
                *(pca.encode(fit.codec, side, fit.blocks[side][:, on], at, coefficients=fit.coefficients[side][on])
                  for side in ("k", "v")))
