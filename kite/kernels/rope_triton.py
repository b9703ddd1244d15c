"""Rotary position embedding of a layer's queries and keys in one Triton kernel.

transformers applies RoPE as ``q * cos + rotate_half(q) * sin`` for q and for k: a slice, a negation,
a concatenation, two products and a sum each, about ten kernels a layer. Here one program per (token,
head) rotates its head's row from the projections' output (any token / head strides: the q / k / v
column blocks of one concatenated projection, or three separate ones) and writes q, k and v in the
layout transformers' attention gets ([B, H, T, d] views of [B, T, H, d] memory); the values are only
copied, so all three come out laid out alike whatever produced them.

Rounding follows transformers: each product rounded to the activations' dtype, then their sum.
Triton's interpreter (TRITON_INTERPRET=1) runs it on the CPU.

:func:`rope_store` is the same kernel for a batch cache's step: the rotated keys and the values go
straight into their slots of the cache's buffers, so a layer's step makes one launch (it made a
second, to copy k and v from where RoPE wrote them) and never writes them anywhere else. Indices
are read on the device, so the launch is the same whatever the rows, slots and counts: a CUDA graph
replays it for any.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_into(src, dst, cs, sn, HALF: tl.constexpr):
    """Head row ``src`` rotated by the position's ``cs`` / ``sn`` rows, written to ``dst`` (its dtype):
    (x * cos) + (rotate_half(x) * sin), rotate_half(x) = [-x2, x1]; each product rounded as torch does."""
    j = tl.arange(0, HALF)
    dt = dst.dtype.element_ty
    x1 = tl.load(src + j).to(tl.float32)
    x2 = tl.load(src + HALF + j).to(tl.float32)
    c1 = tl.load(cs + j).to(tl.float32)
    c2 = tl.load(cs + HALF + j).to(tl.float32)
    s1 = tl.load(sn + j).to(tl.float32)
    s2 = tl.load(sn + HALF + j).to(tl.float32)
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(dst + j, o1.to(dt))
    tl.store(dst + HALF + j, o2.to(dt))


@triton.jit
def _copy_into(src, dst, HALF: tl.constexpr):
    j = tl.arange(0, HALF)
    tl.store(dst + j, tl.load(src + j))
    tl.store(dst + HALF + j, tl.load(src + HALF + j))


@triton.jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, vo_ptr, rows_ptr, starts_ptr, counts_ptr,
                 sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, scb, sct, sbr, sbh, sbn, T,
                 HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, SLOTS: tl.constexpr):
    # program (token, sequence, head): q heads, then k heads, then v heads. SLOTS: k and v go to their
    # cache slots (row rows[b], slot starts[b] + t; none for a padded token t >= counts[b]), else to
    # [B, T, H, d] outputs like q's
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    cs = cos_ptr + b * scb + t * sct
    sn = sin_ptr + b * scb + t * sct
    if h < HQ:
        _rotate_into(q_ptr + b * sqb + t * sqt + h * sqh, qo_ptr + ((b * T + t) * HQ + h) * (2 * HALF), cs, sn, HALF)
    else:
        hk = (h - HQ) % HKV
        if SLOTS:
            keep = t < tl.load(counts_ptr + b)
            dst = tl.load(rows_ptr + b).to(tl.int64) * sbr + (tl.load(starts_ptr + b) + t).to(tl.int64) * sbn \
                + hk * sbh
        else:
            keep = t < T
            dst = ((b * T + t) * HKV + hk) * (2 * HALF)
        if keep:
            if h < HQ + HKV:
                _rotate_into(k_ptr + b * skb + t * skt + hk * skh, ko_ptr + dst, cs, sn, HALF)
            else:
                _copy_into(v_ptr + b * svb + t * svt + hk * svh, vo_ptr + dst, HALF)


def rope_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, T, Hq, d], k / v [B, T, Hkv, d] (last dim contiguous, any other strides), cos / sin
    [B|1, T, d] (transformers' position embeddings, the activations' dtype) → RoPE'd q [B, Hq, T, d],
    RoPE'd k and a copy of v [B, Hkv, T, d], each a transposed view of [B, T, H, d] memory."""
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    qo = torch.empty(B, T, HQ, D, dtype=q.dtype, device=q.device)
    ko = torch.empty(B, T, HKV, D, dtype=q.dtype, device=q.device)
    vo = torch.empty(B, T, HKV, D, dtype=q.dtype, device=q.device)
    if cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    scb = 0 if cos.shape[0] == 1 else cos.stride(0)
    _rope_kernel[(T, B, HQ + 2 * HKV)](
        q, k, v, cos, sin, qo, ko, vo, qo, qo, qo, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), scb, cos.stride(1), 0, 0, 0, T,
        HQ=HQ, HKV=HKV, HALF=D // 2, SLOTS=False, num_warps=1)      # (rows, starts, counts: not read)
    return qo.transpose(1, 2), ko.transpose(1, 2), vo.transpose(1, 2)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               key_buf: torch.Tensor, value_buf: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
               counts: torch.Tensor) -> torch.Tensor:
    """:func:`rope_qkv` for a batch cache's step: RoPE'd q [B, Hq, T, d] is returned, and token t <
    counts[b] of sequence b has its RoPE'd keys and its values written to slot starts[b] + t of row
    rows[b] of key_buf / value_buf [R, Hkv, capacity, d] (one layout, last dim contiguous; ``rows``,
    ``starts``, ``counts`` [B] int32 on their device); padded tokens and sequences with a count of 0
    write nothing there."""
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    if key_buf.stride() != value_buf.stride() or key_buf.stride(-1) != 1:
        raise ValueError("rope_store takes key and value buffers of one layout with a contiguous last dim")
    qo = torch.empty(B, T, HQ, D, dtype=q.dtype, device=q.device)
    if cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    scb = 0 if cos.shape[0] == 1 else cos.stride(0)
    _rope_kernel[(T, B, HQ + 2 * HKV)](
        q, k, v, cos, sin, qo, key_buf, value_buf, rows, starts, counts, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), scb, cos.stride(1),
        key_buf.stride(0), key_buf.stride(1), key_buf.stride(2), T, HQ=HQ, HKV=HKV, HALF=D // 2, SLOTS=True,
        num_warps=1)
    return qo.transpose(1, 2)
