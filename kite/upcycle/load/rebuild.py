"""Rebuild staged layers on a device: per layer one host-to-device copy on a copy stream, then per
side (K, V) four launches: dequantize the basis, dequantize the coefficients of every part
(``kite.kernels.load.pca_coefs``), one matmul (bf16 tensor cores on a GPU), and a finish pass
(``pca_finish``: mean, fp16 sinks, RoPE at each token's position, written into the cache rows),
pipelined with the next layer's copy. On a GPU the launches of a layer are captured as a CUDA graph
on the second load into the same buffers and replayed after; on the CPU the torch fallbacks run.
A group of layers coded on one basis (kite.upcycle.codec.groups) is rebuilt as one unit: one product
per side over the group's features, then each asked layer's slice finished into its rows
(:func:`rebuild_group`), one graph per group.
"""

from __future__ import annotations

import torch

from kite.kernels import native
from kite.kernels.load import pca_coefs, pca_finish
from kite.upcycle.load.hot_tier import HotState
from kite.upcycle.load.tables import LayerPlan

GRAPHS_PER_ENTRY = 256


class _Views:
    """Typed views into one layer's region (device or host)."""

    def __init__(self, region: torch.Tensor):
        self.r = region

    def t(self, off: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        return self.r[off:off + n * dtype.itemsize].view(dtype)


def load_staged(hot: HotState, *, device, dtype: torch.dtype, cos: torch.Tensor | None, sin: torch.Tensor | None,
                out: list[tuple[torch.Tensor, torch.Tensor]] | None = None, n_layers: int | None = None,
                compute_dtype: torch.dtype | None = None, staging: torch.Tensor | None = None,
                use_graphs: bool = True) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Rebuild the staged layers on ``device``: per layer (keys [H, T_out, d], values) in ``dtype``.

    ``cos`` / ``sin`` [T_out, d] float32 on ``device``: RoPE at the kept positions (row order).
    ``out``: write into these tensors instead ([H, >= T_out, d] each, rows 0..T_out-1 filled), e.g.
    a static cache's. ``compute_dtype``: coefficient / basis precision of the matmul (default bf16
    on a GPU, float32 elsewhere). ``staging``: a device buffer of >= hot.nbytes to copy into.
    ``use_graphs``: on a GPU, capture each layer's rebuild on the second load into the same buffers
    (kept on ``hot``) and replay it on every later one; a first load runs eagerly. Only with the
    native CUDA library (``make build-runtime``): the torch fallback reads sizes back from the
    device, which a capture forbids, so without it every load runs eagerly.
    Returns lists over layers (None where the layer was not staged).
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    use_graphs = use_graphs and cuda and native.cuda() is not None
    cdt = compute_dtype or (torch.bfloat16 if cuda else torch.float32)
    L = n_layers or len(hot.layers)
    H, d, T = hot.H, hot.d, hot.rows
    T_out = int(hot.positions.numel())
    keys: list[torch.Tensor | None] = [None] * L
    values: list[torch.Tensor | None] = [None] * L
    if cuda:
        if staging is None or staging.numel() < hot.nbytes:
            staging = torch.empty(hot.nbytes, dtype=torch.uint8, device=dev)
        copy_stream = _copy_stream(dev)
        dd = hot.dest_dev.get(dev)
        if dd is None or (dd[0] is not hot.dest and not torch.equal(dd[0], hot.dest)):
            dd = hot.dest_dev[dev] = (hot.dest, hot.dest.to(dev))
        dest = dd[1]
        if use_graphs and len(hot.graphs) > GRAPHS_PER_ENTRY:   # many buffers seen: start again
            torch.cuda.synchronize(dev)
            hot.graphs.clear()
        main = torch.cuda.current_stream(dev)
        copy_stream.wait_stream(main)   # staging may still be read by an earlier load on `main`
    else:
        staging = hot.buffer
        dest = hot.dest
    if out is None:
        alloc = torch.empty(2, L, H, T_out, d, dtype=dtype, device=dev) if L else None
    for layer in range(L):
        plan = hot.wait(layer)
        if plan is None:
            continue
        group = (hot.groups or {}).get(layer)
        region = staging[plan.off:plan.off + plan.size]
        if cuda:
            with torch.cuda.stream(copy_stream):
                region.copy_(hot.buffer[plan.off:plan.off + plan.size], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(copy_stream)
            main.wait_event(ev)
        members = [layer] if group is None else [m for m in range(*group) if m in hot.wanted]
        outs = [(m, *(out[m] if out is not None else (alloc[0, m], alloc[1, m]))) for m in members]
        args = dict(dest=dest, cos=cos, sin=sin, H=H, d=d, rows=T, compute_dtype=cdt)
        if group is None:
            _, k_out, v_out = outs[0]
            rebuild = (lambda r=region, p=plan, k=k_out, v=v_out, a=args: rebuild_layer(r, p, k, v, **a))
        else:
            bases = {side: hot.regenerator.basis_on(layer, side, dev) for side in ("k", "v")} \
                if hot.regenerator is not None else {}
            rebuild = (lambda r=region, p=plan, o=outs, g=group, b=bases, a=args:
                       rebuild_group(r, p, [(m - g[0], k, v) for m, k, v in o], g[1] - g[0], bases=b, **a))
        gkey = (layer, region.data_ptr(), *(t.data_ptr() for _, k, v in outs for t in (k, v)),
                None if cos is None else cos.data_ptr(), cdt)
        if cuda and use_graphs and gkey in hot.graphs:
            # the same launches again for these buffers: replay a captured graph (the eager launches
            # cost more host time per layer than the GPU work). A first load runs eagerly and only
            # marks the buffers: capturing a graph per layer costs more than one load saves.
            g = hot.graphs[gkey]
            if g is None:
                rebuild()     # warm-up (and this load's result)
                g = torch.cuda.CUDAGraph()
                # one memory pool for every rebuild graph: their temporaries die inside the capture
                with torch.cuda.graph(g, pool=_GRAPH_POOLS.get(dev)):
                    rebuild()
                _GRAPH_POOLS.setdefault(dev, g.pool())
                hot.graphs[gkey] = g
            g.replay()
        else:
            if cuda and use_graphs:
                hot.graphs[gkey] = None   # seen once: captured on the next load into these buffers
            rebuild()
        for m, k_out, v_out in outs:
            keys[m], values[m] = k_out, v_out
    return keys, values


def rebuild_layer(region: torch.Tensor, plan: LayerPlan, k_out: torch.Tensor, v_out: torch.Tensor, *,
                  dest: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, H: int, d: int, rows: int,
                  compute_dtype: torch.dtype) -> None:
    """One staged layer (``region``: its bytes, on the output's device) -> keys / values rows."""
    v = _Views(region)
    for side, dst in (("k", k_out), ("v", v_out)):
        sp = plan.sides[side]
        Y = _product(v, sp, rows, compute_dtype, dst.device)
        mean = v.t(sp.mean, torch.float32, H * d)
        ovr = v.t(sp.ovr, torch.int64, 4 * sp.n_ovr).view(-1, 4) if sp.n_ovr else None
        rope = side == "k" and cos is not None
        pca_finish(dst, Y, mean, sp.D, dest=dest, ovr=ovr, ovr_host=sp.ovr_host, base=region,
                   cos=cos if rope else None, sin=sin if rope else None)


def rebuild_group(region: torch.Tensor, plan: LayerPlan, outs: list[tuple[int, torch.Tensor, torch.Tensor]],
                  size: int, *, bases: dict[str, torch.Tensor], dest: torch.Tensor, cos: torch.Tensor | None,
                  sin: torch.Tensor | None, H: int, d: int, rows: int, compute_dtype: torch.dtype) -> None:
    """One staged group of ``size`` layers coded together (kite.upcycle.codec.groups) -> the keys /
    values rows of the member layers ``outs`` ((index in the group, keys, values)): one product per
    side over the group's features, then each member's slice finished into its rows. ``bases``: the
    regenerator's basis of the group per side [1, D, D], on the device."""
    v = _Views(region)
    W = H * d
    for si, side in enumerate(("k", "v")):
        sp = plan.sides[side]
        Y = _product(v, sp, rows, compute_dtype, outs[0][1].device, bases.get(side))      # [T, size*W]
        mean = v.t(sp.mean, torch.float32, size * W)
        per = sp.n_ovr // size                       # each member's sink rows (the tables hold one set each)
        for i, k_out, v_out in outs:
            ovr = v.t(sp.ovr + i * per * 32, torch.int64, 4 * per).view(-1, 4) if per else None
            rope = side == "k" and cos is not None
            pca_finish((k_out, v_out)[si], Y[:, i * W:(i + 1) * W], mean[i * W:(i + 1) * W], W, dest=dest, ovr=ovr,
                       ovr_host=sp.ovr_host[i * per:(i + 1) * per], base=region,
                       cos=cos if rope else None, sin=sin if rope else None)


def _product(v: _Views, sp, T: int, cdt: torch.dtype, dev, regen: torch.Tensor | None = None) -> torch.Tensor:
    """A side's coefficients dequantized and multiplied by its basis: Y [T, D] (one block) or [B, T, D],
    before the mean. ``regen``: the regenerator's basis [1, D, D] on the device, for a side whose
    columns are staged as indices (basis kind ``regen``)."""
    region = v.r
    R, B, D = sp.R, sp.B, sp.D
    P = len(sp.parts_tab_host)
    if sp.basis_kind == "regen":
        Bt = regen[0].index_select(1, v.t(sp.basis[0], torch.int64, R)).t().to(cdt)           # [R, D]
    elif sp.basis_kind == "int":
        btab, bbits, bbitoff, bgoff, btab_host = sp.basis
        Bt = torch.empty(R, D, dtype=cdt, device=dev)
        pca_coefs(region, v.t(btab, torch.int64, 6).view(1, 6), D, v.t(bbits, torch.uint8, R),
                  v.t(bbitoff, torch.int64, R).view(1, R), v.t(bgoff, torch.int64, R).view(1, R), Bt,
                  tab_host=btab_host)
    else:
        off, dt, Dn, Rn = sp.basis
        tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dt]
        Bt = v.t(off, tdt, Dn * Rn).view(Dn, Rn).t().to(cdt)
    Ct = torch.empty(R, T, dtype=cdt, device=dev)
    pca_coefs(region, v.t(sp.parts_tab, torch.int64, 6 * P).view(P, 6), sp.max_T,
              v.t(sp.col_bits, torch.uint8, R), v.t(sp.col_bitoff, torch.int64, P * R).view(P, R),
              v.t(sp.col_goff, torch.int64, P * R).view(P, R), Ct, tab_host=sp.parts_tab_host)
    if B == 1:
        return Ct.t() @ Bt if R else torch.zeros(T, D, dtype=cdt, device=dev)
    Y = torch.zeros(B, T, D, dtype=cdt, device=dev)
    for b in range(B):
        lo, hi = sp.blk_off[b], sp.blk_off[b + 1]
        if hi > lo:
            torch.mm(Ct[lo:hi].t(), Bt[lo:hi], out=Y[b])
    return Y


_STREAMS: dict = {}
_GRAPH_POOLS: dict = {}


def _copy_stream(dev: torch.device):
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=dev)
    return _STREAMS[key]
