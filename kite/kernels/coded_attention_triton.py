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
Four variants: one tile a step, the wide kernel (several tiles a step, any basis width), the head
kernel (bases of <= 128 columns a head, kept on chip; blocks may straddle quantization groups) and the
stream kernel (the same bases, blocks inside one group, fp16 operands, nibble-packed codes too; the
default where the bases fit). The stream kernel is told its tables' alignment (``CodedBatch.alignment``):
without it the compiler, which cannot see through the pointer table, loads every code as its own byte.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kite.kernels.coded_layer import TILE, CodedLayer

LOG2E = 1.4426950408889634


@triton.jit
def _sequence(ptrs, ints, n, h):
    """Sequence n's tables (CodedBatch: 14 pointers and 8 ints a sequence) and, for KV head h, the
    first code column of its basis block (0 with a joint-head basis)."""
    pt = ptrs + n * 14
    kc_p = tl.load(pt + 0).to(tl.pointer_type(tl.uint8))
    ks_p = tl.load(pt + 1).to(tl.pointer_type(tl.float32))
    km_p = tl.load(pt + 2).to(tl.pointer_type(tl.float32))
    vc_p = tl.load(pt + 3).to(tl.pointer_type(tl.uint8))
    vs_p = tl.load(pt + 4).to(tl.pointer_type(tl.float32))
    vm_p = tl.load(pt + 5).to(tl.pointer_type(tl.float32))
    tg_p = tl.load(pt + 6).to(tl.pointer_type(tl.int32))
    pos_p = tl.load(pt + 7).to(tl.pointer_type(tl.int32))
    kb_p = tl.load(pt + 8).to(tl.pointer_type(tl.bfloat16))
    vb_p = tl.load(pt + 9).to(tl.pointer_type(tl.bfloat16))
    kmu_p = tl.load(pt + 10).to(tl.pointer_type(tl.float32))
    vmu_p = tl.load(pt + 11).to(tl.pointer_type(tl.float32))
    it = ints + n * 8
    n_tiles = tl.load(it + 0)
    Ck = tl.load(it + 1)        # code columns of a row (keys): Hb * Rk (nibble-packed: the byte columns)
    Cv = tl.load(it + 2)
    Rk = tl.load(it + 3)        # columns per basis block
    Rv = tl.load(it + 4)
    joint = tl.load(it + 5)
    colk = tl.where(joint != 0, 0, h * Rk)
    colv = tl.where(joint != 0, 0, h * Rv)
    return (kc_p, ks_p, km_p, vc_p, vs_p, vm_p, tg_p, pos_p, kb_p, vb_p, kmu_p, vmu_p,
            n_tiles, Ck, Cv, Rk, Rv, colk, colv)


@triton.jit
def _program(SPLITS: tl.constexpr):
    """The program's KV head h, sequence n and split (grid: (H, N * SPLITS))."""
    ns = tl.program_id(1)
    return tl.program_id(0), ns // SPLITS, ns % SPLITS


@triton.jit
def _share(n_items, split, SPLITS: tl.constexpr):
    """Split `split`'s share [lo, hi) of a sequence's n_items (tiles or blocks) cut into SPLITS."""
    per = tl.cdiv(n_items, SPLITS)
    lo = split * per
    return lo, tl.minimum(lo + per, n_items)


@triton.jit
def _query_halves(q_ptr, n, h, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                  HALF: tl.constexpr, HP: tl.constexpr):
    """The G query heads of KV head h of sequence n, as their two RoPE halves [GP, HP] in bf16."""
    g = tl.arange(0, GP)
    j = tl.arange(0, HP)
    m = (g < G)[:, None] & (j < HALF)[None, :]
    qrow = q_ptr + (n * H * G + h * G + g)[:, None] * D
    q1 = tl.load(qrow + j[None, :], mask=m, other=0.0).to(tl.float32).to(tl.bfloat16)
    q2 = tl.load(qrow + HALF + j[None, :], mask=m, other=0.0).to(tl.float32).to(tl.bfloat16)
    return q1, q2


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


