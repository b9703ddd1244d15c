"""Bit allocation of the PCA codec: how many bits each principal component gets.

Greedy reverse water-filling on the eigenvalues: every next bit goes to the component where it
removes the most expected squared error per stored bit (the first bit of a component also pays for
its basis column and its scales), until the layer's budget (:func:`layer_budget_bits`) is spent.
High-variance components get many bits, the tail gets none. The budget counts every stored byte,
so ``ratio=R`` lands at about ``16 / R`` bits per element, i.e. ``1/R`` of the raw fp16 KV.

:func:`allocate_bits` is the heap on the host (the per-layer codec); :func:`allocate_bits_batched`
gives the same allocation for many layers at once as a sort, on any device, without a host sync
(the batched encoder).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from kite.kernels.streams import const
from kite.upcycle.codec.quant import INT_FORMATS
from kite.upcycle.codec.settings import CodecSettings
from kite.upcycle.format.bitlayout import group_shape

# expected squared error of a b-bit min/max uniform quantizer on ~Gaussian data, relative to the
# variance (b = 0: the component is dropped).  Range of a group of ~128 samples is ~5.2 sigma.
GAUSS_D = {0: 1.0, 1: 0.3634, 2: 0.1188, 3: 0.03744, 4: 0.01154, 5: 0.00349, 6: 0.00105,
            7: 0.000307, 8: 0.0000881}


def rel_distortion(b: int, range_mode: str = "mse") -> float:
    """Expected squared error of ``b`` bits relative to the component's variance (1 when dropped)."""
    if b <= 0:
        return 1.0
    if range_mode == "mse":
        return GAUSS_D[min(b, 8)]
    return min(1.0, (5.2 ** 2 / 12.0) * 4.0 ** (-b))


def part_costs(parts, group_size: int, even: bool = False) -> tuple[int, int]:
    """(codes, groups) one bit of a component stores over parts of these token counts: each part's
    tokens padded to whole groups (:func:`kite.upcycle.format.bitlayout.group_shape`), and its groups
    (an fp16 scale and minimum each, paid by the component's first bit)."""
    codes = groups = 0
    for n in parts:
        gs, padded = group_shape(int(n), group_size, even)
        codes += padded
        groups += padded // gs if gs else 0
    return codes, groups


def component_costs(T: int, s: CodecSettings, parts=None) -> tuple[int, int]:
    """(codes, groups) of one component of a side of T tokens: exact for the parts' token counts
    ``parts`` (their sum is T), else as expected for parts of ``part_tokens`` (codes = T: no padding)."""
    if parts is not None:
        return part_costs(parts, s.group_size, s.even_groups)
    n_parts = max(1, math.ceil(T / max(1, s.part_tokens)))
    per_part = min(T, s.part_tokens)
    gs = s.group_size if 0 < s.group_size < per_part else per_part
    return T, n_parts * math.ceil(per_part / max(1, gs))


def basis_column_bits(d_in: int, s: CodecSettings) -> float:
    """Bits a stored basis column of ``d_in`` entries takes (with its scale when int)."""
    if s.basis_fmt in INT_FORMATS:
        return d_in * (INT_FORMATS[s.basis_fmt] + 32 / d_in)
    return d_in * {"fp32": 32, "fp16": 16, "bf16": 16}[s.basis_fmt]


def first_bit_cost(T: int, d_in: int, s: CodecSettings, basis_stored: bool = True, parts=None) -> float:
    """Bits the first bit of a component costs: its codes, a scale and minimum (fp16) per group
    (:func:`component_costs`: of the parts ``parts`` when given, else of the expected parts), and its
    basis column of `d_in` entries (with a scale when int) unless the basis is not stored (a
    regenerator's)."""
    codes, groups = component_costs(T, s, parts)
    return codes + groups * 32 + (basis_column_bits(d_in, s) if basis_stored else 0)


