"""What the coded decode kernels share (Triton): integer codes as exact fp16, a sequence's tables
behind the pointer table, the split of a sequence's tiles over programs, and the query heads of a
KV head as two RoPE halves. The kernels: :mod:`kite.kernels.coded_attention_triton` (one-tile,
wide, head; the dispatch), :mod:`kite.kernels.coded_stream_triton` (the stream kernel) and
:mod:`kite.kernels.lanes_triton` (nibble lanes)."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _as_f16(code):
    """Integer codes < 1024 as exact fp16 values without a conversion instruction: the bits of
    1024 + code (exponent 2^10, the code in the mantissa), minus 1024."""
    return (code.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0


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
