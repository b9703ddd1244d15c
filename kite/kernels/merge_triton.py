"""Two parts of one attention merged in place, in one Triton kernel (kite.kernels.partials.merge's rule).

A batch row whose state is held beside its slots in lanes is attended in two parts: its slots by the
split-KV kernel (its output in the layout the model wants, [B, q, Hq, d], and the log-sum-exp of each
query row's scores) and its state by the lanes kernel ([B, Hq, q, d] float32 and its log-sum-exp).
Through torch the union's softmax is a stack, a max, exponentials, sums, products and two layout
copies: about fifteen launches a layer, each a few microseconds of a decode step that reads a
state's lanes in tens. Here one program per (row, query token) takes every query head at once, and
the slots' output is overwritten with the merged one (its dtype kept). Triton's interpreter
(TRITON_INTERPRET=1) runs it on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(out_ptr, lse_ptr, o_ptr, s_ptr, sob, sot, soh, slb, slh, slt, spb, sph, spt, ssb, ssh, sst,
                  HQ: tl.constexpr, HP: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    h = tl.arange(0, HP)
    d = tl.arange(0, D)
    ok = h < HQ
    a_lse = tl.load(lse_ptr + b * slb + h * slh + t * slt, mask=ok, other=float("-inf"))
    b_lse = tl.load(s_ptr + b * ssb + h * ssh + t * sst, mask=ok, other=float("-inf"))
    top = tl.maximum(a_lse, b_lse)
    top = tl.where(top == float("-inf"), 0.0, top)
    wa = tl.exp(a_lse - top)
    wb = tl.exp(b_lse - top)
    total = tl.maximum(wa + wb, 1e-30)
    at = out_ptr + b * sob + t * sot + h[:, None] * soh + d[None, :]
    a = tl.load(at, mask=ok[:, None], other=0.0).to(tl.float32)
    o = tl.load(o_ptr + b * spb + h[:, None] * sph + t * spt + d[None, :], mask=ok[:, None], other=0.0)
    merged = (wa[:, None] * a + wb[:, None] * o) / total[:, None]
    tl.store(at, merged.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def merge_into(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``out`` [B, q, Hq, d] (any float dtype; its last axis contiguous) with ``lse`` [B, Hq, q], and ``o``
    [B, Hq, q, d] float32 (its last axis contiguous) with ``s`` [B, Hq, q]: the two parts' union in one
    softmax, written into ``out`` (returned). A query row neither part saw (both -inf) gets zeros."""
    B, Q, Hq, D = out.shape
    if out.stride(-1) != 1 or o.stride(-1) != 1:
        raise ValueError("the outputs' last axes must be contiguous")
    if B == 0 or Q == 0:
        return out
    _merge_kernel[(B, Q)](out, lse, o, s, out.stride(0), out.stride(1), out.stride(2),
                          lse.stride(0), lse.stride(1), lse.stride(2), o.stride(0), o.stride(1), o.stride(2),
                          s.stride(0), s.stride(1), s.stride(2), HQ=Hq, HP=triton.next_power_of_2(Hq), D=D,
                          num_warps=4)
    return out