def allocate_bits(evals: torch.Tensor, budget_bits: float, T: int, d_in: int, s: CodecSettings,
                  basis_stored: bool = True, parts=None) -> torch.Tensor:
    """Greedy bit allocation over components of several blocks.

    evals [B, r] (variances, per block; any order); ``budget_bits``: bits available for the
    whole layer tensor (coefficients + scales + basis columns, unless ``basis_stored`` is False).
    ``parts``: the token counts of the parts the side is coded in (the costs exact), else expected.
    Returns int bits [B, r].
    """
    B, r = evals.shape
    first_cost = first_bit_cost(T, d_in, s, basis_stored, parts)
    inc = float(component_costs(T, s, parts)[0])
    bits = torch.zeros(B, r, dtype=torch.int64)
    ev = evals.double().tolist()
    heap = []
    for b in range(B):
        for j in range(r):
            lam = ev[b][j]
            if lam <= 0:
                continue
            gain = lam * (1.0 - rel_distortion(1, s.range_mode)) * T
            heapq.heappush(heap, (-gain / first_cost, b, j, first_cost))
    spent = 0.0
    while heap:
        neg, b, j, cost = heapq.heappop(heap)
        if spent + cost > budget_bits:
            continue  # a cheaper increment elsewhere may still fit
        spent += cost
        cur = int(bits[b, j]) + 1
        bits[b, j] = cur
        if cur < s.max_bits:
            lam = ev[b][j]
            gain = lam * (rel_distortion(cur, s.range_mode) - rel_distortion(cur + 1, s.range_mode)) * T
            heapq.heappush(heap, (-gain / inc, b, j, inc))
    return bits


@dataclass(frozen=True)
class SideBudget:
    """A side's share of a state-wide budget (:mod:`.state_bits`): the bits its components may take
    and the token counts of the parts it is coded in (the costs exact)."""

    bits: float
    parts: tuple[int, ...]


def allocation_cost(bits: torch.Tensor, T: int, d_in: int, s: CodecSettings, parts=None,
                    basis_stored: bool = True) -> float:
    """Bits an allocation ``bits`` [..., r] takes: each coded component's first bit
    (:func:`first_bit_cost`) and its later bits' codes."""
    return float(allocation_costs(bits.cpu().reshape(1, -1), T, d_in, s, parts, basis_stored)[0])


def allocation_costs(bits: torch.Tensor, T: int, d_in: int, s: CodecSettings, parts=None,
                     basis_stored: bool = True) -> torch.Tensor:
    """:func:`allocation_cost` of each of N allocations, ``bits`` [N, ...] -> [N] float64 on bits' device."""
    b = bits.long().flatten(1)
    n_coded = (b > 0).sum(dim=1).double()
    later = (b - 1).clamp_min(0).sum(dim=1).double()
    return n_coded * first_bit_cost(T, d_in, s, basis_stored, parts) + later * component_costs(T, s, parts)[0]


def expected_error(variances: torch.Tensor, bits: torch.Tensor, s: CodecSettings) -> float:
    """The squared error an allocation is expected to leave, summed over components (variance x
    relative distortion of its bits; a dropped component leaves its whole variance)."""
    return float(expected_errors(variances.detach().cpu().reshape(1, -1), bits.detach().cpu().reshape(1, -1), s)[0])


def expected_errors(variances: torch.Tensor, bits: torch.Tensor, s: CodecSettings) -> torch.Tensor:
    """:func:`expected_error` of each of N allocations, ``variances`` and ``bits`` [N, ...] -> [N]
    float64 on their device."""
    table = torch.tensor([rel_distortion(b, s.range_mode) for b in range(s.max_bits + 1)], dtype=torch.float64,
                         device=variances.device)
    v, b = variances.double().clamp_min(0).flatten(1), bits.long().clamp(0, s.max_bits).flatten(1)
    return (v * table[b]).sum(dim=1)


