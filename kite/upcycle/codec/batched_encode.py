"""The batched encoder's encode: the coefficients of all (cluster, layer) parts of a state as one
batched matmul per side over the tokens gathered once in part order, each part padded to whole groups
with its last token (per head: over each head's d dims); the attention sinks are replaced by their
part's mean column as the per-layer codec does, padding columns then repeat their part's last one;
one launch per side quantizes every stored row at its own width into the places the plan
(:func:`kite.upcycle.format.bitlayout.runs_plan`) gives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kite.kernels.quant import quantize_plan
from kite.kernels.streams import StageClock, tf32, to_dev
from kite.upcycle.codec.batched_fit import Fitted
from kite.upcycle.codec.settings import CodecSettings
from kite.upcycle.format.bitlayout import RunsPlan, group_shape



@dataclass
class Layout:
    """Where every cluster's tokens sit on the projection's token axis (host-side plan, device indices).

    Cluster c takes ``ng[c]`` groups of ``gs[c]`` columns (gs = the group size, or the cluster's size
    when smaller): its tokens in order, then copies of its last token up to a whole group."""

    forced: list[torch.Tensor]              # per cluster: local rows of its sinks (host)
    perm: torch.Tensor                      # [P] the token of each column (device)
    ng: torch.Tensor                        # [C] groups per row of each cluster (device)
    gs: torch.Tensor                        # [C] group size of each cluster (device)
    groups: torch.Tensor                    # [G, 4] (cluster, group, first column, size) of every group (device)
    whole_bytes: bool                       # every group size a multiple of 8: groups own whole bytes
    pad_dst: torch.Tensor | None            # padding columns and the columns they repeat (device)
    pad_src: torch.Tensor | None
    sink: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]   # c -> (sink tokens, their columns, kept columns)

    @property
    def n_columns(self) -> int:
        return self.perm.numel()


def layout(sets: list[torch.Tensor], s: CodecSettings, dev: torch.device) -> Layout:
    forced = [torch.nonzero(t < s.sink_tokens).flatten() for t in sets]       # per cluster, local rows
    C = len(sets)
    ng, gsz = torch.zeros(C, dtype=torch.long), torch.zeros(C, dtype=torch.long)
    perm, pad_dst, pad_src, groups = [], [], [], []
    sink_h: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    P = 0
    for c, t_set in enumerate(sets):
        Tc = int(t_set.numel())
        if not Tc:
            continue
        gs, padded = group_shape(Tc, s.group_size, s.even_groups)
        ng[c], gsz[c] = padded // gs, gs
        g = torch.arange(padded // gs)
        groups.append(torch.stack([torch.full_like(g, c), g, P + g * gs, torch.full_like(g, gs)], dim=1))
        perm += [t_set, t_set[-1:].expand(padded - Tc)]
        if padded > Tc:
            pad_dst.append(torch.arange(P + Tc, P + padded))
            pad_src.append(torch.full((padded - Tc,), P + Tc - 1, dtype=torch.long))
        f = forced[c]
        if f.numel():
            keep = torch.ones(Tc, dtype=torch.bool)
            keep[f] = False
            sink_h.append((c, t_set[f], f + P, keep.nonzero().flatten() + P))
        P += padded
    flat = [torch.cat(perm) if perm else torch.zeros(0, dtype=torch.long), ng, gsz,
            torch.cat(groups) if groups else torch.zeros(0, 4, dtype=torch.long)]
    if pad_dst:
        flat += [torch.cat(pad_dst), torch.cat(pad_src)]
    for _, pos, cols, kept in sink_h:
        flat += [pos, cols, kept]
    d = to_dev(dev, *flat)   # one asynchronous copy
    k = 6 if pad_dst else 4
    sink = {c: tuple(d[k + 3 * i:k + 3 * i + 3]) for i, (c, *_) in enumerate(sink_h)}
    return Layout(forced=forced, perm=d[0], ng=d[1], gs=d[2], groups=d[3],
                   whole_bytes=all(int(x) % 8 == 0 for x in gsz if x),
                   pad_dst=d[4] if pad_dst else None, pad_src=d[5] if pad_dst else None, sink=sink)


def gather_center(X: torch.Tensor, mean_st: torch.Tensor, lay: Layout, clock: StageClock) -> torch.Tensor:
    """The tokens in part order, each part padded to whole groups (a gather of d-value rows), minus
    the stored mean: [L, P, H*d] for joint heads (interleaved by the gather), else [L, H, P, d]."""
    L, H, T, d = X.shape
    mean16 = mean_st.float()                                                  # [L, B, D]
    if mean_st.shape[1] == 1:
        Xs = X.permute(0, 2, 1, 3).index_select(1, lay.perm).view(L, -1, H * d)
        Xs.sub_(mean16.view(L, 1, H * d))
    else:
        Xs = X.index_select(2, lay.perm)
        Xs.sub_(mean16.view(L, H, 1, d))
    clock.lap("encode: gather + center")
    return Xs


def encode_side(prefix: str, X: torch.Tensor, Xs: torch.Tensor, fit: Fitted, plan: RunsPlan, lay: Layout,
                 s: CodecSettings, clock: StageClock, out_x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Project one side's tokens (Xs from :func:`_gather_center`) on its decoded basis (every part
    at once), replace the sinks' and the padding's coefficients, and quantize every stored row at
    its width in one launch as ``plan`` lays it out: (codes, scale, min) on the device."""
    L, H, T, d = X.shape
    with tf32(X.device):
        if fit.B == 1:   # joint heads: one block of H*d dims
            Y = torch.matmul(fit.basis[:, 0], Xs.transpose(1, 2))            # [L, D, P]
        else:            # per head: a batched matmul per (layer, head) over d dims
            Y = torch.matmul(fit.basis, Xs.transpose(2, 3))                  # [L, H, D, P]
    del Xs
    P = Y.shape[-1]
    Y = Y.reshape(-1, P)                                                       # rows: fit.row_bits
    clock.lap("encode: project")
    # the attention sinks: kept in fp16, their coefficients replaced by their part's mean (as the per-layer codec does)
    for c, (pos, cols, kept) in lay.sink.items():
        out_x[(prefix, c)] = X[:, :, pos, :].to(torch.float16)                # [L, H, n, d]
        if kept.numel():
            Y[:, cols] = Y[:, kept].mean(dim=1, keepdim=True)
    if lay.pad_dst is not None:   # a padding column repeats its part's last coefficient (after the sinks)
        Y[:, lay.pad_dst] = Y[:, lay.pad_src]
    clock.lap("encode: sinks + padding")
    n_rows, G = Y.shape[0], lay.groups.shape[0]
    sizes = plan.sizes((n_rows * P * s.max_bits // 8 + L * lay.ng.numel() * (s.max_bits + 1), n_rows * G))
    out = quantize_plan(Y, fit.row_bits.view(-1), plan.base_bit, plan.base_sc, lay.groups, s.range_mode, *sizes,
                        whole_bytes=lay.whole_bytes)
    clock.lap("encode: quantize")
    return out


def partition(token_sets, T: int) -> list[torch.Tensor]:
    sets = [torch.as_tensor(t, dtype=torch.long).reshape(-1).cpu() for t in token_sets]
    perm = torch.cat(sets) if sets else torch.zeros(0, dtype=torch.long)
    if perm.numel() != T or not torch.equal(torch.sort(perm).values, torch.arange(T)):
        raise ValueError("token_sets must partition the document's tokens")
    return sets
