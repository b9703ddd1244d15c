"""The decode kernel of attention read from nibble lanes (Triton; the form is kite.kernels.lanes).

One query token per state; a program of the stream kernel (:func:`_lanes_kernel`) takes one KV
head of one state and a share of its groups (flash-decoding splits). Per group it scales the query,
projected on the key lanes' basis, by the group's lane weights (fp16) and adds the score constants
κ_g · q; per tile of rows it unpacks the nibbles to fp16 biased by 1024 (inline PTX, four bytes in
three or four instructions) and takes the scores as two tensor-core products (low nibbles, high
nibbles), then the values' lane sums Σ p n the same way; per group it takes the biases off (the
scores' in the group's constant, the values' by the group's mass), scales the group's lane sums by
its value weights and writes its probability mass (the weight of its value constant). Its outputs
(max, sum, lane sums, the groups' masses) are small. Two small kernels, one program a KV head of a state, hold what the loop does
not need, so that it does not weigh on the stream kernel's registers: :func:`_query_kernel` before
it (the query on the key lanes, fp32 via tf32x3; the score constants) and :func:`_finish_kernel`
after it (the programs' parts and any rows kept raw, such as sinks and the tokens decoded so far,
in one softmax; the groups' value constants by their masses; the merged lane sums projected back
to d once).

Query heads are the rows of every product (GP >= 16 of them, padding included): the form of the
stream kernel's coefficient scores that the H200 runs right under Triton 3.6.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kite.kernels.lanes import Lanes

LOG2E = 1.4426950408889634
LN2_INV = tl.constexpr(LOG2E)      # the same, for the kernels


# Four code bytes (one register) -> their low (or high) nibbles n as fp16, *biased*: 1024 + n·2^p,
# exact, the nibble at bit p of the mantissa of an fp16 whose exponent is that of 1024. One mask
# operation (lop3: (x & m) | c) places the nibbles of bytes 0 and 2 in the two halves of a register;
# the same on the word shifted by a byte (or by what places them) gives bytes 1 and 3. So the four
# outputs are bytes 0, 2, 1, 3 (3 or 4 instructions for four nibbles): the key side's query is read
# in that order, the value side's rows are stored in it (kite.kernels.lanes.quad_order). The biases
# come off once a group, not per nibble: the scores' in the group's constant, the values' by the
# group's probability mass. Keys take the nibbles where they lie (p = 0 low, 4 high: 3 instructions);
# values at the top of the mantissa (p = 6), where the bias is 2.1x a mean nibble's weight, not 137x:
# the value sums are taken off it at the end, and the tensor cores' accumulation keeps bits relative
# to the bias (keys' bias is a constant of the softmax and costs nothing there). One output of two
# registers, one input register (pack=4); low and high apart, so that one unpacked tile at a time is
# live.
def _unpack_ptx(first: int, second: int, mask: int) -> str:
    """The PTX of one unpacking: the word shifted by ``first`` bits (left; negative: right) and by
    ``second``, each masked to its two nibbles and or-ed into 1024's bits."""
    def shifted(reg: str, by: int) -> str:
        if by == 0:
            return f"mov.b32 {reg}, $2;"
        return f"{'shl' if by > 0 else 'shr'}.b32 {reg}, $2, {abs(by)};"
    return "\n".join(("{", ".reg .b32 t0, t1;", shifted("t0", first), shifted("t1", second),
                      f"lop3.b32 $0, t0, {mask:#010x}, 0x64006400, 0xea;",
                      f"lop3.b32 $1, t1, {mask:#010x}, 0x64006400, 0xea;", "}"))


_KEY_LOW = tl.constexpr(_unpack_ptx(0, -8, 0x000F000F))      # 1024 + n
_KEY_HIGH = tl.constexpr(_unpack_ptx(0, -8, 0x00F000F0))     # 1024 + 16 n
_VALUE_LOW = tl.constexpr(_unpack_ptx(6, -2, 0x03C003C0))    # 1024 + 64 n
_VALUE_HIGH = tl.constexpr(_unpack_ptx(2, -6, 0x03C003C0))   # 1024 + 64 n
BIAS = tl.constexpr(1024.0)