def layer_budget_bits(bits_per_elem: float, H: int, T: int, d: int, B: int, D: int, s: CodecSettings) -> float:
    """Bits one side of a layer may spend on its components: ``bits_per_elem`` of the side's
    ``H * T * d`` elements, less the fixed costs: the mean (fp16) and bit widths of every block, the
    layer header's share, and per expected part (``part_tokens``) a blob header (~160 B) and the
    fp16 sinks of the first part."""
    n_parts = max(1, math.ceil(T / max(1, s.part_tokens)))
    return (bits_per_elem * H * T * d - B * D * (16 + 8) - 8 * 450 - n_parts * 8 * 160
            - s.sink_tokens * H * d * 16)


def allocate_bits_batched(evals: torch.Tensor, budgets, T: int, d_in: int, s: CodecSettings,
                          basis_stored: bool = True, parts=None) -> torch.Tensor:
    """:func:`allocate_bits` for N layers at once: evals [N, B, r], budgets [N] (a list, or a tensor
    that may be on the device) -> int64 bits [N, B, r].

    Same greedy order as the heap (ties aside) and the same skip rules at the budget's edge; runs
    on ``evals``' device.
    """
    N, B, r = evals.shape
    dev = evals.device
    M = s.max_bits
    first = first_bit_cost(T, d_in, s, basis_stored, parts)
    inc = float(component_costs(T, s, parts)[0])
    dist = [rel_distortion(b, s.range_mode) for b in range(M + 1)]
    drop = const([1.0 - dist[1]] + [dist[b] - dist[b + 1] for b in range(1, M)], dev)
    cost = const([first] + [inc] * (M - 1), dev)   # (cost[0] = x on a GPU would wait for the stream)
    lam = evals.double().reshape(N, B * r)
    # the heap's arithmetic: gain = lam * factor * T, priority = gain / cost
    prio = (lam[:, :, None] * drop) * T / cost                          # [N, C, M]
    eff = torch.cummin(prio, dim=2).values                              # bit b never before b-1
    valid = (lam > 0)[:, :, None].expand(N, B * r, M)
    eff = torch.where(valid, eff, torch.full_like(eff, -math.inf)).reshape(N, -1)
    order = torch.sort(eff, dim=1, descending=True, stable=True).indices   # [N, C*M]
    bit_of = order % M                                                  # 0 = the first bit
    comp_of = order // M
    ok_item = torch.gather(valid.reshape(N, -1), 1, order)
    c_sorted = cost[bit_of]
    budgets = (budgets.to(dev, torch.float64) if torch.is_tensor(budgets) else const(budgets, dev)).reshape(N, 1)
    cum = torch.cumsum(c_sorted, dim=1)
    fits = (cum <= budgets) & ok_item
    n_items = fits.shape[1]
    all_fit = fits.all(dim=1)
    k = torch.where(all_fit, torch.full_like(all_fit, n_items, dtype=torch.long),
                    (~fits).long().argmax(dim=1))                       # first item that does not fit
    pos = torch.arange(n_items, device=dev)[None, :]
    taken = pos < k[:, None]
    # after a first bit fails (and only then), the started components' later bits still fit one
    # by one while the budget lasts; after a plain increment fails, nothing fits any more
    k_c = k.clamp_max(n_items - 1)
    first_failed = (~all_fit) & (bit_of.gather(1, k_c[:, None]).squeeze(1) == 0) \
        & ok_item.gather(1, k_c[:, None]).squeeze(1)
    started = torch.zeros(N, B * r, dtype=torch.long, device=dev)
    started.scatter_add_(1, comp_of, (taken & (bit_of == 0)).long())
    started = started > 0
    spent = torch.where(k[:, None] > 0, cum.gather(1, (k - 1).clamp_min(0)[:, None]), torch.zeros_like(budgets))
    cand = first_failed[:, None] & (pos > k[:, None]) & (bit_of > 0) & ok_item & started.gather(1, comp_of)
    cum2 = spent + torch.cumsum(torch.where(cand, c_sorted, torch.zeros_like(c_sorted)), dim=1)
    taken = taken | (cand & (cum2 <= budgets))
    bits = torch.zeros(N, B * r, dtype=torch.int64, device=dev)
    bits.scatter_add_(1, comp_of, taken.long())
    return bits.reshape(N, B, r)
