"""The decode kernel of attention read from nibble lanes (Triton; the form is kite.kernels.lanes).

One query token per state; a program takes one KV head of one state and a share of its groups
(flash-decoding splits). It projects the head's query rows on the key lanes' basis once (fp32),
then per group scales that projection by the group's lane weights (fp16) and takes the score
constants κ_g · q; per tile of rows it unpacks the nibbles to exact fp16 and takes the scores as
two tensor-core products (low nibbles, high nibbles), then the values' lane sums Σ p n the same
way, scaled by the group's value weights; a group's value constant enters once, with its
probability mass. At the end it projects its lane sums on the value lanes' basis (fp32) and writes
(max, sum, Σ p v) in d space; :func:`lanes_decode` merges the programs' parts with any rows kept
raw (sinks, the tokens decoded so far) in one softmax.

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


# Four code bytes (one register) -> their low and high nibbles as exact fp16, two a register: bytes
# spread to 16-bit halves (prmt), a nibble masked into the mantissa of 1024 (lop3: (x & m) | c), 1024
# taken off (sub.f16x2). Two outputs of two registers each, one input register (pack=4).
_NIBBLES_PTX = tl.constexpr("""
{
.reg .b32 t0, t1, bias;
mov.b32 bias, 0x64006400;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 $0, t0, 0x000F000F, 0x64006400, 0xea;
lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xea;
shr.b32 t0, t0, 4;
shr.b32 t1, t1, 4;
lop3.b32 $2, t0, 0x000F000F, 0x64006400, 0xea;
lop3.b32 $3, t1, 0x000F000F, 0x64006400, 0xea;
sub.f16x2 $0, $0, bias;
sub.f16x2 $1, $1, bias;
sub.f16x2 $2, $2, bias;
sub.f16x2 $3, $3, bias;
}
""")


@triton.jit
def _nibbles_f16(codes, PTX: tl.constexpr):
    """uint8 codes -> (low nibbles, high nibbles) as exact fp16. PTX: four bytes at a time in inline
    PTX (_NIBBLES_PTX; on a GPU); else element by element (the bits of 1024 + n, minus 1024)."""
    if PTX:
        return tl.inline_asm_elementwise(_NIBBLES_PTX, "=r,=r,=r,=r,r", [codes], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=4)
    else:
        lo = ((codes & 15).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        hi = ((codes >> 4).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        return lo, hi


@triton.jit
def _lanes_kernel(q_ptr, kb_ptr, kk_ptr, kw_ptr, kc_ptr, vb_ptr, vk_ptr, vw_ptr, vc_ptr, len_ptr,
                  m_out, l_out, o_out, qscale,
                  H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, NG: tl.constexpr, GROUP: tl.constexpr,
                  RK: tl.constexpr, RV: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                  SPLITS: tl.constexpr, PTX: tl.constexpr):
    pair = tl.program_id(0)
    split = tl.program_id(1)
    n = pair // H
    length = tl.load(len_ptr + n)
    live_groups = tl.minimum(tl.cdiv(length, GROUP), NG)
    per = tl.cdiv(NG, SPLITS)
    g_lo = split * per
    g_hi = tl.minimum(g_lo + per, live_groups)

    g = tl.arange(0, GP)
    gm = g < G
    ck = tl.arange(0, RK // 2)
    cv = tl.arange(0, RV // 2)
    dd = tl.arange(0, D)
    t = tl.arange(0, BT)
    # the query heads of this KV head [GP, D] (fp32, times the softmax scale and log2(e)), projected
    # on the key lanes' basis once: [GP, RK] as two halves (low-nibble lanes, high-nibble lanes)
    q = tl.load(q_ptr + (pair * G + g)[:, None] * D + dd[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
    q = q * qscale
    kb = kb_ptr + pair.to(tl.int64) * (RK * D)
    b_lo = tl.load(kb + ck[:, None] * D + dd[None, :]).to(tl.float32)
    b_hi = tl.load(kb + (RK // 2 + ck)[:, None] * D + dd[None, :]).to(tl.float32)
    q_lo = tl.dot(q, tl.trans(b_lo), input_precision="ieee")
    q_hi = tl.dot(q, tl.trans(b_hi), input_precision="ieee")

    m = tl.full([GP], -1.0e30, tl.float32)
    lsum = tl.zeros([GP], tl.float32)
    acc_lo = tl.zeros([GP, RV // 2], tl.float32)
    acc_hi = tl.zeros([GP, RV // 2], tl.float32)
    acc_c = tl.zeros([GP, D], tl.float32)
    kcodes = kc_ptr + pair.to(tl.int64) * (NG * GROUP * (RK // 2))
    vcodes = vc_ptr + pair.to(tl.int64) * (NG * GROUP * (RV // 2))
    for gi in range(g_lo, g_hi):
        grp = pair * NG + gi
        qs_lo = (q_lo * tl.load(kw_ptr + grp * RK + ck)[None, :]).to(tl.float16)
        qs_hi = (q_hi * tl.load(kw_ptr + grp * RK + RK // 2 + ck)[None, :]).to(tl.float16)
        cq = tl.sum(q * tl.load(kk_ptr + grp * D + dd)[None, :], 1)
        wv_lo = tl.load(vw_ptr + grp * RV + cv)
        wv_hi = tl.load(vw_ptr + grp * RV + RV // 2 + cv)
        m0 = m
        gsum = tl.zeros([GP], tl.float32)
        for t0 in range(0, GROUP, BT):
            rows = gi * GROUP + t0 + t
            live = rows < length
            k_lo, k_hi = _nibbles_f16(tl.load(kcodes + rows[:, None] * (RK // 2) + ck[None, :]), PTX)
            s = tl.dot(qs_lo, tl.trans(k_lo))
            s = tl.dot(qs_hi, tl.trans(k_hi), s)
            s = tl.where(live[None, :], s + cq[:, None], float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            ps = tl.sum(p, 1)
            lsum = lsum * alpha + ps
            gsum = gsum * alpha + ps
            v_lo, v_hi = _nibbles_f16(tl.load(vcodes + rows[:, None] * (RV // 2) + cv[None, :]), PTX)
            ph = p.to(tl.float16)
            acc_lo = acc_lo * alpha[:, None] + tl.dot(ph, v_lo) * wv_lo[None, :]
            acc_hi = acc_hi * alpha[:, None] + tl.dot(ph, v_hi) * wv_hi[None, :]
            m = m_new
        # the group's value constant, weighted by its probability mass (rescaled to the new maximum)
        acc_c = acc_c * tl.exp2(m0 - m)[:, None] + gsum[:, None] * tl.load(vk_ptr + grp * D + dd)[None, :]

    # lane sums projected on the value lanes' basis, plus the constants: [GP, D]
    vb = vb_ptr + pair.to(tl.int64) * (RV * D)
    bv_lo = tl.load(vb + cv[:, None] * D + dd[None, :]).to(tl.float32)
    bv_hi = tl.load(vb + (RV // 2 + cv)[:, None] * D + dd[None, :]).to(tl.float32)
    o = acc_c + tl.dot(acc_lo, bv_lo, input_precision="ieee")
    o = tl.dot(acc_hi, bv_hi, o, input_precision="ieee")
    out = pair * SPLITS + split
    tl.store(m_out + out * GP + g, m)
    tl.store(l_out + out * GP + g, lsum)
    tl.store(o_out + (out * GP + g)[:, None] * D + dd[None, :], o)


def _ptx(q: torch.Tensor) -> bool:
    return q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


class LanesPlan:
    """What :func:`lanes_decode` reads of a Lanes batch, contiguous on its device, made once (a
    serving loop or a benchmark keeps one per layer and batch). The bases stay in their stored
    type (the kernel widens them); weights and constants are float32."""

    def __init__(self, lanes: Lanes):
        self.lanes = lanes
        c = lambda t, dt=None: (t if dt is None else t.to(dt)).contiguous()  # noqa: E731
        self.k_codes, self.v_codes = c(lanes.k_codes), c(lanes.v_codes)
        self.k_weight, self.v_weight = c(lanes.k_weight, torch.float32), c(lanes.v_weight, torch.float32)
        self.k_const, self.v_const = c(lanes.k_const, torch.float32), c(lanes.v_const, torch.float32)
        self.k_basis, self.v_basis = c(lanes.k_basis), c(lanes.v_basis)
        self.length = c(lanes.length.to(lanes.k_codes.device), torch.int32)
        N, H, Tp, _ = lanes.k_codes.shape
        self.N, self.H, self.Tp, self.NG = N, H, Tp, Tp // lanes.group
        self.RK, self.RV, self.D = lanes.k_weight.shape[-1], lanes.v_weight.shape[-1], lanes.k_const.shape[-1]


def lanes_decode(q: torch.Tensor, lanes: Lanes | LanesPlan, scale: float, extra_k: torch.Tensor | None = None,
                 extra_v: torch.Tensor | None = None, splits: int | None = None, block: int = 64,
                 num_warps: int = 4, num_stages: int = 3, ptx: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [N, Hq, d] (one token per state) over the coded rows of each state in
    ``lanes`` and, in the same softmax, ``extra_k`` / ``extra_v`` [N, H, E, d] (rows kept raw: the
    sinks, the decoded tokens; keys post-RoPE): (out [N, Hq, d], lse [N, Hq]) float32.
    ``splits``: programs a KV head's groups are cut into (default: enough programs for the GPU);
    ``block``: rows a tile (divides the group size); ``ptx``: unpack the nibbles in inline PTX
    (default: on a GPU, not under Triton's interpreter)."""
    plan = lanes if isinstance(lanes, LanesPlan) else LanesPlan(lanes)
    N, H, NG, RK, RV, D = plan.N, plan.H, plan.NG, plan.RK, plan.RV, plan.D
    group = plan.lanes.group
    Nq, Hq, d = q.shape
    if Nq != N or d != D or Hq % H:
        raise ValueError(f"q {tuple(q.shape)} does not fit {N} states of {H} KV heads of {D} dims")
    if group % block:
        raise ValueError(f"block {block} must divide the group size {group}")
    G = Hq // H
    GP = max(16, triton.next_power_of_2(G))
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
        splits = max(1, min(NG, math.ceil(4 * sms / (N * H))))
    m = torch.empty(N, H, splits, GP, device=q.device, dtype=torch.float32)
    lsum = torch.empty_like(m)
    o = torch.empty(N, H, splits, GP, D, device=q.device, dtype=torch.float32)
    _lanes_kernel[(N * H, splits)](q.contiguous(), plan.k_basis, plan.k_const, plan.k_weight, plan.k_codes,
                                   plan.v_basis, plan.v_const, plan.v_weight, plan.v_codes, plan.length, m, lsum, o,
                                   scale * LOG2E, H=H, G=G, GP=GP, NG=NG, GROUP=group, RK=RK, RV=RV, D=D, BT=block,
                                   SPLITS=splits, PTX=_ptx(q) if ptx is None else ptx, num_warps=num_warps,
                                   num_stages=num_stages)
    m, lsum, o = m[..., :G], lsum[..., :G], o[..., :G, :]                      # [N, H, S, G(, D)]
    if extra_k is not None and extra_k.shape[2]:
        s = (q.float().view(N, H, G, D) * (scale * LOG2E)) @ extra_k.float().transpose(-1, -2)   # [N, H, G, E]
        me = s.amax(dim=-1)
        pe = torch.exp2(s - me[..., None])
        m = torch.cat((m, me[:, :, None]), dim=2)
        lsum = torch.cat((lsum, pe.sum(-1)[:, :, None]), dim=2)
        o = torch.cat((o, (pe @ extra_v.float())[:, :, None]), dim=2)
    # one softmax over the parts (base 2)
    top = m.amax(dim=2, keepdim=True)
    w = torch.exp2(m - top)                                                         # [N, H, S, G]
    total = (w * lsum).sum(dim=2)                                                   # [N, H, G]
    out = (w[..., None] * o).sum(dim=2) / total.clamp_min(1e-30)[..., None]
    lse = (top[:, :, 0] + torch.log2(total)) / LOG2E
    lse = torch.where(total > 0, lse, torch.full_like(lse, float("-inf")))
    return out.reshape(N, Hq, D), lse.reshape(N, Hq)