@triton.jit
def _nibbles(codes, ASM: tl.constexpr, SRC: tl.constexpr, SHIFT: tl.constexpr, PTX: tl.constexpr):
    """uint8 codes -> 1024 + a nibble of each, placed in the mantissa (fp16, exact). PTX: four bytes
    at a time by the inline PTX ``ASM``, bytes 0, 2, 1, 3 of each four (on a GPU); else element by
    element, in order (Triton's interpreter): the bits ``SRC`` of the code, shifted left ``SHIFT``."""
    if PTX:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return (((codes & SRC).to(tl.int16) << SHIFT) | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def _share(n_items, split, splits):
    """Split `split`'s share [lo, hi) of a state's n_items groups cut into ``splits``."""
    per = tl.cdiv(n_items, splits)
    lo = split * per
    return lo, tl.minimum(lo + per, n_items)


@triton.jit
def _quad(i):
    """Positions i with the middle two of each four swapped (0, 2, 1, 3): the order in which the PTX
    unpacking yields four bytes (kite.kernels.lanes.quad_order)."""
    return (i & ~3) | ((i & 1) << 1) | ((i >> 1) & 1)


# A state's tables behind the pointer table (LanesPlan.ptrs, one row of TABLES a state): the states
# of a batch stay where they are (each its own tensors), none copied to form the batch.
TABLES = ("k_codes", "k_weight", "k_const", "k_basis", "v_codes", "v_weight", "v_const", "v_basis")


@triton.jit
def _table(ptrs, n, i: tl.constexpr, ty: tl.constexpr):
    """State n's table i (TABLES) as a pointer to ``ty``, 16-byte aligned (LanesPlan checks it)."""
    return tl.multiple_of(tl.load(ptrs + n * 8 + i).to(tl.pointer_type(ty)), 16)


@triton.jit
def _query_kernel(q_ptr, ptrs, ng_ptr, qk_out, cq_out, qscale, H: tl.constexpr, G: tl.constexpr,
                  GP: tl.constexpr, NGMAX: tl.constexpr, RK: tl.constexpr, D: tl.constexpr, BASIS: tl.constexpr,
                  GB: tl.constexpr):
    """Before the stream kernel, per KV head of a state: its query rows (times ``qscale``) on the key
    lanes' basis, [GP, RK] in fp32 (tf32x3), and the score constants κ_g · q of every group [NG, GP],
    ``GB`` groups a product (tf32x3)."""
    pair = tl.program_id(0)
    n = pair // H
    h = pair % H
    ng = tl.load(ng_ptr + n)
    g = tl.arange(0, GP)
    j = tl.arange(0, RK)
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + (pair * G + g)[:, None] * D + dd[None, :], mask=(g < G)[:, None], other=0.0)
    q = q.to(tl.float32) * qscale
    kb = _table(ptrs, n, 3, BASIS) + h * (RK * D)
    basis = tl.load(kb + j[:, None] * D + dd[None, :]).to(tl.float32)
    qk = tl.dot(q, tl.trans(basis), input_precision="tf32x3")
    tl.store(qk_out + (pair * GP + g)[:, None] * RK + j[None, :], qk)
    kk = _table(ptrs, n, 2, tl.float32) + h * ng * D
    b = tl.arange(0, GB)
    for g0 in range(0, ng, GB):
        gi = g0 + b
        live = gi < ng
        kappa = tl.load(kk + gi[:, None] * D + dd[None, :], mask=live[:, None], other=0.0)       # [GB, D]
        cq = tl.dot(kappa, tl.trans(q), input_precision="tf32x3")                              # [GB, GP]
        tl.store(cq_out + (pair * NGMAX + gi)[:, None] * GP + g[None, :], cq, mask=live[:, None])


