"""Rotary position embedding of a layer's queries and keys in one Triton kernel.

transformers applies RoPE as ``q * cos + rotate_half(q) * sin`` for q and for k: a slice, a negation,
a concatenation, two products and a sum each, about ten kernels a layer. Here one program per (token,
head) rotates its head's row from the projections' output (any token / head strides: the q / k / v
column blocks of one concatenated projection, or three separate ones) and writes q, k and v in the
layout transformers' attention gets ([B, H, T, d] views of [B, T, H, d] memory); the values are only
copied, so all three come out laid out alike whatever produced them.

Rounding follows transformers: each product rounded to the activations' dtype, then their sum.
Triton's interpreter (TRITON_INTERPRET=1) runs it on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, vo_ptr,
                 sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, scb, sct, T,
                 HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    j = tl.arange(0, HALF)
    dt = qo_ptr.dtype.element_ty
    if h < HQ + HKV:
        if h < HQ:
            src = q_ptr + b * sqb + t * sqt + h * sqh
            dst = qo_ptr + ((b * T + t) * HQ + h) * (2 * HALF)
        else:
            src = k_ptr + b * skb + t * skt + (h - HQ) * skh
            dst = ko_ptr + ((b * T + t) * HKV + (h - HQ)) * (2 * HALF)
        cs = cos_ptr + b * scb + t * sct
        sn = sin_ptr + b * scb + t * sct
        x1 = tl.load(src + j).to(tl.float32)
        x2 = tl.load(src + HALF + j).to(tl.float32)
        c1 = tl.load(cs + j).to(tl.float32)
        c2 = tl.load(cs + HALF + j).to(tl.float32)
        s1 = tl.load(sn + j).to(tl.float32)
        s2 = tl.load(sn + HALF + j).to(tl.float32)
        # (x * cos) + (rotate_half(x) * sin), rotate_half(x) = [-x2, x1]; each product rounded as torch does
        o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        tl.store(dst + j, o1.to(dt))
        tl.store(dst + HALF + j, o2.to(dt))
    else:
        hv = h - HQ - HKV
        src = v_ptr + b * svb + t * svt + hv * svh
        dst = vo_ptr + ((b * T + t) * HKV + hv) * (2 * HALF)
        tl.store(dst + j, tl.load(src + j))
        tl.store(dst + HALF + j, tl.load(src + HALF + j))


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
        q, k, v, cos, sin, qo, ko, vo, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), scb, cos.stride(1), T,
        HQ=HQ, HKV=HKV, HALF=D // 2, num_warps=1)
    return qo.transpose(1, 2), ko.transpose(1, 2), vo.transpose(1, 2)
