"""The GPU decode kernel of attention from the coded form (Triton): one query token per sequence, many
sequences per launch, each with its own resident layer (``kite.kernels.coded_attention.CodedLayer``:
pointers gathered into one table), its own length and its own basis.

One program per (KV head, sequence, split of the sequence's tiles). Per tile of TILE rows it loads the
key codes chunk by chunk (COLS columns), dequantizes them with the tile's group scales, multiplies by
the head's basis on tensor cores (bf16, fp32 accumulation) into the two RoPE halves, adds the mean,
rotates them at each row's position (cos / sin tables by absolute position), scores all query heads
of the KV head against the tile at once, and accumulates softmax(scores) · value codes in coefficient
space; at the end the coefficient sums are projected by the value basis. The splits' (output, lse)
are merged with the raw side cache and the live tokens by ``kite.kernels.coded_attention.merge``.
Three variants: one tile a step, the wide kernel (several tiles a step, any basis width) and the
stream kernel (bases of <= 128 columns a head, blocks inside one quantization group, fp16 operands,
nibble-packed codes too; the default where the bases fit; :mod:`kite.kernels.coded_stream_triton`).
What they share is in :mod:`kite.kernels.coded_triton_common`; :func:`coded_decode` picks one. The
session-8 head kernel (the basis held on chip, blocks straddling groups) was removed in session 9:
the stream kernel covers every per-head batch (a block shrinks to one tile, which never straddles a
group) at 0.47x its time on the H200 (docs/PERFORMANCE.md, session 9b). The stream kernel is told its
tables' alignment (``CodedBatch.alignment``): without it the compiler, which cannot see through the
pointer table, loads every code as its own byte. ``keys="coef"`` (session 10; not the decode path's
default: today's states code their keys before RoPE) runs the stream kernel with keys coded after
RoPE, scored in coefficient space (no key rebuilt, no rotation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kite.kernels.coded_layer import TILE, CodedLayer, check_keys
from kite.kernels.coded_stream_triton import _coded_decode_stream_kernel
from kite.kernels.coded_triton_common import LOG2E, _program, _query_halves, _sequence, _share


@triton.jit
def _coded_decode_kernel(q_ptr, ptrs, ints, cos_ptr, sin_ptr, o_ptr, lse_ptr, qk_scale,
                         H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                         HALF: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr,
                         COLS: tl.constexpr, RVP: tl.constexpr, SPLITS: tl.constexpr,
                         DO_K: tl.constexpr = True, DO_V: tl.constexpr = True):
    h, n, split = _program(SPLITS)
    (kc_p, ks_p, km_p, vc_p, vs_p, vm_p, tg_p, pos_p, kb_p, vb_p, kmu_p, vmu_p,
     n_tiles, Ck, Cv, Rk, Rv, colk, colv) = _sequence(ptrs, ints, n, h)
    t_lo, t_hi = _share(n_tiles, split, SPLITS)

    g = tl.arange(0, GP)
    gm = g < G
    j = tl.arange(0, HP)
    jm = j < HALF
    q1, q2 = _query_halves(q_ptr, n, h, H, G, GP, D, HALF, HP)
    dd = tl.arange(0, DP)
    dm = dd < D

    r = tl.arange(0, BT)
    c = tl.arange(0, COLS)
    cv = tl.arange(0, RVP)
    cvm = cv < Rv
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, RVP], tl.float32)
    acc_mu = tl.zeros([GP, DP], tl.float32)     # Σ p_t μ_v,g(t): the value means per group
    for tile in range(t_lo, t_hi):
        rows = tile * BT + r
        p = tl.load(pos_p + rows)
        valid = p >= 0
        grp = tl.load(tg_p + tile)
        k1 = tl.zeros([BT, HP], tl.float32)
        k2 = tl.zeros([BT, HP], tl.float32)
        for r0 in range(0, Rk if DO_K else 0, COLS):
            cm = (r0 + c) < Rk
            cols = colk + r0 + c
            code = tl.load(kc_p + rows.to(tl.int64)[:, None] * Ck + cols[None, :], mask=cm[None, :],
                           other=0).to(tl.float32)
            sc = tl.load(ks_p + grp * Ck + cols, mask=cm, other=0.0)
            mn = tl.load(km_p + grp * Ck + cols, mask=cm, other=0.0)
            coef = (mn[None, :] + sc[None, :] * code).to(tl.bfloat16)
            brow = kb_p + (h * Rk + r0 + c)[:, None] * D
            b1 = tl.load(brow + j[None, :], mask=cm[:, None] & jm[None, :], other=0.0)
            b2 = tl.load(brow + HALF + j[None, :], mask=cm[:, None] & jm[None, :], other=0.0)
            k1 = tl.dot(coef, b1, k1)
            k2 = tl.dot(coef, b2, k2)
        mrow = kmu_p + (grp * H + h) * D
        k1 += tl.load(mrow + j, mask=jm, other=0.0)[None, :]
        k2 += tl.load(mrow + HALF + j, mask=jm, other=0.0)[None, :]
        pc = tl.maximum(p, 0)
        cs = tl.load(cos_ptr + pc[:, None] * D + j[None, :], mask=jm[None, :], other=0.0)
        sn = tl.load(sin_ptr + pc[:, None] * D + j[None, :], mask=jm[None, :], other=0.0)
        r1 = (k1 * cs - k2 * sn).to(tl.bfloat16)
        r2 = (k2 * cs + k1 * sn).to(tl.bfloat16)
        s = (tl.dot(q1, tl.trans(r1)) + tl.dot(q2, tl.trans(r2))) * qk_scale    # [GP, BT], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pexp = tl.exp2(s - m_safe[:, None])
        psum = tl.sum(pexp, 1)
        l_i = l_i * alpha + psum
        vmu = tl.load(vmu_p + (grp * H + h) * D + dd, mask=dm, other=0.0)
        acc_mu = acc_mu * alpha[:, None] + psum[:, None] * vmu[None, :]
        if DO_V:
            vcode = tl.load(vc_p + rows.to(tl.int64)[:, None] * Cv + (colv + cv)[None, :], mask=cvm[None, :],
                            other=0).to(tl.float32)
            vsc = tl.load(vs_p + grp * Cv + colv + cv, mask=cvm, other=0.0)
            vmn = tl.load(vm_p + grp * Cv + colv + cv, mask=cvm, other=0.0)
            vcoef = (vmn[None, :] + vsc[None, :] * vcode).to(tl.bfloat16)
            acc = acc * alpha[:, None] + tl.dot(pexp.to(tl.bfloat16), vcoef)
        m_i = m_new
    # project the coefficient sums by the value basis, add the weighted group means
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    coef = (acc / l_safe[:, None]).to(tl.bfloat16)
    vb = tl.load(vb_p + (h * Rv + cv)[:, None] * D + dd[None, :], mask=cvm[:, None] & dm[None, :], other=0.0)
    out = tl.dot(coef, vb) + acc_mu / l_safe[:, None]
    out = tl.where((l_i > 0)[:, None], out, 0.0)
    head = h * G + g
    o_row = o_ptr + ((n * SPLITS + split) * H * G + head)[:, None] * D
    tl.store(o_row + dd[None, :], out, mask=gm[:, None] & dm[None, :])
    lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + (n * SPLITS + split) * H * G + head, lse, mask=gm)


@triton.jit
def _coded_decode_wide_kernel(q_ptr, ptrs, ints, cos_ptr, sin_ptr, o_ptr, lse_ptr, qk_scale,
                              H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                              HALF: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, TL: tl.constexpr,
                              SUB: tl.constexpr, BT: tl.constexpr, COLS: tl.constexpr, RVP: tl.constexpr,
                              SPLITS: tl.constexpr):
    """As _coded_decode_kernel over blocks of SUB tiles (BT = SUB * TL rows) per step: the head's basis
    is read once per block. The tiles of a block may lie in different quantization groups: key scales
    are gathered per row; the value codes enter the product as integers and each tile's scale and
    minimum are applied to its share of the probabilities after it."""
    h, n, split = _program(SPLITS)
    (kc_p, ks_p, km_p, vc_p, vs_p, vm_p, tg_p, pos_p, kb_p, vb_p, kmu_p, vmu_p,
     n_tiles, Ck, Cv, Rk, Rv, colk, colv) = _sequence(ptrs, ints, n, h)
    n_blocks = tl.cdiv(n_tiles, SUB)
    b_lo, b_hi = _share(n_blocks, split, SPLITS)

    g = tl.arange(0, GP)
    gm = g < G
    j = tl.arange(0, HP)
    jm = j < HALF
    q1, q2 = _query_halves(q_ptr, n, h, H, G, GP, D, HALF, HP)
    dd = tl.arange(0, DP)
    dm = dd < D
    r = tl.arange(0, BT)
    sub_of_row = r // TL
    c = tl.arange(0, COLS)
    cv = tl.arange(0, RVP)
    cvm = cv < Rv
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, RVP], tl.float32)
    acc_mu = tl.zeros([GP, DP], tl.float32)
    n_rows = n_tiles * TL
    for blk in range(b_lo, b_hi):
        rows = blk * BT + r
        rm = rows < n_rows
        p = tl.load(pos_p + rows, mask=rm, other=-1)
        valid = p >= 0
        grow = tl.load(tg_p + rows // TL, mask=rm, other=0)                      # group of each row
        k1 = tl.zeros([BT, HP], tl.float32)
        k2 = tl.zeros([BT, HP], tl.float32)
        for r0 in range(0, Rk, COLS):
            cm = (r0 + c) < Rk
            cols = colk + r0 + c
            lm = rm[:, None] & cm[None, :]
            code = tl.load(kc_p + rows.to(tl.int64)[:, None] * Ck + cols[None, :], mask=lm, other=0).to(tl.float32)
            sc = tl.load(ks_p + grow[:, None] * Ck + cols[None, :], mask=lm, other=0.0)
            mn = tl.load(km_p + grow[:, None] * Ck + cols[None, :], mask=lm, other=0.0)
            coef = (mn + sc * code).to(tl.bfloat16)
            brow = kb_p + (h * Rk + r0 + c)[:, None] * D
            b1 = tl.load(brow + j[None, :], mask=cm[:, None] & jm[None, :], other=0.0)
            b2 = tl.load(brow + HALF + j[None, :], mask=cm[:, None] & jm[None, :], other=0.0)
            k1 = tl.dot(coef, b1, k1)
            k2 = tl.dot(coef, b2, k2)
        mrow = kmu_p + (grow[:, None] * H + h) * D
        k1 += tl.load(mrow + j[None, :], mask=rm[:, None] & jm[None, :], other=0.0)
        k2 += tl.load(mrow + HALF + j[None, :], mask=rm[:, None] & jm[None, :], other=0.0)
        pc = tl.maximum(p, 0)
        cs = tl.load(cos_ptr + pc[:, None] * D + j[None, :], mask=jm[None, :], other=0.0)
        sn = tl.load(sin_ptr + pc[:, None] * D + j[None, :], mask=jm[None, :], other=0.0)
        r1 = (k1 * cs - k2 * sn).to(tl.bfloat16)
        r2 = (k2 * cs + k1 * sn).to(tl.bfloat16)
        s = (tl.dot(q1, tl.trans(r1)) + tl.dot(q2, tl.trans(r2))) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pexp = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pexp, 1)
        acc = acc * alpha[:, None]
        acc_mu = acc_mu * alpha[:, None]
        # value codes are integers < 256: exact in bf16
        vcode = tl.load(vc_p + rows.to(tl.int64)[:, None] * Cv + (colv + cv)[None, :], mask=rm[:, None] & cvm[None, :],
                        other=0).to(tl.bfloat16)
        for t in tl.static_range(SUB):
            tile = blk * SUB + t
            gt = tl.load(tg_p + tile, mask=tile < n_tiles, other=0)
            pt_ = tl.where((sub_of_row == t)[None, :], pexp, 0.0)                 # the tile's probabilities
            pst = tl.sum(pt_, 1)
            vsc = tl.load(vs_p + gt * Cv + colv + cv, mask=cvm, other=0.0)
            vmn = tl.load(vm_p + gt * Cv + colv + cv, mask=cvm, other=0.0)
            acc += tl.dot(pt_.to(tl.bfloat16), vcode) * vsc[None, :] + pst[:, None] * vmn[None, :]
            vmu = tl.load(vmu_p + (gt * H + h) * D + dd, mask=dm, other=0.0)
            acc_mu += pst[:, None] * vmu[None, :]
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    coef = (acc / l_safe[:, None]).to(tl.bfloat16)
    vb = tl.load(vb_p + (h * Rv + cv)[:, None] * D + dd[None, :], mask=cvm[:, None] & dm[None, :], other=0.0)
    out = tl.dot(coef, vb) + acc_mu / l_safe[:, None]
    out = tl.where((l_i > 0)[:, None], out, 0.0)
    head = h * G + g
    o_row = o_ptr + ((n * SPLITS + split) * H * G + head)[:, None] * D
    tl.store(o_row + dd[None, :], out, mask=gm[:, None] & dm[None, :])
    lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + (n * SPLITS + split) * H * G + head, lse, mask=gm)


# the per-head kernels by name, for tools that read their compiled variants (registers, spills:
# benchmarks/coded_kernel_speed.py) or compile them ahead (the sm_90a PTX test)
PER_HEAD_KERNELS = {"stream": _coded_decode_stream_kernel}


class CodedBatch:
    """The pointer and size tables of a list of resident layers (one per sequence), built once and
    reused while the batch's sequences stay the same (the layers must stay alive meanwhile)."""

    def __init__(self, layers: list[CodedLayer]):
        dev = layers[0].k_codes.device
        self.layers = layers
        rows, sizes = [], []
        for c in layers:
            if c.k_basis.dtype != torch.bfloat16:
                raise ValueError("the GPU kernel reads bf16 bases")
            kn = c.k_nib if c.k_nib is not None else c.k_codes
            vn = c.v_nib if c.v_nib is not None else c.v_codes
            rows.append([c.k_codes.data_ptr(), c.k_scale.data_ptr(), c.k_min.data_ptr(), c.v_codes.data_ptr(),
                         c.v_scale.data_ptr(), c.v_min.data_ptr(), c.tile_group.data_ptr(), c.pos.data_ptr(),
                         c.k_basis.data_ptr(), c.v_basis.data_ptr(), c.k_mean.data_ptr(), c.v_mean.data_ptr(),
                         kn.data_ptr(), vn.data_ptr()])
            sizes.append([c.rows // TILE, c.k_codes.shape[1], c.v_codes.shape[1], c.k_basis.shape[1],
                          c.v_basis.shape[1], int(c.joint), c.nib_bytes("k"), c.nib_bytes("v")])
        self.ptrs = torch.tensor(rows, dtype=torch.int64, device=dev)
        self.ints = torch.tensor(sizes, dtype=torch.int32, device=dev)
        self.max_rk = max(c.k_basis.shape[1] for c in layers)
        self.max_rv = max(c.v_basis.shape[1] for c in layers)
        # nibble-packed sides: the most nibble bytes / byte columns a head (the stream kernel's widths)
        self.nibbles = any(c.k_nib is not None or c.v_nib is not None for c in layers)
        self.max_nbk = max(c.nib_bytes("k") for c in layers)
        self.max_nbv = max(c.nib_bytes("v") for c in layers)
        self.max_wk = max(c.k_basis.shape[1] - 2 * c.nib_bytes("k") for c in layers)
        self.max_wv = max(c.v_basis.shape[1] - 2 * c.nib_bytes("v") for c in layers)
        self._aligned: dict[int, bool] = {}
        # the largest of 16 / 8 / 4 / 2 / 1 bytes dividing every table address and column count the
        # stream kernel reads (its ALIGN: the compiler then loads the tiles as vectors)
        addrs = [int(a) for row in rows for a in row]
        counts = [int(v) for row in sizes for v in (row[1], row[2], row[3], row[4], row[6], row[7])]
        self.alignment = next(a for a in (16, 8, 4, 2, 1)
                              if all(x % a == 0 for x in addrs) and all(x % a == 0 for x in counts))
        self.max_tiles = max(c.rows // TILE for c in layers)
        # the raw side caches (sinks, outliers) padded into one tensor, attended in the same softmax
        S = max(c.raw_k.shape[1] for c in layers)
        H, d = layers[0].k_mean.shape[1:]
        self.raw_k = torch.zeros(len(layers), H, S, d, dtype=torch.bfloat16, device=dev)
        self.raw_v = torch.zeros_like(self.raw_k)
        self.raw_mask = torch.zeros(len(layers), 1, 1, S, dtype=torch.bool, device=dev)
        for i, c in enumerate(layers):
            n = c.raw_k.shape[1]
            self.raw_k[i, :, :n] = c.raw_k
            self.raw_v[i, :, :n] = c.raw_v
            self.raw_mask[i, ..., :n] = True
        self._half: dict = {}

    def half_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables [P, d] (rotate-half layout: both halves equal) as their first halves in fp16
        [P, d/2] (half the bytes the stream kernel reads per row), made once per pair of tables; tables
        already in that form pass through."""
        if cos.dtype == torch.float16 and cos.shape[-1] * 2 == self.raw_k.shape[-1]:
            return cos, sin
        key = (cos.data_ptr(), sin.data_ptr(), tuple(cos.shape))
        if key not in self._half:   # the source tables are held too: their addresses stay theirs
            h = cos.shape[-1] // 2
            self._half[key] = (cos, sin, cos[:, :h].half().contiguous(), sin[:, :h].half().contiguous())
        return self._half[key][2:]

    def aligned(self, block: int) -> bool:
        """Whether every block of ``block`` tiles of every layer lies inside one quantization group
        (what the stream kernel needs); checked once per block size."""
        if block not in self._aligned:
            ok = True
            for c in self.layers:
                tg = c.tile_group
                pad = (-tg.numel()) % block
                if pad:
                    tg = torch.cat((tg, tg[-1:].expand(pad)))
                tg = tg.view(-1, block)
                ok = ok and bool((tg == tg[:, :1]).all())
            self._aligned[block] = ok
        return self._aligned[block]


def coded_decode(q: torch.Tensor, batch: CodedBatch, cos: torch.Tensor, sin: torch.Tensor, scale: float,
                 splits: int | None = None, cols: int = 32, num_warps: int | None = None,
                 num_stages: int | None = None, do_k: bool = True, do_v: bool = True, block: int | None = None,
                 stream: bool | None = None,
                 f16: bool = True, align: int | None = None,
                 maxnreg: int | None = None, keys: str = "rebuild") -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, d] (one token per sequence) over each sequence's coded rows: (out [N, S, Hq, d], lse
    [N, S, Hq]) float32 per split S of the rows (merge them with ``coded_attention.merge`` over dim 1).
    ``cos`` / ``sin`` [P, d] float32 by absolute position. ``do_k`` / ``do_v`` False leave out the key
    rebuild / the value accumulation (wrong results: for timing where the time goes; one tile per step).

    Kernels. ``stream`` (the default where every basis has <= 128 columns a head, i.e. per-head
    bases; the only one that reads nibble-packed sides): ``block`` tiles a step (default 2, halved
    until every block lies inside one quantization group), no branch in its loop, its loads pipelined
    ``num_stages`` deep, RoPE from fp16 half tables (made once per table and batch). Otherwise
    (``stream`` False, or joint-head bases) ``block`` > 1 (a power of 2; default 4): the wide kernel
    (any basis width), ``block`` tiles a step; ``block`` 1: one tile a step.
    ``f16`` (stream kernel): its products' operands in fp16, codes made exact fp16 by their bits
    (False: bf16 operands through fp32 conversions, the earlier form). ``align`` (stream kernel):
    the alignment promised to the compiler (default ``batch.alignment``; 1: none, the session-9
    form, every code its own byte load); more than ``batch.alignment`` is refused. ``maxnreg``: a
    cap on the stream kernel's registers a thread (None: the compiler's choice).
    ``keys``: "rebuild" (pre-RoPE key codes: keys rebuilt and rotated per tile) or "coef" (post-RoPE
    key codes scored in coefficient space, ``coded_attention.coded_partial_torch``'s switch; the
    stream kernel only, ``cos`` / ``sin`` unread; ``block`` defaults to 4 over one byte a code).
    The defaults are the fastest configurations measured on the H200 (benchmarks/coded_kernel_speed.py)."""
    per_head = batch.max_rk <= 128 and batch.max_rv <= 128 and not any(c.joint for c in batch.layers)
    check_keys(keys)
    if keys == "coef" and (stream is False or not per_head or not (do_k and do_v)):
        raise ValueError("keys in coefficient space are read by the stream kernel only (per-head bases)")
    if not (do_k and do_v):
        block, stream = 1, False      # the timing switches live in the one-tile kernel
    if stream is None:
        stream = per_head
    if batch.nibbles and not stream:
        raise ValueError("nibble-packed codes are read by the stream kernel only")
    if stream and not per_head:
        raise ValueError("the stream kernel takes per-head bases of at most 128 columns")
    N, Hq, d = q.shape
    H = batch.layers[0].k_mean.shape[1]
    G = Hq // H
    half = d // 2
    if stream:   # coef keys over one byte a code: blocks of 4 tiles (H200: 0.68 ms / layer vs 0.92 with 2)
        block = block or (4 if keys == "coef" and not batch.nibbles else 2)
        while block > 1 and not batch.aligned(block):
            block //= 2
    block = block or 4
    num_warps = num_warps or (4 if stream else 8)
    num_stages = num_stages or 2
    if splits is None:   # ~8 waves of programs (a short last wave idles less of the GPU), >= 8 tiles each
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        splits = max(1, min(-(-8 * sms // (N * H)), batch.max_tiles // (8 * block)))
    o = torch.empty(N, splits, Hq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(N, splits, Hq, dtype=torch.float32, device=q.device)

    def pad(n: int) -> int:
        return 0 if n <= 0 else max(16, triton.next_power_of_2(n))
    if stream:
        align = batch.alignment if align is None else align
        if align > batch.alignment:
            raise ValueError(f"the batch's tables are aligned to {batch.alignment} bytes, not {align}")
        cos, sin = batch.half_tables(cos, sin)
        extra = {} if maxnreg is None else {"maxnreg": maxnreg}
        _coded_decode_stream_kernel[(H, N * splits)](
            q.contiguous(), batch.ptrs, batch.ints, cos, sin, cos.stride(0), o, lse, scale * LOG2E,
            H=H, G=G, GP=max(16, triton.next_power_of_2(G)), D=d, HALF=half,
            HP=max(16, triton.next_power_of_2(half)), DP=max(16, triton.next_power_of_2(d)), TL=TILE, SUB=block,
            BT=block * TILE, NBKP=pad(batch.max_nbk), WKP=pad(batch.max_wk), NBVP=pad(batch.max_nbv),
            WVP=pad(batch.max_wv), SPLITS=splits, F16=f16, ALIGN=align, COEF=keys == "coef", num_warps=num_warps,
            num_stages=num_stages, **extra)
        return o, lse
    if block > 1:
        _coded_decode_wide_kernel[(H, N * splits)](
            q.contiguous(), batch.ptrs, batch.ints, cos, sin, o, lse, scale * LOG2E,
            H=H, G=G, GP=max(16, triton.next_power_of_2(G)), D=d, HALF=half,
            HP=max(16, triton.next_power_of_2(half)), DP=max(16, triton.next_power_of_2(d)), TL=TILE, SUB=block,
            BT=block * TILE, COLS=cols, RVP=max(16, triton.next_power_of_2(batch.max_rv)), SPLITS=splits,
            num_warps=num_warps, num_stages=num_stages)
        return o, lse
    _coded_decode_kernel[(H, N * splits)](
        q.contiguous(), batch.ptrs, batch.ints, cos, sin, o, lse, scale * LOG2E,
        H=H, G=G, GP=max(16, triton.next_power_of_2(G)), D=d, HALF=half, HP=max(16, triton.next_power_of_2(half)),
        DP=max(16, triton.next_power_of_2(d)), BT=TILE, COLS=cols, RVP=max(16, triton.next_power_of_2(batch.max_rv)),
        SPLITS=splits, DO_K=do_k, DO_V=do_v, num_warps=num_warps, num_stages=num_stages)
    return o, lse