@triton.jit
def _finish_kernel(q_ptr, m_ptr, l_ptr, acc_ptr, gm_ptr, gs_ptr, ptrs, ng_ptr, len_ptr, ek_ptr, ev_ptr,
                   out_ptr, lse_ptr, qscale, E, splits, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                   NGMAX: tl.constexpr, GROUP: tl.constexpr, RV: tl.constexpr, D: tl.constexpr,
                   BASIS: tl.constexpr, SB: tl.constexpr, GB: tl.constexpr):
    """After the stream kernel, per KV head of a state: its splits' parts and the ``E`` rows kept raw
    (``ek`` / ``ev`` [E, D]: sinks, decoded tokens) in one softmax (base 2), the groups' value
    constants by their masses, the merged lane sums projected back to d (fp32, tf32x3): the
    normalized output [G, D] and the log-sum-exp (natural) [G]. The splits' maxima are read ``SB`` at a
    time, the groups' constants ``GB`` a product (tf32x3), not one by one."""
    pair = tl.program_id(0)
    n = pair // H
    h = pair % H
    ng = tl.load(ng_ptr + n)
    g = tl.arange(0, GP)
    gm_ = g < G
    j = tl.arange(0, RV)
    dd = tl.arange(0, D)
    sb = tl.arange(0, SB)
    q = tl.load(q_ptr + (pair * G + g)[:, None] * D + dd[None, :], mask=gm_[:, None], other=0.0)
    q = q.to(tl.float32) * qscale
    top = tl.full([GP], -1.0e30, tl.float32)
    for s0 in range(0, splits, SB):
        part = pair * splits + s0 + sb
        m = tl.load(m_ptr + part[:, None] * GP + g[None, :], mask=(s0 + sb < splits)[:, None], other=-1.0e30)
        top = tl.maximum(top, tl.max(m, 0))
    for e in range(E):
        k = tl.load(ek_ptr + (pair * E + e) * D + dd).to(tl.float32)
        top = tl.maximum(top, tl.sum(q * k[None, :], 1))
    total = tl.zeros([GP], tl.float32)
    lane = tl.zeros([GP, RV], tl.float32)
    for s in range(splits):     # (a split's lane sums [GP, RV] a load: a 3-D tile of several was slower on the H200)
        part = pair * splits + s
        w = tl.exp2(tl.load(m_ptr + part * GP + g) - top)
        total += w * tl.load(l_ptr + part * GP + g)
        lane += w[:, None] * tl.load(acc_ptr + (part * GP + g)[:, None] * RV + j[None, :])
    vb = _table(ptrs, n, 7, BASIS) + h * (RV * D)
    basis = tl.load(vb + j[:, None] * D + dd[None, :]).to(tl.float32)
    o = tl.dot(lane, basis, input_precision="tf32x3")
    vk = _table(ptrs, n, 6, tl.float32) + h * ng * D
    live = tl.minimum(tl.cdiv(tl.load(len_ptr + n), GROUP), ng)
    b = tl.arange(0, GB)
    for g0 in range(0, live, GB):
        gi = g0 + b
        ok = (gi < live)[:, None]
        grp = pair * NGMAX + gi
        mass = tl.load(gs_ptr + grp[:, None] * GP + g[None, :], mask=ok, other=0.0) * \
            tl.exp2(tl.load(gm_ptr + grp[:, None] * GP + g[None, :], mask=ok, other=-1.0e30) - top[None, :])  # [GB, GP]
        const = tl.load(vk + gi[:, None] * D + dd[None, :], mask=ok, other=0.0)              # [GB, D]
        o += tl.dot(tl.trans(mass), const, input_precision="tf32x3")
    for e in range(E):
        k = tl.load(ek_ptr + (pair * E + e) * D + dd).to(tl.float32)
        p = tl.exp2(tl.sum(q * k[None, :], 1) - top)
        total += p
        o += p[:, None] * tl.load(ev_ptr + (pair * E + e) * D + dd).to(tl.float32)[None, :]
    out = o / tl.maximum(total, 1e-30)[:, None]
    lse = tl.where(total > 0, (top + tl.log2(tl.maximum(total, 1e-30))) / LN2_INV, float("-inf"))
    tl.store(out_ptr + (pair * G + g)[:, None] * D + dd[None, :], out, mask=gm_[:, None])
    tl.store(lse_ptr + pair * G + g, lse, mask=gm_)


