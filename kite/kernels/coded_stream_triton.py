"""The stream kernel of attention from the coded form (Triton; the default decode kernel for
per-head bases of <= 128 columns, dispatched by :func:`kite.kernels.coded_attention_triton.coded_decode`):
blocks of tiles inside one quantization group, no branch in its loop, tokens as the rows of every
tensor-core product, fp16 operands with codes made exact fp16 by their bits, nibble-packed sides too,
and its tables' alignment told to the compiler so the code and RoPE tiles load as vectors. COEF: keys
coded after RoPE, scored in coefficient space (no key rebuilt, no rotation, no key basis held)."""

from __future__ import annotations

import triton
import triton.language as tl

from kite.kernels.coded_triton_common import _as_f16, _program, _query_halves, _sequence, _share


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
def _coef_scores(s, codeT, qBT, sc_row, mn_row, cols, cm, F16: tl.constexpr):
    """s [GP, BT] plus the scores of one part of the key columns taken in coefficient space (COEF):
    qBT [GP, C] (q B_part^T, made once per program in the operands' type) @ the coefficients^T [C,
    BT], dequantized as the value side does. Query heads are the rows here: a product of GP < 64
    rows is not a Hopper wgmma (the tokens-as-rows form, a wgmma, gave wrong scores on the H200
    with Triton 3.6, and illegal addresses, while the interpreter matched)."""
    sc = tl.load(sc_row + cols, mask=cm, other=0.0)
    mn = tl.load(mn_row + cols, mask=cm, other=0.0)
    if F16:
        coefT = _as_f16(codeT) * sc.to(tl.float16)[:, None] + mn.to(tl.float16)[:, None]
    else:
        coefT = (codeT.to(tl.float32) * sc[:, None] + mn[:, None]).to(tl.bfloat16)
    return tl.dot(qBT, coefT, s)


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
                                F16: tl.constexpr = True, ALIGN: tl.constexpr = 1, COEF: tl.constexpr = False):
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
    own byte, synchronously.
    COEF: the keys were coded after RoPE (``keys="coef"``), so a score is taken in coefficient space,
    sT = coefficients @ B q^T + μ · q (B q^T [columns, GP] computed once, from the key basis, which
    is then not held): no key rebuilt, no rotation, no RoPE table read."""
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
    # the head's key basis, held: rows of the low nibbles, high nibbles, byte columns (COEF: only
    # q B^T [GP, columns] of each part is held, in log2 units, fp16 / bf16 as the products' operands)
    if NBKP > 0:
        ak = tl.arange(0, NBKP)
        akm = ak < nbk
        bl1, bl2 = _basis_halves(kb_p, h * Rk + ak, akm, j, jm, D, HALF, F16)
        bh1, bh2 = _basis_halves(kb_p, h * Rk + nbk + ak, akm, j, jm, D, HALF, F16)
        if COEF:
            qbl = ((tl.dot(q1, tl.trans(bl1)) + tl.dot(q2, tl.trans(bl2))) * qk_scale).to(q1.dtype)
            qbh = ((tl.dot(q1, tl.trans(bh1)) + tl.dot(q2, tl.trans(bh2))) * qk_scale).to(q1.dtype)
    if WKP > 0:
        ck = tl.arange(0, WKP)
        ckm = ck < wk
        bw1, bw2 = _basis_halves(kb_p, h * Rk + 2 * nbk + ck, ckm, j, jm, D, HALF, F16)
        if COEF:
            qbw = ((tl.dot(q1, tl.trans(bw1)) + tl.dot(q2, tl.trans(bw2))) * qk_scale).to(q1.dtype)
    if COEF:    # the query heads in fp32, for μ · q
        qf1 = q1.to(tl.float32) * qk_scale
        qf2 = q2.to(tl.float32) * qk_scale
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
        mu1 = tl.load(mrow + j, mask=jm, other=0.0)
        mu2 = tl.load(mrow + HALF + j, mask=jm, other=0.0)
        ks_row = ks_p + grp * sk
        km_row = km_p + grp * sk
        if COEF:    # scores [GP, BT] from the coefficients, starting from the mean's μ · q
            s = tl.zeros([GP, BT], tl.float32) + (tl.sum(qf1 * mu1[None, :], 1) + tl.sum(qf2 * mu2[None, :], 1))[:, None]
        else:
            k1 = tl.zeros([BT, HP], tl.float32) + mu1[None, :]
            k2 = tl.zeros([BT, HP], tl.float32) + mu2[None, :]
        if NBKP > 0 and COEF:   # codes transposed [columns, BT], as the value side reads them
            nibT = tl.load(kn_p + row0.to(tl.int64) * H * nbk + r[None, :] * (H * nbk) + (h * nbk + ak)[:, None],
                           mask=akm[:, None] & rm[None, :], other=0)
            s = _coef_scores(s, nibT & 15, qbl, ks_row, km_row, colk + ak, akm, F16)
            s = _coef_scores(s, nibT >> 4, qbh, ks_row, km_row, colk + nbk + ak, akm, F16)
        if NBKP > 0 and not COEF:
            nib = tl.load(kn_p + row0.to(tl.int64) * H * nbk + r[:, None] * (H * nbk) + (h * nbk + ak)[None, :],
                          mask=rm[:, None] & akm[None, :], other=0)
            lo = _dequant(nib & 15, ks_row, km_row, colk + ak, akm, F16)
            k1 = tl.dot(lo, bl1, k1)
            k2 = tl.dot(lo, bl2, k2)
            hi = _dequant(nib >> 4, ks_row, km_row, colk + nbk + ak, akm, F16)
            k1 = tl.dot(hi, bh1, k1)
            k2 = tl.dot(hi, bh2, k2)
        if WKP > 0 and COEF:
            codeT = tl.load(kc_p + row0.to(tl.int64) * Ck + r[None, :] * Ck + (h * wk + ck)[:, None],
                            mask=ckm[:, None] & rm[None, :], other=0)
            s = _coef_scores(s, codeT, qbw, ks_row, km_row, colk + 2 * nbk + ck, ckm, F16)
        if WKP > 0 and not COEF:
            code = tl.load(kc_p + row0.to(tl.int64) * Ck + r[:, None] * Ck + (h * wk + ck)[None, :],
                           mask=rm[:, None] & ckm[None, :], other=0)
            cw = _dequant(code, ks_row, km_row, colk + 2 * nbk + ck, ckm, F16)
            k1 = tl.dot(cw, bw1, k1)
            k2 = tl.dot(cw, bw2, k2)
        if COEF:
            sT = tl.trans(s)                                                        # [BT, GP], log2 units
        else:
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
            sT = (tl.dot(r1, q1t) + tl.dot(r2, q2t)) * qk_scale                  # [BT, GP], log2 units
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