@triton.jit
def _coded_decode_head_kernel(q_ptr, ptrs, ints, cos_ptr, sin_ptr, tab_stride, o_ptr, lse_ptr, qk_scale,
                              H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                              HALF: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, TL: tl.constexpr,
                              SUB: tl.constexpr, BT: tl.constexpr, RKP: tl.constexpr, RVP: tl.constexpr,
                              SPLITS: tl.constexpr):
    """As _coded_decode_wide_kernel, for bases of at most RKP (keys) / RVP (values) columns per head
    (per-head bases): the head's key basis is loaded once per program and kept on chip across blocks;
    a block's codes enter one tensor-core product (all columns at once); a block whose tiles share one
    quantization group (most of them) takes its scales and means as one row each, broadcast, and its
    value codes in one product; a block that straddles groups gathers them per row / per tile."""
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
    ck = tl.arange(0, RKP)
    ckm = ck < Rk
    cv = tl.arange(0, RVP)
    cvm = cv < Rv
    # the head's key basis, as the two RoPE halves, held for every block
    brow = kb_p + (h * Rk + ck)[:, None] * D
    b1 = tl.load(brow + j[None, :], mask=ckm[:, None] & jm[None, :], other=0.0)
    b2 = tl.load(brow + HALF + j[None, :], mask=ckm[:, None] & jm[None, :], other=0.0)
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
        g_lo = tl.load(tg_p + blk * SUB)
        g_hi = tl.load(tg_p + tl.minimum(blk * SUB + SUB, n_tiles) - 1)
        one_group = g_lo == g_hi
        lm = rm[:, None] & ckm[None, :]
        code = tl.load(kc_p + rows.to(tl.int64)[:, None] * Ck + (colk + ck)[None, :], mask=lm, other=0).to(tl.float32)
        # (the two branches share no local names but k1 / k2: Triton wants one type per name)
        if one_group:
            sc_g = tl.load(ks_p + g_lo * Ck + colk + ck, mask=ckm, other=0.0)
            mn_g = tl.load(km_p + g_lo * Ck + colk + ck, mask=ckm, other=0.0)
            coef_g = (mn_g[None, :] + sc_g[None, :] * code).to(tl.bfloat16)
            mrow_g = kmu_p + (g_lo * H + h) * D
            k1 = tl.dot(coef_g, b1) + tl.load(mrow_g + j, mask=jm, other=0.0)[None, :]
            k2 = tl.dot(coef_g, b2) + tl.load(mrow_g + HALF + j, mask=jm, other=0.0)[None, :]
        else:
            grow = tl.load(tg_p + rows // TL, mask=rm, other=0)
            sc_r = tl.load(ks_p + grow[:, None] * Ck + (colk + ck)[None, :], mask=lm, other=0.0)
            mn_r = tl.load(km_p + grow[:, None] * Ck + (colk + ck)[None, :], mask=lm, other=0.0)
            coef_r = (mn_r + sc_r * code).to(tl.bfloat16)
            mrow_r = kmu_p + (grow[:, None] * H + h) * D
            k1 = tl.dot(coef_r, b1) + tl.load(mrow_r + j[None, :], mask=rm[:, None] & jm[None, :], other=0.0)
            k2 = tl.dot(coef_r, b2) + tl.load(mrow_r + HALF + j[None, :], mask=rm[:, None] & jm[None, :], other=0.0)
        pc = tl.maximum(p, 0)
        cs = tl.load(cos_ptr + pc[:, None] * tab_stride + j[None, :], mask=jm[None, :], other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + pc[:, None] * tab_stride + j[None, :], mask=jm[None, :], other=0.0).to(tl.float32)
        r1 = (k1 * cs - k2 * sn).to(tl.bfloat16)
        r2 = (k2 * cs + k1 * sn).to(tl.bfloat16)
        s = (tl.dot(q1, tl.trans(r1)) + tl.dot(q2, tl.trans(r2))) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pexp = tl.exp2(s - m_safe[:, None])
        psum = tl.sum(pexp, 1)
        l_i = l_i * alpha + psum
        acc = acc * alpha[:, None]
        acc_mu = acc_mu * alpha[:, None]
        # value codes are integers < 256: exact in bf16
        vcode = tl.load(vc_p + rows.to(tl.int64)[:, None] * Cv + (colv + cv)[None, :], mask=rm[:, None] & cvm[None, :],
                        other=0).to(tl.float32).to(tl.bfloat16)
        if one_group:
            vsc_g = tl.load(vs_p + g_lo * Cv + colv + cv, mask=cvm, other=0.0)
            vmn_g = tl.load(vm_p + g_lo * Cv + colv + cv, mask=cvm, other=0.0)
            vmu_g = tl.load(vmu_p + (g_lo * H + h) * D + dd, mask=dm, other=0.0)
            acc += tl.dot(pexp.to(tl.bfloat16), vcode) * vsc_g[None, :] + psum[:, None] * vmn_g[None, :]
            acc_mu += psum[:, None] * vmu_g[None, :]
        else:
            for t in tl.static_range(SUB):
                tile = blk * SUB + t
                gt = tl.load(tg_p + tile, mask=tile < n_tiles, other=0)
                pt_ = tl.where((sub_of_row == t)[None, :], pexp, 0.0)
                pst = tl.sum(pt_, 1)
                vsc_t = tl.load(vs_p + gt * Cv + colv + cv, mask=cvm, other=0.0)
                vmn_t = tl.load(vm_p + gt * Cv + colv + cv, mask=cvm, other=0.0)
                acc += tl.dot(pt_.to(tl.bfloat16), vcode) * vsc_t[None, :] + pst[:, None] * vmn_t[None, :]
                vmu_t = tl.load(vmu_p + (gt * H + h) * D + dd, mask=dm, other=0.0)
                acc_mu += pst[:, None] * vmu_t[None, :]
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    coef_v = (acc / l_safe[:, None]).to(tl.bfloat16)
    vb = tl.load(vb_p + (h * Rv + cv)[:, None] * D + dd[None, :], mask=cvm[:, None] & dm[None, :], other=0.0)
    out = tl.dot(coef_v, vb) + acc_mu / l_safe[:, None]
    out = tl.where((l_i > 0)[:, None], out, 0.0)
    head = h * G + g
    o_row = o_ptr + ((n * SPLITS + split) * H * G + head)[:, None] * D
    tl.store(o_row + dd[None, :], out, mask=gm[:, None] & dm[None, :])
    lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + (n * SPLITS + split) * H * G + head, lse, mask=gm)