@triton.jit
def _lanes_kernel(qk_ptr, cq_ptr, ptrs, ng_ptr, len_ptr, m_out, l_out, acc_out, gm_out, gs_out, splits,
                  H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, NGMAX: tl.constexpr, GROUP: tl.constexpr,
                  RK: tl.constexpr, RV: tl.constexpr, BT: tl.constexpr, PTX: tl.constexpr):
    pair = tl.program_id(0)
    split = tl.program_id(1)
    n = pair // H
    h = pair % H
    ng = tl.load(ng_ptr + n)
    length = tl.load(len_ptr + n)
    live_groups = tl.minimum(tl.cdiv(length, GROUP), ng)
    g_lo, g_hi = _share(ng, split, splits)
    g_hi = tl.minimum(g_hi, live_groups)

    g = tl.arange(0, GP)
    ck = tl.arange(0, RK // 2)
    cv = tl.arange(0, RV // 2)
    t = tl.arange(0, BT)
    # the query heads of this KV head on its key lanes (_query_kernel; times the softmax scale and
    # log2(e)): [GP, RK] as two halves (low-nibble lanes, high-nibble lanes), read again per group
    # (from the cache) rather than held in registers through the loop
    qrow = qk_ptr + (pair * GP + g)[:, None] * RK
    m = tl.full([GP], -1.0e30, tl.float32)
    lsum = tl.zeros([GP], tl.float32)
    acc_lo = tl.zeros([GP, RV // 2], tl.float32)
    acc_hi = tl.zeros([GP, RV // 2], tl.float32)
    rows_h = h.to(tl.int64) * ng * GROUP                       # this head's first row in the state's tables
    kcodes = _table(ptrs, n, 0, tl.uint8) + rows_h * (RK // 2)
    vcodes = _table(ptrs, n, 4, tl.uint8) + rows_h * (RV // 2)
    kw = _table(ptrs, n, 1, tl.float32) + h * ng * RK
    vw = _table(ptrs, n, 5, tl.float32) + h * ng * RV
    # the key lanes in the order the unpacked nibbles come (_quad); the rows of a group's value codes
    # are stored in it, so they come out in order (PTX), or are read in order (the interpreter)
    if PTX:
        kq = _quad(ck)
        tq = t
    else:
        kq = ck
        tq = _quad(t)
    for gi in range(g_lo, g_hi):
        # the query on the group's lane weights, in fp16 as the products read it; the high nibbles
        # come times 16, so their query is taken / 16 (exact)
        qs_lo = (tl.load(qrow + kq[None, :]) * tl.load(kw + gi * RK + kq)[None, :]).to(tl.float16)
        qs_hi = (tl.load(qrow + RK // 2 + kq[None, :]) * tl.load(kw + gi * RK + RK // 2 + kq)[None, :]).to(tl.float16)
        qs_hi = qs_hi * 0.0625
        # the score constant, less the nibbles' bias: 1024 x the query's lane sum
        cq = tl.load(cq_ptr + (pair * NGMAX + gi) * GP + g)
        cq -= BIAS * (tl.sum(qs_lo.to(tl.float32), 1) + tl.sum(qs_hi.to(tl.float32), 1))
        # the group's value sums start at 0, relative to the running maximum; they join acc at its end
        m_start = m
        gsum = tl.zeros([GP], tl.float32)
        g_lo_acc = tl.zeros([GP, RV // 2], tl.float32)
        g_hi_acc = tl.zeros([GP, RV // 2], tl.float32)
        for t0 in range(0, GROUP, BT):
            rows = gi * GROUP + t0 + t
            live = rows < length
            kt = tl.load(kcodes + rows[:, None] * (RK // 2) + ck[None, :])
            s = tl.dot(qs_lo, tl.trans(_nibbles(kt, _KEY_LOW, 15, 0, PTX)))
            s = tl.dot(qs_hi, tl.trans(_nibbles(kt, _KEY_HIGH, 0xF0, 0, PTX)), s)
            s = tl.where(live[None, :], s + cq[:, None], float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            ph = tl.exp2(s - m_new[:, None]).to(tl.float16)
            # the mass as the value product reads it (fp16): its bias is 1024 x this
            gsum = gsum * alpha + tl.sum(ph.to(tl.float32), 1)
            # value codes lane-major within the group ([RV / 2, GROUP]): a thread's four rows of a
            # lane (the product's k) are one word
            vt = tl.load(vcodes + gi * (GROUP * (RV // 2)) + cv[:, None] * GROUP + (t0 + tq)[None, :])
            g_lo_acc = tl.dot(ph, tl.trans(_nibbles(vt, _VALUE_LOW, 15, 6, PTX)), g_lo_acc * alpha[:, None])
            g_hi_acc = tl.dot(ph, tl.trans(_nibbles(vt, _VALUE_HIGH, 0xF0, 2, PTX)), g_hi_acc * alpha[:, None])
            m = m_new
        # the group's lane sums, biases off, on its value weights (a nibble came times 64)
        beta = tl.exp2(m_start - m)
        wv_lo = tl.load(vw + gi * RV + cv) * 0.015625
        wv_hi = tl.load(vw + gi * RV + RV // 2 + cv) * 0.015625
        acc_lo = acc_lo * beta[:, None] + (g_lo_acc - BIAS * gsum[:, None]) * wv_lo[None, :]
        acc_hi = acc_hi * beta[:, None] + (g_hi_acc - BIAS * gsum[:, None]) * wv_hi[None, :]
        lsum = lsum * beta + gsum
        # the group's probability mass (relative to the running maximum at its end): its value
        # constant's weight, applied after the kernel
        tl.store(gm_out + (pair * NGMAX + gi) * GP + g, m)
        tl.store(gs_out + (pair * NGMAX + gi) * GP + g, gsum)

    out = pair * splits + split
    tl.store(m_out + out * GP + g, m)
    tl.store(l_out + out * GP + g, lsum)
    arow = acc_out + (out * GP + g)[:, None] * RV
    tl.store(arow + cv[None, :], acc_lo)
    tl.store(arow + RV // 2 + cv[None, :], acc_hi)


STREAM_KERNEL = _lanes_kernel     # by name for benchmarks/lanes_sass.py (its machine code for sm_90a)


def _ptx(q: torch.Tensor) -> bool:
    return q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


MIN_LANES = 32     # lanes a row the kernel reads (each half a tensor-core product's K of >= 16)
# The stream kernel's launch configuration, the fastest on the H200 (benchmarks/lanes_decode.py,
# benchmarks/results/lanes_decode_h200_20261201_dbb5a4f_run5.json): one-warp programs of 64-row tiles
# (a tile divides the group size), 3 stages.
BLOCK, NUM_WARPS, NUM_STAGES = 64, 1, 3
# A question's several tokens (a prefill) are folded into the query heads of their state: every state
# row precedes every query token, so token t of head g is one more row of the KV head's products. Up to
# this many folded rows a program (GP), with a warp per 16 of them (the registers a thread holds stay
# those of the one-warp decode program): the state is read once per chunk of tokens, not per token.
# 16: the decode program's own shape (7 query heads a KV head fill 16 rows with 2 tokens).
FOLDED_ROWS = 16
# The small kernels around it read the groups' constants GROUPS_A_PRODUCT at a time (one tensor-core
# product, not a chain of dependent loads) and the splits' maxima SPLITS_A_LOAD at a time.
GROUPS_A_PRODUCT, SPLITS_A_LOAD = 16, 8


def kernel_reads(lanes: Lanes | list[Lanes]) -> bool:
    """Whether the kernel reads these lanes (>= MIN_LANES a row on both sides); the reference does
    every form."""
    x = lanes if isinstance(lanes, Lanes) else lanes[0]
    return min(x.k_weight.shape[-1], x.v_weight.shape[-1]) >= MIN_LANES


_BASIS_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class LanesPlan:
    """What :func:`lanes_decode` reads of a batch of states in lanes, made once (a serving loop or a
    benchmark keeps one per layer and batch): a pointer table to each state's tables (TABLES), so
    the states stay where they are; their groups, lengths and sinks. ``lanes``: one Lanes of N
    stacked states, or a list of one-state Lanes (a batch's rows, each its own tensors; same heads,
    lanes, group size, number of sinks and basis type). Weights and constants are float32 (copied
    once where they are not), the bases stay in their stored type (the kernel widens them)."""

    def __init__(self, lanes: Lanes | list[Lanes]):
        states = [lanes] if isinstance(lanes, Lanes) else list(lanes)
        if not states:
            raise ValueError("no states to plan")
        first = states[0]
        self.group = first.group
        self.H, self.RK, self.RV = first.k_codes.shape[1], first.k_weight.shape[-1], first.v_weight.shape[-1]
        self.D = first.k_const.shape[-1]
        basis = first.k_basis.dtype
        if basis not in _BASIS_TYPES:
            raise ValueError(f"bases of {basis} are not read by the kernel (bf16, fp16 or fp32)")
        self.basis_type = _BASIS_TYPES[basis]
        rows, ngs, lengths, keep = [], [], [], []
        for x in states:
            if (x.group, x.k_codes.shape[1], x.k_weight.shape[-1], x.v_weight.shape[-1], x.k_basis.dtype,
                    x.v_basis.dtype, x.raw_k.shape[2]) != (self.group, self.H, self.RK, self.RV, basis, basis,
                                                          first.raw_k.shape[2]):
                raise ValueError("states of one plan must share heads, lanes, group size, sinks and basis type")
            tabs = [_aligned(getattr(x, name), torch.float32 if name.endswith(("weight", "const")) else None)
                    for name in TABLES]
            keep.append(tabs)
            for i in range(x.states):           # state i of a stacked Lanes: views of its rows
                rows.append([t.data_ptr() + i * t[0].numel() * t.element_size() for t in tabs])
                ngs.append(x.k_weight.shape[2])
                lengths.append(x.length[i])
        dev = first.k_codes.device
        self._keep = keep
        self.ptrs = torch.tensor(rows, dtype=torch.int64, device=dev)
        self.ngs = torch.tensor(ngs, dtype=torch.int32, device=dev)
        self.length = torch.stack([torch.as_tensor(n) for n in lengths]).to(dev, torch.int32)
        self.N, self.NGMAX = len(rows), max(ngs)
        self.raw_k = torch.cat([x.raw_k for x in states]) if len(states) > 1 else first.raw_k
        self.raw_v = torch.cat([x.raw_v for x in states]) if len(states) > 1 else first.raw_v


    @classmethod
    def gathered(cls, like: LanesPlan, ptrs: torch.Tensor, ngs: torch.Tensor, length: torch.Tensor,
                 raw_k: torch.Tensor, raw_v: torch.Tensor, ngmax: int) -> LanesPlan:
        """A plan of the states whose tables ``ptrs`` [N, 8] point to (``ngs``, ``length`` [N] int32,
        their sinks ``raw_k`` / ``raw_v`` [N, H, S, d]), shaped as ``like`` (heads, lanes, group, basis
        type), read up to ``ngmax`` groups a state: what a captured decode step builds from tables kept
        by cache row. The caller keeps the states' tensors alive."""
        plan = object.__new__(cls)
        for name in ("group", "H", "RK", "RV", "D", "basis_type"):
            setattr(plan, name, getattr(like, name))
        plan._keep = []
        plan.ptrs, plan.ngs, plan.length, plan.raw_k, plan.raw_v = ptrs, ngs, length, raw_k, raw_v
        plan.N, plan.NGMAX = int(ptrs.shape[0]), int(ngmax)
        return plan


def _aligned(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` contiguous (in ``dtype``), each of its states' rows 16-byte aligned (a copy if not)."""
    t = t.contiguous() if dtype is None else t.to(dtype).contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    if (t[0].numel() * t.element_size()) % 16:
        raise ValueError(f"a state's table of {tuple(t.shape)} {t.dtype} is not 16-byte aligned")
    return t


def lanes_decode(q: torch.Tensor, lanes: Lanes | LanesPlan, scale: float, extra_k: torch.Tensor | None = None,
                 extra_v: torch.Tensor | None = None, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [N, Hq, d] (one token per state) over the coded rows of each state in
    ``lanes`` and, in the same softmax, ``extra_k`` / ``extra_v`` [N, H, E, d] (rows kept raw: the
    sinks, the decoded tokens; keys post-RoPE): (out [N, Hq, d], lse [N, Hq]) float32.
    ``splits``: programs a KV head's groups are cut into (default: about 40 programs an SM). The
    nibbles are unpacked in inline PTX on a GPU, element by element under Triton's interpreter."""
    plan = lanes if isinstance(lanes, LanesPlan) else LanesPlan(lanes)
    N, H, NG, RK, RV, D = plan.N, plan.H, plan.NGMAX, plan.RK, plan.RV, plan.D
    group = plan.group
    Nq, Hq, d = q.shape
    if Nq != N or d != D or Hq % H:
        raise ValueError(f"q {tuple(q.shape)} does not fit {N} states of {H} KV heads of {D} dims")
    if group % BLOCK:
        raise ValueError(f"the kernel's tile of {BLOCK} rows must divide the group size {group}")
    if min(RK, RV) < MIN_LANES:
        raise ValueError(f"the lanes kernel reads {MIN_LANES} lanes a row or more, not {RK} / {RV} "
                         "(kite.kernels.lanes.lanes_partial_torch reads any)")
    G = Hq // H
    GP = max(16, triton.next_power_of_2(G))
    warps = max(NUM_WARPS, GP // 16)
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
        splits = max(1, min(NG, math.ceil(40 * sms / (N * H))))
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    qc = q.contiguous()
    qscale = scale * LOG2E
    qk, cq = torch.empty(N, H, GP, RK, **f32), torch.empty(N, H, NG, GP, **f32)
    _query_kernel[(N * H,)](qc, plan.ptrs, plan.ngs, qk, cq, qscale, H=H, G=G, GP=GP, NGMAX=NG, RK=RK, D=D,
                            BASIS=plan.basis_type, GB=GROUPS_A_PRODUCT)
    m, lsum = torch.empty(N, H, splits, GP, **f32), torch.empty(N, H, splits, GP, **f32)
    acc = torch.empty(N, H, splits, GP, RV, **f32)
    gm, gs = torch.empty(N, H, NG, GP, **f32), torch.empty(N, H, NG, GP, **f32)
    # the splits are an argument, not a constant: a batch of another size compiles nothing new
    _lanes_kernel[(N * H, splits)](qk, cq, plan.ptrs, plan.ngs, plan.length, m, lsum, acc, gm, gs, splits, H=H,
                                   G=G, GP=GP, NGMAX=NG, GROUP=group, RK=RK, RV=RV, BT=BLOCK,
                                   PTX=_ptx(q), num_warps=warps, num_stages=NUM_STAGES)
    if extra_k is None or extra_k.shape[2] == 0:
        extra_k = extra_v = torch.zeros(N, H, 0, D, device=dev, dtype=q.dtype)
    E = extra_k.shape[2]
    out, lse = torch.empty(N, Hq, D, **f32), torch.empty(N, Hq, **f32)
    _finish_kernel[(N * H,)](qc, m, lsum, acc, gm, gs, plan.ptrs, plan.ngs, plan.length, extra_k.contiguous(),
                             extra_v.contiguous(), out, lse, qscale, E, splits, H=H, G=G, GP=GP, NGMAX=NG,
                             GROUP=group, RV=RV, D=D, BASIS=plan.basis_type,
                             SB=SPLITS_A_LOAD, GB=GROUPS_A_PRODUCT)
    return out, lse


def token_chunks(T: int, G: int) -> tuple[int, int]:
    """(tokens a chunk, chunks) of a question of T tokens a state, its tokens folded into the G query
    heads of each KV head, at most :data:`FOLDED_ROWS` rows a chunk."""
    per = max(1, min(T, FOLDED_ROWS // G))
    return per, -(-T // per)


def lanes_attend_tokens(q: torch.Tensor, plan_for, scale: float, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [N, Hq, T, d] (T tokens a state, every state row before every token: no mask) over
    N states of H KV heads and their sinks: (out [N, Hq, T, d], lse [N, Hq, T]) float32. The tokens are
    folded into the query heads of their state, a chunk of them an entry of the kernel's plan
    (:func:`token_chunks`), all in one launch: ``plan_for(C)`` gives the plan of the N states each
    repeated C times in a row, so a state is read once a chunk, not once a token."""
    N, Hq, T, d = q.shape
    G = Hq // H
    per, C = token_chunks(T, G)
    plan = plan_for(C)
    if C * per > T:
        q = torch.nn.functional.pad(q, (0, 0, 0, C * per - T))
    # [N, H, G, C, per, d] -> entries (n, c), rows (h, g, t)
    folded = q.reshape(N, H, G, C, per, d).permute(0, 3, 1, 2, 4, 5).reshape(N * C, H * G * per, d)
    o, lse = lanes_decode(folded, plan, scale, plan.raw_k, plan.raw_v)
    o = o.view(N, C, H, G, per, d).permute(0, 2, 3, 1, 4, 5).reshape(N, Hq, C * per, d)
    lse = lse.view(N, C, H, G, per).permute(0, 2, 3, 1, 4).reshape(N, Hq, C * per)
    return o[:, :, :T], lse[:, :, :T]
