"""The decode kernel of attention read from nibble lanes (Triton; the form is kite.kernels.lanes).

One query token per state. The query heads of a KV head are projected on its key lanes' basis once
(q B^T, outside the kernel: [N, H, Gq, R] is small) and its score constants κ_g · q once per group;
the kernel streams the nibbles: per group it scales the projected query by that group's lane
weights, per tile of rows it unpacks the nibbles to exact fp16 and takes the scores as two
tensor-core products (the low nibbles, the high nibbles), then the values' lane sums Σ p n the same
way, scaled by the group's value weights, and the value constants as Σ p κ_v. Programs split a
state's groups (flash-decoding): each writes its part in lane space (max, sum, lane sums, constant
sums) and :func:`lanes_decode` merges the parts and projects them on the value basis once.

Query heads are the rows of every product (GP >= 16 of them, padding included): the form of the
stream kernel's coefficient scores that the H200 runs right under Triton 3.6.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kite.kernels.lanes import Lanes

LOG2E = 1.4426950408889634


@triton.jit
def _nibbles_f16(codes):
    """uint8 codes -> (low nibbles, high nibbles) as exact fp16: the bits of 1024 + n, minus 1024."""
    lo = ((codes & 15).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    hi = ((codes >> 4).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return lo, hi


@triton.jit
def _lanes_kernel(qk_ptr, cq_ptr, kc_ptr, kw_ptr, vc_ptr, vw_ptr, vk_ptr, len_ptr,
                  m_out, l_out, acc_out, accc_out,
                  H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, NG: tl.constexpr, GROUP: tl.constexpr,
                  RK: tl.constexpr, RV: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                  SPLITS: tl.constexpr):
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
    # the projected query, pre-scaled by the softmax scale and log2(e): two halves of its lanes
    qrow = qk_ptr + (pair * G + g)[:, None] * RK
    q_lo = tl.load(qrow + ck[None, :], mask=gm[:, None], other=0.0)
    q_hi = tl.load(qrow + RK // 2 + ck[None, :], mask=gm[:, None], other=0.0)

    m = tl.full([GP], -1.0e30, tl.float32)
    lsum = tl.zeros([GP], tl.float32)
    acc_lo = tl.zeros([GP, RV // 2], tl.float32)
    acc_hi = tl.zeros([GP, RV // 2], tl.float32)
    acc_c = tl.zeros([GP, D], tl.float32)
    kcodes = kc_ptr + pair.to(tl.int64) * (NG * GROUP * (RK // 2))
    vcodes = vc_ptr + pair.to(tl.int64) * (NG * GROUP * (RV // 2))
    for gi in range(g_lo, g_hi):
        wrow = kw_ptr + (pair * NG + gi) * RK
        qs_lo = (q_lo * tl.load(wrow + ck)[None, :]).to(tl.float16)
        qs_hi = (q_hi * tl.load(wrow + RK // 2 + ck)[None, :]).to(tl.float16)
        cq = tl.load(cq_ptr + (pair * NG + gi) * G + g, mask=gm, other=0.0)
        vrow = vw_ptr + (pair * NG + gi) * RV
        wv_lo = tl.load(vrow + cv)
        wv_hi = tl.load(vrow + RV // 2 + cv)
        gsum = tl.zeros([GP], tl.float32)
        for t0 in range(0, GROUP, BT):
            rows = gi * GROUP + t0 + t
            live = rows < length
            kb = tl.load(kcodes + rows[:, None] * (RK // 2) + ck[None, :])
            k_lo, k_hi = _nibbles_f16(kb)
            s = tl.dot(qs_lo, tl.trans(k_lo))
            s = tl.dot(qs_hi, tl.trans(k_hi), s)
            s = tl.where(live[None, :], s + cq[:, None], float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            ps = tl.sum(p, 1)
            lsum = lsum * alpha + ps
            gsum = gsum * alpha + ps
            vb = tl.load(vcodes + rows[:, None] * (RV // 2) + cv[None, :])
            v_lo, v_hi = _nibbles_f16(vb)
            ph = p.to(tl.float16)
            acc_lo = acc_lo * alpha[:, None] + tl.dot(ph, v_lo) * wv_lo[None, :]
            acc_hi = acc_hi * alpha[:, None] + tl.dot(ph, v_hi) * wv_hi[None, :]
            acc_c = acc_c * alpha[:, None]
            m = m_new
        vk = tl.load(vk_ptr + (pair * NG + gi) * D + dd)
        acc_c += gsum[:, None] * vk[None, :]

    out = pair * SPLITS + split
    tl.store(m_out + out * GP + g, m)
    tl.store(l_out + out * GP + g, lsum)
    arow = acc_out + (out * GP + g)[:, None] * RV
    tl.store(arow + cv[None, :], acc_lo)
    tl.store(arow + RV // 2 + cv[None, :], acc_hi)
    tl.store(accc_out + (out * GP + g)[:, None] * D + dd[None, :], acc_c)


class LanesPlan:
    """What :func:`lanes_decode` reads of a Lanes batch, made contiguous on its device once (a
    serving loop or a benchmark keeps one per layer and batch)."""

    def __init__(self, lanes: Lanes):
        self.lanes = lanes
        c = lambda t, dt=None: (t if dt is None else t.to(dt)).contiguous()  # noqa: E731
        self.k_codes, self.v_codes = c(lanes.k_codes), c(lanes.v_codes)
        self.k_weight, self.v_weight = c(lanes.k_weight, torch.float32), c(lanes.v_weight, torch.float32)
        self.k_const, self.v_const = c(lanes.k_const, torch.float32), c(lanes.v_const, torch.float32)
        self.k_basis, self.v_basis = c(lanes.k_basis, torch.float32), c(lanes.v_basis, torch.float32)
        self.length = c(lanes.length.to(lanes.k_codes.device), torch.int32)
        N, H, Tp, _ = lanes.k_codes.shape
        self.N, self.H, self.Tp, self.NG = N, H, Tp, Tp // lanes.group
        self.RK, self.RV, self.D = lanes.k_weight.shape[-1], lanes.v_weight.shape[-1], lanes.k_const.shape[-1]


def lanes_decode(q: torch.Tensor, lanes: Lanes | LanesPlan, scale: float, splits: int | None = None,
                 block: int = 64, num_warps: int = 4, num_stages: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [N, Hq, d] (one token per state) over the coded rows of each state in
    ``lanes`` (sinks not included; kite.kernels.lanes.lanes_partial adds them): (out [N, Hq, d],
    lse [N, Hq]) float32. ``splits``: programs a KV head's groups are cut into (default: enough
    programs for the GPU); ``block``: rows a tile (divides the group size)."""
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
    qh = q.float().view(N, H, G, D) * (scale * LOG2E)
    qk = (qh @ plan.k_basis.transpose(-1, -2)).contiguous()                         # [N, H, G, RK]
    cq = (qh @ plan.k_const.transpose(-1, -2)).transpose(-1, -2).contiguous()       # [N, H, NG, G]
    P = N * H * splits
    m = torch.empty(P, GP, device=q.device, dtype=torch.float32)
    lsum = torch.empty_like(m)
    acc = torch.empty(P, GP, RV, device=q.device, dtype=torch.float32)
    accc = torch.empty(P, GP, D, device=q.device, dtype=torch.float32)
    _lanes_kernel[(N * H, splits)](qk, cq, plan.k_codes, plan.k_weight, plan.v_codes, plan.v_weight, plan.v_const,
                                   plan.length, m, lsum, acc, accc, H=H, G=G, GP=GP, NG=NG, GROUP=group, RK=RK,
                                   RV=RV, D=D, BT=block, SPLITS=splits, num_warps=num_warps, num_stages=num_stages)
    # merge the splits (base-2 log-sum-exp), then one projection on the value basis
    m = m.view(N, H, splits, GP)[..., :G]
    lsum = lsum.view(N, H, splits, GP)[..., :G]
    top = m.max(dim=2, keepdim=True).values
    w = torch.exp2(m - top)                                                         # [N, H, S, G]
    total = (w * lsum).sum(dim=2)                                                   # [N, H, G]
    lane = (w[..., None] * acc.view(N, H, splits, GP, RV)[:, :, :, :G]).sum(dim=2)  # [N, H, G, RV]
    const = (w[..., None] * accc.view(N, H, splits, GP, D)[:, :, :, :G]).sum(dim=2)
    out = (lane @ plan.v_basis + const) / total.clamp_min(1e-30)[..., None]
    lse = (top[:, :, 0] + torch.log2(total)) / LOG2E
    lse = torch.where(total > 0, lse, torch.full_like(lse, float("-inf")))
    return out.reshape(N, Hq, D), lse.reshape(N, Hq)