@triton.jit
def _as_f16(code):
    """Integer codes < 1024 as exact fp16 values without a conversion instruction: the bits of
    1024 + code (exponent 2^10, the code in the mantissa), minus 1024."""
    return (code.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _dequant(code, sc_row, mn_row, cols, cm, F16: tl.constexpr):
    """Codes [BT, C] (integers) to coefficients with one group's scale / minimum rows: fp16 (F16;
    the codec's scales and minima are fp16 values) or bf16."""
    sc = tl.load(sc_row + cols, mask=cm, other=0.0)
    mn = tl.load(mn_row + cols, mask=cm, other=0.0)
    if F16:
        return _as_f16(code) * sc.to(tl.float16)[None, :] + mn.to(tl.float16)[None, :]
    else:
        return (code.to(tl.float32) * sc[None, :] + mn[None, :]).to(tl.bfloat16)


@triton.jit
def _basis_halves(kb_p, rows, rm, j, jm, D: tl.constexpr, HALF: tl.constexpr, F16: tl.constexpr):
    """Rows of a basis [R, d] as its two RoPE halves [len(rows), HP] (bf16, or fp16 with F16)."""
    brow = kb_p + rows[:, None] * D
    b1 = tl.load(brow + j[None, :], mask=rm[:, None] & jm[None, :], other=0.0)
    b2 = tl.load(brow + HALF + j[None, :], mask=rm[:, None] & jm[None, :], other=0.0)
    if F16:
        return b1.to(tl.float32).to(tl.float16), b2.to(tl.float32).to(tl.float16)
    else:
        return b1, b2


@triton.jit
def _value_part(accT, codesT, pe, psum, psum_h, alpha, sc_row, mn_row, cols, cm, F16: tl.constexpr):
    """accT [C, GP] (a value part's coefficient sums, transposed) rescaled by alpha and plus this
    block's: (codes^T @ p) * scale + min * sum(p), one quantization group's scale / minimum. F16:
    the codes enter the product as fp16 1024 + code (no conversion instruction), p as fp16; the
    1024 Σp is taken off after, in fp32, with Σp of the same fp16 p (``psum_h``; the fp32 ``psum``
    would leave 1024 x p's fp16 rounding in every term)."""
    sc = tl.load(sc_row + cols, mask=cm, other=0.0)
    mn = tl.load(mn_row + cols, mask=cm, other=0.0)
    if F16:
        biased = (codesT.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
        return (accT * alpha[None, :] + (tl.dot(biased, pe) - 1024.0 * psum_h[None, :]) * sc[:, None]
                + mn[:, None] * psum[None, :])
    else:
        return (accT * alpha[None, :] + tl.dot(codesT.to(tl.float32).to(tl.bfloat16), pe) * sc[:, None]
                + mn[:, None] * psum[None, :])


@triton.jit
def _ptr_a(ptrs, i, ty, A: tl.constexpr):
    """Entry i of a sequence's pointer row as a pointer to ``ty``, told to be A-byte aligned (the
    hint goes on the pointer: on the loaded integer the compiler drops it)."""
    return tl.multiple_of(tl.load(ptrs + i).to(tl.pointer_type(ty)), A)


@triton.jit
def _int_a(ints, i, A: tl.constexpr):
    """Entry i of a sequence's int row, told to be a multiple of A."""
    return tl.multiple_of(tl.load(ints + i), A)


@triton.jit
def _aligned(ptrs, ints, n, A: tl.constexpr):
    """Sequence n's tables as _sequence reads them (per-head bases), with the alignment the stream
    kernel is promised (ALIGN = A): addresses multiples of A bytes, column counts multiples of A."""
    pt = ptrs + n * 14
    it = ints + n * 8
    return (_ptr_a(pt, 0, tl.uint8, A), _ptr_a(pt, 1, tl.float32, A), _ptr_a(pt, 2, tl.float32, A),
            _ptr_a(pt, 3, tl.uint8, A), _ptr_a(pt, 4, tl.float32, A), _ptr_a(pt, 5, tl.float32, A),
            _ptr_a(pt, 7, tl.int32, A), _ptr_a(pt, 8, tl.bfloat16, A), _ptr_a(pt, 9, tl.bfloat16, A),
            _ptr_a(pt, 10, tl.float32, A), _ptr_a(pt, 11, tl.float32, A), _ptr_a(pt, 12, tl.uint8, A),
            _ptr_a(pt, 13, tl.uint8, A),
            _int_a(it, 1, A), _int_a(it, 2, A), _int_a(it, 3, A), _int_a(it, 4, A), _int_a(it, 6, A), _int_a(it, 7, A))


@triton.jit
def _coded_decode_stream_kernel(q_ptr, ptrs, ints, cos_ptr, sin_ptr, tab_stride, o_ptr, lse_ptr, qk_scale,
                                H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                                HALF: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, TL: tl.constexpr,
                                SUB: tl.constexpr, BT: tl.constexpr, NBKP: tl.constexpr, WKP: tl.constexpr,
                                NBVP: tl.constexpr, WVP: tl.constexpr, SPLITS: tl.constexpr,
                                F16: tl.constexpr = True, ALIGN: tl.constexpr = 1):
    """Per-head bases, every block of SUB tiles inside one quantization group (the caller checks),
    so the loop has no branch and its loads pipeline (num_stages). Tokens are the rows of every
    product: keys rebuilt [BT, d/2] x 2 from the codes, scores transposed [BT, GP] (the tile's rows
    against the KV head's query heads), value sums transposed [columns, GP]. Reads nibble-packed sides
    (CodedLayer.k_nib / v_nib: NBKP / NBVP > 0, padded nibble bytes a head) and byte columns (WKP /
    WVP > 0, padded); a side with no nibbles has Nb = 0 and all its columns as bytes. F16: the products'
    operands in fp16 (codes made exact fp16 by their bits, no conversion instruction; coefficients,
    basis, RoPE, q and p in fp16, accumulation fp32); else bf16 operands converted through fp32.
    ALIGN > 1 (``CodedBatch.alignment``, which the caller passes): every table's address a multiple
    of ALIGN bytes and every column count (code columns a row and a head, nibble bytes, basis columns)
    a multiple of ALIGN, told to the compiler, so the code / RoPE / position tiles load as vectors of
    up to 16 bytes and pipeline as asynchronous copies; ALIGN 1 is the session-9 form, where the
    compiler knows no alignment of the tables behind the pointer table and loads every code as its
    own byte, synchronously."""
    h, n, split = _program(SPLITS)
    (kc_p, ks_p, km_p, vc_p, vs_p, vm_p, tg_p, pos_p, kb_p, vb_p, kmu_p, vmu_p,
     n_tiles, Ck, Cv, Rk, Rv, colk, colv) = _sequence(ptrs, ints, n, h)
    kn_p = tl.load(ptrs + n * 14 + 12).to(tl.pointer_type(tl.uint8))
    vn_p = tl.load(ptrs + n * 14 + 13).to(tl.pointer_type(tl.uint8))
    nbk = tl.load(ints + n * 8 + 6)            # nibble bytes a row and head (0: none)
    nbv = tl.load(ints + n * 8 + 7)
    if ALIGN > 1:
        (kc_p, ks_p, km_p, vc_p, vs_p, vm_p, pos_p, kb_p, vb_p, kmu_p, vmu_p, kn_p, vn_p,
         Ck, Cv, Rk, Rv, nbk, nbv) = _aligned(ptrs, ints, n, ALIGN)
        colk = h * Rk
        colv = h * Rv
    wk = Rk - 2 * nbk                          # byte columns a head
    wv = Rv - 2 * nbv
    n_blocks = tl.cdiv(n_tiles, SUB)
    b_lo, b_hi = _share(n_blocks, split, SPLITS)

    g = tl.arange(0, GP)
    gm = g < G
    j = tl.arange(0, HP)
    jm = j < HALF
    q1, q2 = _query_halves(q_ptr, n, h, H, G, GP, D, HALF, HP)
    if F16:
        q1 = q1.to(tl.float32).to(tl.float16)
        q2 = q2.to(tl.float32).to(tl.float16)
    q1t = tl.trans(q1)
    q2t = tl.trans(q2)
    dd = tl.arange(0, DP)
    dm = dd < D
    r = tl.arange(0, BT)
    n_rows = n_tiles * TL
    # the head's key basis, held: rows of the low nibbles, high nibbles, byte columns
    if NBKP > 0:
        ak = tl.arange(0, NBKP)
        akm = ak < nbk
        bl1, bl2 = _basis_halves(kb_p, h * Rk + ak, akm, j, jm, D, HALF, F16)
        bh1, bh2 = _basis_halves(kb_p, h * Rk + nbk + ak, akm, j, jm, D, HALF, F16)
    if WKP > 0:
        ck = tl.arange(0, WKP)
        ckm = ck < wk
        bw1, bw2 = _basis_halves(kb_p, h * Rk + 2 * nbk + ck, ckm, j, jm, D, HALF, F16)
    if NBVP > 0:
        av = tl.arange(0, NBVP)
        avm = av < nbv
        acc_lo = tl.zeros([NBVP, GP], tl.float32)
        acc_hi = tl.zeros([NBVP, GP], tl.float32)
    if WVP > 0:
        cv = tl.arange(0, WVP)
        cvm = cv < wv
        acc_w = tl.zeros([WVP, GP], tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    amuT = tl.zeros([DP, GP], tl.float32)
    sk = H * Rk                                # scale / minimum row length
    sv = H * Rv
    for blk in range(b_lo, b_hi):
        row0 = blk * BT
        rows = row0 + r
        rm = rows < n_rows
        p = tl.load(pos_p + rows, mask=rm, other=-1)
        grp = tl.load(tg_p + blk * SUB)
        mrow = kmu_p + (grp * H + h) * D
        k1 = tl.zeros([BT, HP], tl.float32) + tl.load(mrow + j, mask=jm, other=0.0)[None, :]
        k2 = tl.zeros([BT, HP], tl.float32) + tl.load(mrow + HALF + j, mask=jm, other=0.0)[None, :]
        if NBKP > 0:
            nib = tl.load(kn_p + row0.to(tl.int64) * H * nbk + r[:, None] * (H * nbk) + (h * nbk + ak)[None, :],
                          mask=rm[:, None] & akm[None, :], other=0)
            lo = _dequant(nib & 15, ks_p + grp * sk, km_p + grp * sk, colk + ak, akm, F16)
            k1 = tl.dot(lo, bl1, k1)
            k2 = tl.dot(lo, bl2, k2)
            hi = _dequant(nib >> 4, ks_p + grp * sk, km_p + grp * sk, colk + nbk + ak, akm, F16)
            k1 = tl.dot(hi, bh1, k1)
            k2 = tl.dot(hi, bh2, k2)
        if WKP > 0:
            code = tl.load(kc_p + row0.to(tl.int64) * Ck + r[:, None] * Ck + (h * wk + ck)[None, :],
                           mask=rm[:, None] & ckm[None, :], other=0)
            cw = _dequant(code, ks_p + grp * sk, km_p + grp * sk, colk + 2 * nbk + ck, ckm, F16)
            k1 = tl.dot(cw, bw1, k1)
            k2 = tl.dot(cw, bw2, k2)
        pc = tl.maximum(p, 0)
        cs = tl.load(cos_ptr + pc[:, None] * tab_stride + j[None, :], mask=jm[None, :], other=0.0)
        sn = tl.load(sin_ptr + pc[:, None] * tab_stride + j[None, :], mask=jm[None, :], other=0.0)
        if F16:     # RoPE in fp16 on the fp16 tables
            k1h = k1.to(tl.float16)
            k2h = k2.to(tl.float16)
            r1 = k1h * cs - k2h * sn
            r2 = k2h * cs + k1h * sn
        else:
            cs = cs.to(tl.float32)
            sn = sn.to(tl.float32)
            r1 = (k1 * cs - k2 * sn).to(tl.bfloat16)
            r2 = (k2 * cs + k1 * sn).to(tl.bfloat16)
        sT = (tl.dot(r1, q1t) + tl.dot(r2, q2t)) * qk_scale                      # [BT, GP], log2 units
        sT = tl.where((p >= 0)[:, None], sT, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sT, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pe = tl.exp2(sT - m_safe[None, :])
        psum = tl.sum(pe, 0)
        l_i = l_i * alpha + psum
        if F16:
            pb = pe.to(tl.float16)
            psum_h = tl.sum(pb.to(tl.float32), 0)
        else:
            pb = pe.to(tl.bfloat16)
            psum_h = psum
        if NBVP > 0:
            nibT = tl.load(vn_p + row0.to(tl.int64) * H * nbv + r[None, :] * (H * nbv) + (h * nbv + av)[:, None],
                           mask=avm[:, None] & rm[None, :], other=0)
            acc_lo = _value_part(acc_lo, nibT & 15, pb, psum, psum_h, alpha, vs_p + grp * sv, vm_p + grp * sv, colv + av, avm,
                                 F16)
            acc_hi = _value_part(acc_hi, nibT >> 4, pb, psum, psum_h, alpha, vs_p + grp * sv, vm_p + grp * sv,
                                 colv + nbv + av, avm, F16)
        if WVP > 0:
            codeT = tl.load(vc_p + row0.to(tl.int64) * Cv + r[None, :] * Cv + (h * wv + cv)[:, None],
                            mask=cvm[:, None] & rm[None, :], other=0)
            acc_w = _value_part(acc_w, codeT, pb, psum, psum_h, alpha, vs_p + grp * sv, vm_p + grp * sv,
                                colv + 2 * nbv + cv, cvm, F16)
        vmu = tl.load(vmu_p + (grp * H + h) * D + dd, mask=dm, other=0.0)
        amuT = amuT * alpha[None, :] + vmu[:, None] * psum[None, :]
        m_i = m_new
    # project the coefficient sums by the value basis (transposed: [d, GP]), add the weighted means
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    outT = amuT / l_safe[None, :]
    if NBVP > 0:
        vlo = tl.load(vb_p + (h * Rv + av)[None, :] * D + dd[:, None], mask=avm[None, :] & dm[:, None], other=0.0)
        outT += tl.dot(vlo, (acc_lo / l_safe[None, :]).to(tl.bfloat16))
        vhi = tl.load(vb_p + (h * Rv + nbv + av)[None, :] * D + dd[:, None], mask=avm[None, :] & dm[:, None],
                      other=0.0)
        outT += tl.dot(vhi, (acc_hi / l_safe[None, :]).to(tl.bfloat16))
    if WVP > 0:
        vw = tl.load(vb_p + (h * Rv + 2 * nbv + cv)[None, :] * D + dd[:, None], mask=cvm[None, :] & dm[:, None],
                     other=0.0)
        outT += tl.dot(vw, (acc_w / l_safe[None, :]).to(tl.bfloat16))
    outT = tl.where((l_i > 0)[None, :], outT, 0.0)
    head = h * G + g
    o_col = o_ptr + ((n * SPLITS + split) * H * G + head)[None, :] * D
    tl.store(o_col + dd[:, None], outT, mask=gm[None, :] & dm[:, None])
    lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + (n * SPLITS + split) * H * G + head, lse, mask=gm)


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
        [P, d/2] (half the bytes the head kernel reads per row), made once per pair of tables; tables
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
                 head: bool | None = None, stream: bool | None = None,
                 f16: bool = True, align: int | None = None,
                 maxnreg: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, d] (one token per sequence) over each sequence's coded rows: (out [N, S, Hq, d], lse
    [N, S, Hq]) float32 per split S of the rows (merge them with ``coded_attention.merge`` over dim 1).
    ``cos`` / ``sin`` [P, d] float32 by absolute position. ``do_k`` / ``do_v`` False leave out the key
    rebuild / the value accumulation (wrong results: for timing where the time goes; one tile per step).

    Kernels. ``stream`` (the default where every basis has <= 128 columns a head, i.e. per-head
    bases, unless ``head`` is given; the only one that reads nibble-packed sides): ``block`` tiles a
    step (default 2, halved until every block lies inside one quantization group), no branch in its
    loop, its loads pipelined ``num_stages`` deep. ``head`` True: the session-8 head kernel (the
    basis kept on chip, blocks straddling groups gathered per row). Otherwise ``block`` > 1 (a power
    of 2; default 4): the wide kernel (any basis width), ``block`` tiles a step; ``block`` 1: one tile
    a step. Both per-head kernels take RoPE from fp16 half tables (made once per table and batch).
    ``f16`` (stream kernel): its products' operands in fp16, codes made exact fp16 by their bits
    (False: bf16 operands through fp32 conversions, the earlier form). ``align`` (stream kernel):
    the alignment promised to the compiler (default ``batch.alignment``; 1: none, the session-9
    form, every code its own byte load); more than ``batch.alignment`` is refused. ``maxnreg``: a
    cap on the stream kernel's registers a thread (None: the compiler's choice).
    The defaults are the fastest configurations measured on the H200 (benchmarks/coded_kernel_speed.py)."""
    per_head = batch.max_rk <= 128 and batch.max_rv <= 128 and not any(c.joint for c in batch.layers)
    if not (do_k and do_v):
        block, head, stream = 1, False, False      # the timing switches live in the one-tile kernel
    if stream is None:
        stream = per_head and head is None
    if batch.nibbles and not stream:
        raise ValueError("nibble-packed codes are read by the stream kernel only")
    if (stream or head) and not per_head:
        raise ValueError("the stream and head kernels take per-head bases of at most 128 columns")
    N, Hq, d = q.shape
    H = batch.layers[0].k_mean.shape[1]
    G = Hq // H
    half = d // 2
    if stream:
        block = block or 2
        while block > 1 and not batch.aligned(block):
            block //= 2
    block = block or (2 if head else 4)
    num_warps = num_warps or (4 if head or stream else 8)
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
            WVP=pad(batch.max_wv), SPLITS=splits, F16=f16, ALIGN=align, num_warps=num_warps, num_stages=num_stages,
            **extra)
        return o, lse
    if head and block > 1:
        cos, sin = batch.half_tables(cos, sin)
        _coded_decode_head_kernel[(H, N * splits)](
            q.contiguous(), batch.ptrs, batch.ints, cos, sin, cos.stride(0), o, lse, scale * LOG2E,
            H=H, G=G, GP=max(16, triton.next_power_of_2(G)), D=d, HALF=half,
            HP=max(16, triton.next_power_of_2(half)), DP=max(16, triton.next_power_of_2(d)), TL=TILE, SUB=block,
            BT=block * TILE, RKP=max(16, triton.next_power_of_2(batch.max_rk)),
            RVP=max(16, triton.next_power_of_2(batch.max_rv)), SPLITS=splits, num_warps=num_warps,
            num_stages=num_stages)
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
