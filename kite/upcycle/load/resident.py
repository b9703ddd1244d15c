"""A staged state transcoded once, at load, into the resident coded form the coded attention reads
(:class:`kite.kernels.coded_attention.CodedLayer`), instead of rebuilding its layers.

What changes against the staged (bit-packed) form: each coefficient code is unpacked to one byte, or
with per-head bases to half a byte where its column is coded at <= 4 bits (the codec's codes are at
most 8 bits, so nothing is lost: coefficient = min + scale · code with the
codec's own per-group fp16 scale and minimum, kept as float32 tables), rows are laid out part by part
in tiles of ``TILE`` that never straddle a quantization group, a per-head basis is padded to one width,
and rows the codec keeps exactly (sinks, outliers) move to a small raw side cache (keys post-RoPE).
The price is bytes: 8 (or 4) bits per coefficient where the packed form averages the codec's
allocated widths; :attr:`kite.runtime.cache.CodedPrefix.nbytes` counts every byte the form holds on its device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kite.kernels.coded_attention import TILE, CodedLayer
from kite.kernels.load import pca_coefs
from kite.runtime.cache import CodedPrefix
from kite.upcycle.load.hot_tier import HotState
from kite.upcycle.load.tables import LayerPlan, SidePlan

if TYPE_CHECKING:
    from kite.upcycle.load.prefix import LoadReport

COL_ALIGN = 32     # code columns per basis block are padded to this (the kernel's chunk of columns)


def supports(hot: HotState) -> bool:
    """Whether the resident form covers this staged state (bases joint over the heads or one per head,
    groups whole tiles)."""
    try:
        for plan in hot.layers:
            if plan is not None:
                for sp in plan.sides.values():
                    _check(sp, hot.H, hot.d)
        return True
    except ValueError:
        return False


def _check(sp: SidePlan, H: int, d: int) -> None:
    if not (sp.B == 1 and sp.D == H * d) and not (sp.B == H and sp.D == d):
        raise ValueError(f"basis blocks {sp.B} x {sp.D} are neither joint nor per head")
    for row0, T, gs, *_ in sp.parts_tab_host:
        if T > gs and gs % TILE:
            raise ValueError(f"quantization groups of {gs} tokens are not whole tiles of {TILE}")


def _pad(n: int, a: int) -> int:
    return -(-n // a) * a


def build_resident(hot: HotState, *, device, dtype: torch.dtype, cos: torch.Tensor, sin: torch.Tensor,
                   next_position: int | None = None, reader: bool = False, nibbles: bool = False) -> CodedPrefix:
    """Transcode every staged layer of ``hot`` into the resident coded form on ``device``.

    ``dtype``: the bases' precision (bf16 on a GPU; float32 for the exact reference on the CPU).
    ``cos`` / ``sin`` [P, d] float32: RoPE by absolute position (P > the last position), for the
    raw side cache's keys and for the coded attention (kept on the prefix). ``next_position``: where the
    first live token goes (the document's length; default: after the last kept token). ``nibbles``:
    per-head sides keep their columns of <= 4 bits two to a byte (CodedLayer.k_nib / v_nib; read by
    the stream kernel and the torch reference); off by default: on the H200 the stream kernel reads
    the nibble form slower per sequence than the one-byte form gains in sequences per GB
    (docs/PERFORMANCE.md, session 9).
    Raises ValueError for a layout the form does not cover (see :func:`supports`).
    """
    dev = torch.device(device)
    dest = hot.dest.to(dev)
    positions = hot.positions.to(dev)
    row_pos = torch.where(dest >= 0, positions[dest.clamp_min(0)], torch.full_like(dest, -1))
    layers: list[CodedLayer | None] = []
    for layer in range(len(hot.layers)):
        plan = hot.wait(layer)
        layers.append(None if plan is None else _layer(hot, plan, dev, dtype, row_pos, cos.to(dev), sin.to(dev),
                                                       nibbles))
    if next_position is None:
        next_position = int(hot.positions.max()) + 1 if hot.positions.numel() else 0
    return CodedPrefix(layers=layers, positions=hot.positions, next_position=next_position, cos=cos.to(dev),
                       sin=sin.to(dev), reader=reader)


def _layout(sp: SidePlan) -> tuple[list[int], int, list[tuple[int, int]]]:
    """Per part its first resident row; the resident row count; per tile (part, group in part)."""
    starts, tiles, at = [], [], 0
    for p, (row0, T, gs, *_) in enumerate(sp.parts_tab_host):
        starts.append(at)
        n = _pad(T, TILE)
        tiles += [(p, (i * TILE) // gs) for i in range(n // TILE)]
        at += n
    return starts, at, tiles


def _side(region: torch.Tensor, sp: SidePlan, H: int, d: int, dtype: torch.dtype, nibbles: bool = False):
    """One side: (codes uint8 [Tp, Hb*Rb], scale, min float32 [G, Hb*Rb], tile groups, basis [H, Rb, d],
    mean per group [G, H, d], part starts, Nb). ``nibbles`` (per-head bases): each head's columns
    ordered for nibble packing (:func:`_nibble_order`), Nb the nibble bytes a head (0 otherwise)."""
    _check(sp, H, d)
    dev = region.device
    R = sp.R
    bits = region[sp.col_bits:sp.col_bits + R].long()
    P = len(sp.parts_tab_host)
    bitoff = region[sp.col_bitoff:sp.col_bitoff + 8 * P * R].view(torch.int64).view(P, R)
    goff = region[sp.col_goff:sp.col_goff + 8 * P * R].view(torch.int64).view(P, R)
    starts, Tp, tiles = _layout(sp)
    group_rows: dict[tuple[int, int], int] = {}
    for key in tiles:
        group_rows.setdefault(key, len(group_rows))
    codes = torch.zeros(Tp, R, dtype=torch.uint8, device=dev)
    scale = torch.zeros(len(group_rows), R, dtype=torch.float32, device=dev)
    mn = torch.zeros_like(scale)
    c8 = region.long()
    for p, (row0, T, gs, co, so, mo) in enumerate(sp.parts_tab_host):
        if T == 0 or R == 0:
            continue
        t = torch.arange(T, device=dev)
        bitpos = co * 8 + bitoff[p][:, None] + t[None, :] * bits[:, None]            # [R, T] (the codec's layout)
        byte, sh = bitpos >> 3, bitpos & 7
        v = c8[byte] | (c8[(byte + 1).clamp_max(c8.numel() - 1)] << 8)
        codes[starts[p]:starts[p] + T] = ((v >> sh) & ((1 << bits[:, None]) - 1)).T.to(torch.uint8)
        n_groups = -(-T // gs)
        n = int(goff[p].max()) + n_groups
        sc = region[so:so + 2 * n].clone().view(torch.float16).float()
        mi = region[mo:mo + 2 * n].clone().view(torch.float16).float()
        for k in range(n_groups):
            if (p, k) in group_rows:
                scale[group_rows[(p, k)]] = sc[goff[p] + k]
                mn[group_rows[(p, k)]] = mi[goff[p] + k]
    tile_group = torch.tensor([group_rows[key] for key in tiles], dtype=torch.int32, device=dev)
    # the basis [R, D] as the rebuild dequantizes it
    if sp.basis_kind == "int":
        btab, bbits, bbitoff, bgoff, btab_host = sp.basis
        Bt = torch.empty(R, sp.D, dtype=torch.float32, device=dev)
        pca_coefs(region, region[btab:btab + 48].view(torch.int64).view(1, 6), sp.D,
                  region[bbits:bbits + R], region[bbitoff:bbitoff + 8 * R].view(torch.int64).view(1, R),
                  region[bgoff:bgoff + 8 * R].view(torch.int64).view(1, R), Bt, tab_host=btab_host)
    else:
        off, dt, Dn, Rn = sp.basis
        tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dt]
        Bt = region[off:off + Dn * Rn * tdt.itemsize].view(tdt).view(Dn, Rn).t().float()
    mean = region[sp.mean:sp.mean + 4 * H * d].view(torch.float32).view(H, d)
    # columns coded at 0 bits hold their group minimum only: folded into a mean per group, not stored
    zero = bits == 0
    blk = torch.zeros(R, dtype=torch.long, device=dev)
    for b in range(sp.B):
        blk[sp.blk_off[b]:sp.blk_off[b + 1]] = b
    Y0 = torch.zeros(scale.shape[0], sp.B, sp.D, device=dev)
    if bool(zero.any()):
        for b in range(sp.B):
            cz = zero & (blk == b)
            Y0[:, b] = mn[:, cz] @ Bt[cz]
    gmean = (Y0.reshape(-1, H, d) + mean[None]).contiguous()                         # [G, H, d]
    live = ~zero
    if sp.B == 1:       # joint: every head reads all live columns, its own d dims of the basis
        Rl = int(live.sum())
        Rb = _pad(max(Rl, 1), COL_ALIGN)
        pad = Rb - Rl
        codes = torch.nn.functional.pad(codes[:, live], (0, pad))
        scale, mn = torch.nn.functional.pad(scale[:, live], (0, pad)), torch.nn.functional.pad(mn[:, live], (0, pad))
        basis = torch.nn.functional.pad(Bt[live], (0, 0, 0, pad)).view(Rb, H, d).permute(1, 0, 2)
        nb = 0
    else:               # a basis per head: its live columns of blk_off[h]..blk_off[h+1], padded to one width
        per = [torch.nonzero(live & (blk == h)).flatten() for h in range(H)]
        if nibbles:
            per, nb = _nibble_order(per, bits)
            Rb = max(max(len(c) for c in per), 1)
        else:
            nb = 0
            Rb = _pad(max(max(len(c) for c in per), 1), COL_ALIGN)
        cols = torch.full((H, Rb), -1, dtype=torch.long, device=dev)
        for h in range(H):
            cols[h, :len(per[h])] = per[h]
        cols = cols.flatten()
        keep = cols >= 0
        src = cols.clamp_min(0)

        def gather(x):
            return torch.where(keep, x[:, src], torch.zeros((), dtype=x.dtype, device=dev))
        codes, scale, mn = gather(codes), gather(scale), gather(mn)
        basis = torch.where(keep[:, None], Bt[src], torch.zeros((), device=dev)).view(H, Rb, d)
    mean = gmean
    return codes.contiguous(), scale, mn, tile_group, basis.to(dtype).contiguous(), mean, starts, nb


def _nibble_order(per: list[torch.Tensor], bits: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """Each head's live columns reordered [Nb low nibbles | Nb high nibbles | the rest], Nb the same
    for every head (the kernel's layout): as many columns of <= 4 bits in nibbles as every head has
    (Nb = min over heads of half its narrow columns); the rest (wider columns, a head's extra narrow
    ones) one byte each, -1 padding a head to the longest."""
    narrow = [c[bits[c] <= 4] for c in per]
    nb = min(len(c) for c in narrow) // 2
    out = []
    for c, n in zip(per, narrow):
        rest = c[~torch.isin(c, n[:2 * nb])]
        out.append(torch.cat((n[:2 * nb], rest)))
    return out, nb


def pack_nibbles(codes: torch.Tensor, H: int, nb: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Codes [Tp, H*R] in the nibble order to (nibble bytes [Tp, H*nb] or None, byte columns [Tp, H*(R-2nb)])."""
    if nb == 0:
        return None, codes
    Tp = codes.shape[0]
    c = codes.view(Tp, H, -1)
    nib = (c[:, :, :nb] | (c[:, :, nb:2 * nb] << 4)).reshape(Tp, H * nb).contiguous()
    return nib, c[:, :, 2 * nb:].reshape(Tp, -1).contiguous()


def _decode_rows(codes, scale, mn, tile_group, basis, mean, joint: bool, rows: torch.Tensor) -> torch.Tensor:
    """Rows of the resident form decoded back to vectors [H, n, d] float32 (pre-RoPE for keys)."""
    H, Rb, d = basis.shape
    g = tile_group.long()[rows // TILE]
    c = mn[g] + scale[g] * codes[rows].float()                                        # [n, Hb*Rb]
    out = []
    for h in range(H):
        ch = c if joint else c[:, h * Rb:(h + 1) * Rb]
        out.append(ch @ basis[h].float() + mean[g, h])
    return torch.stack(out)


def _layer(hot: HotState, plan: LayerPlan, dev, dtype, row_pos, cos, sin, nibbles: bool = False) -> CodedLayer:
    region = hot.buffer[plan.off:plan.off + plan.size].to(dev)
    H, d = hot.H, hot.d
    sides = {s: _side(region, plan.sides[s], H, d, dtype, nibbles) for s in ("k", "v")}
    if sides["k"][6] != sides["v"][6]:
        raise ValueError("keys and values are laid out in different parts")
    starts = sides["k"][6]
    if not torch.equal(sides["k"][3], sides["v"][3]):
        raise ValueError("keys and values are quantized in different groups")
    sp = plan.sides["k"]
    Tp = sides["k"][0].shape[0]
    pos = torch.full((Tp,), -1, dtype=torch.int64, device=dev)
    res_row = torch.full((hot.rows,), -1, dtype=torch.int64)          # token row -> resident row
    for p, (row0, T, *_) in enumerate(sp.parts_tab_host):
        pos[starts[p]:starts[p] + T] = row_pos[row0:row0 + T]
        res_row[row0:row0 + T] = torch.arange(starts[p], starts[p] + T)
    # rows the codec keeps exactly: out of the coded rows, into the raw side cache (K and V of each)
    exact: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}}
    for s in ("k", "v"):
        for t, off, n, k in plan.sides[s].ovr_host:
            exact[s][int(t)] = region[off:off + 2 * H * n * d].clone().view(torch.float16).view(H, n, d)[:, k].float()
    toks = sorted(t for t in set(exact["k"]) | set(exact["v"]) if int(row_pos[t]) >= 0)
    raw = {}
    for s in ("k", "v"):
        codes, scale, mn, tg, basis, mean, _, _ = sides[s]
        rows = [exact[s][t] if t in exact[s] else
                _decode_rows(codes, scale, mn, tg, basis, mean, plan.sides[s].B == 1,
                             res_row[t:t + 1].to(dev))[:, 0] for t in toks]
        raw[s] = torch.stack(rows, 1) if rows else torch.zeros(H, 0, d, device=dev)
    tp = row_pos[toks].long() if toks else torch.zeros(0, dtype=torch.long, device=dev)
    half = d // 2
    c, s_ = cos[tp].float(), sin[tp].float()
    raw_k = raw["k"] * c + torch.cat((-raw["k"][..., half:], raw["k"][..., :half]), -1) * s_
    for t in set(exact["k"]) | set(exact["v"]):
        pos[int(res_row[t])] = -1
    raw_dtype = dtype if dtype != torch.float32 else torch.float32
    k_nib, k_codes = pack_nibbles(sides["k"][0], H, sides["k"][7])
    v_nib, v_codes = pack_nibbles(sides["v"][0], H, sides["v"][7])
    return CodedLayer(pos=pos.to(torch.int32), tile_group=sides["k"][3], k_codes=k_codes, k_scale=sides["k"][1],
                      k_min=sides["k"][2], v_codes=v_codes, v_scale=sides["v"][1], v_min=sides["v"][2],
                      k_basis=sides["k"][4], v_basis=sides["v"][4], k_mean=sides["k"][5], v_mean=sides["v"][5],
                      raw_k=raw_k.to(raw_dtype).contiguous(), raw_v=raw["v"].to(raw_dtype).contiguous(),
                      joint=plan.sides["k"].B == 1, k_nib=k_nib, v_nib=v_nib)


def load_coded_prefix(state, lm, *, clusters: list[str] | None = None, verify: bool = True,
                      sink_tokens: int | None = None, tier=None) -> CodedPrefix:
    """The chosen clusters of ``state`` (every layer) resident in coded form on the model's device: the
    coded-attention counterpart of ``load_prefix`` (fingerprints and geometry checked the same way).
    Bases in bf16 on a GPU (the kernel's), float32 on the CPU (the torch reference's). Raises BadInput
    for a state the form does not cover (not PCA-coded, per-label widths, a regenerator's bases)."""
    return load_resident(state, lm, clusters=clusters, verify=verify, sink_tokens=sink_tokens, tier=tier)[0]


def load_resident(state, lm, *, clusters: list[str] | None = None, layers: list[int] | None = None,
                  precision: str | None = None, verify: bool = True, sink_tokens: int | None = None,
                  tier=None) -> tuple[CodedPrefix, LoadReport]:
    """``load_coded_prefix`` with ``load_prefix``'s arguments and its report (``resident`` "coded",
    ``resident_bytes`` the coded form's bytes on its device). The coded form holds every layer at the
    state's own precision: ``layers`` other than all of them, or any ``precision``, is BadInput saying
    so, as is a state the form does not cover; the caller then loads with ``load_prefix``."""
    import time

    from kite.errors import BadInput
    from kite.upcycle.format.container import StateFile
    from kite.upcycle.load.hot_tier import default_tier
    from kite.upcycle.load.prefix import check_fingerprints, check_geometry, load_report
    from kite.upcycle.load.selection import SINK_TOKENS, select
    from kite.upcycle.load.staging import stage_state, supports_state
    from kite.upcycle.rope import rope_cos_sin

    t0 = time.perf_counter()
    if not isinstance(state, StateFile):
        state = StateFile(state)
    geo = lm.geometry
    all_layers = list(range(geo.n_layers))
    if layers is not None and sorted(set(layers)) != all_layers:
        raise BadInput(f"the coded form holds every layer; this load asks for {len(set(layers))} of {geo.n_layers}")
    if precision is not None:
        raise BadInput(f"the coded form holds the state at its own precision; this load asks for {precision}")
    check_fingerprints(state, lm)
    check_geometry(state, lm)
    if not supports_state(state) or (state.meta.get("regenerator") or {}).get("fingerprint"):
        raise BadInput(f"{state.path}: the coded attention reads PCA-coded states at their layers' widths "
                       "without a regenerator; load this one with load_prefix")
    sink_tokens = SINK_TOKENS if sink_tokens is None else sink_tokens
    sel = select(state, clusters, sink_tokens)
    tier = tier or default_tier()
    key = (state.version, tuple(sel.chosen), sink_tokens, tuple(all_layers))
    hot = tier.get(key)
    hit = hot is not None
    if not hit:
        hot = stage_state(state, sel.parts, sel.part_positions, all_layers, n_layers=geo.n_layers, H=geo.n_kv_heads,
                          d=geo.head_dim, verify=verify, tier=tier, key=key, wait=True)
        tier.put(hot)
    t_staged = time.perf_counter()
    if not supports(hot):
        raise BadInput(f"{state.path}: its quantization groups do not fall on whole tiles of {TILE} tokens; "
                       "load it with load_prefix")
    n_tokens = int(state.meta["n_tokens"])
    dev = torch.device(lm.device)
    cos, sin = rope_cos_sin(lm.model, torch.arange(n_tokens), device=dev)
    made_for = (state.meta.get("fingerprints") or {}).get("adapter")
    prefix = build_resident(hot, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
                            cos=cos, sin=sin, next_position=n_tokens,
                            reader=made_for is not None and made_for == lm.fingerprints.adapter)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    timings = {"stage": round((t_staged - t0) * 1e3, 3), "hot_tier_hit": float(hit),
               "transcode": round((time.perf_counter() - t_staged) * 1e3, 3)}
    return prefix, load_report(state, geo.n_layers, sel, all_layers, None, bytes_read=0 if hit else hot.bytes_read,
                               t0=t0, timings=timings, resident="coded", resident_bytes=prefix.nbytes)
