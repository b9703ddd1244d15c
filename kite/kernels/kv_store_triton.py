"""A step's new keys and values written into the rows of a batch cache's buffers, in one Triton kernel.

Sequence b of a step feeds ``counts[b]`` real tokens (the step's query is padded to the longest);
token t < counts[b] goes to slot ``starts[b] + t`` of buffer row ``rows[b]``, in every KV head; padded
tokens and sequences with a count of 0 write nothing. Indices are read on the device, so the launch is
the same whatever the rows, slots and counts are: a CUDA graph replays it for any. Triton's interpreter
(TRITON_INTERPRET=1) runs it on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kernel(k_ptr, v_ptr, kb_ptr, vb_ptr, rows_ptr, starts_ptr, counts_ptr,
                  skb, skh, skt, svb, svh, svt, sbr, sbh, sbn, QL: tl.constexpr, D: tl.constexpr):
    bt = tl.program_id(0)
    h = tl.program_id(1)
    b = bt // QL
    t = bt % QL
    if t < tl.load(counts_ptr + b):
        row = tl.load(rows_ptr + b).to(tl.int64)
        slot = (tl.load(starts_ptr + b) + t).to(tl.int64)
        d = tl.arange(0, D)
        dst = row * sbr + h * sbh + slot * sbn + d
        tl.store(kb_ptr + dst, tl.load(k_ptr + b * skb + h * skh + t * skt + d))
        tl.store(vb_ptr + dst, tl.load(v_ptr + b * svb + h * svh + t * svt + d))


def store_kv(k: torch.Tensor, v: torch.Tensor, key_buf: torch.Tensor, value_buf: torch.Tensor,
             rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor) -> None:
    """Write k / v [B, Hkv, q, d] (last dim contiguous) into key_buf / value_buf [R, Hkv, capacity, d]
    (the same strides, last dim contiguous): token t < counts[b] of sequence b to slot starts[b] + t
    of row rows[b] (``rows``, ``starts``, ``counts``: [B] int32 on the buffers' device)."""
    B, H, QL, D = k.shape
    if key_buf.stride() != value_buf.stride() or k.stride(-1) != 1 or v.stride(-1) != 1 or key_buf.stride(-1) != 1:
        raise ValueError("store_kv takes buffers of one layout and rows with a contiguous last dim")
    _store_kernel[(B * QL, H)](k, v, key_buf, value_buf, rows, starts, counts,
                               k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                               key_buf.stride(0), key_buf.stride(1), key_buf.stride(2), QL=QL, D=D, num_warps=1)
