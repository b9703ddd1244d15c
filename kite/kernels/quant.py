"""Group-wise asymmetric int quantization of a [G, gs] group matrix, native or torch.

Bit-for-bit the arithmetic of :func:`kite.upcycle.quant.quantize` on its grouped view (``minmax``;
``mse`` picks the same grid up to the summation order of each group's mean and std):
fp16 minimum and scale, codes against the stored fp16 values, codes packed LSB first into
``ceil(G * gs * bits / 8)`` bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from kite.kernels import native

__all__ = ["quantize_groups", "quantize_plan", "quantize_plan_torch", "dequantize_groups", "quantize_groups_torch",
           "dequantize_groups_torch"]

GAUSS_STEP = {1: 1.596, 2: 0.9957, 3: 0.5860, 4: 0.3352, 5: 0.1881, 6: 0.1041, 7: 0.0569, 8: 0.0308}
MSE_GRID = (0.6, 0.75, 0.9, 1.0, 1.15, 1.35, 1.6, 2.0)
_MODES = {"minmax": 0, "mse": 1}


def _check(bits: int, range_mode: str) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8, got {bits}")
    if range_mode not in _MODES:
        raise ValueError(f"range_mode must be minmax or mse, got {range_mode!r}")


def quantize_groups(g: torch.Tensor, bits: int, range_mode: str = "minmax"):
    """Quantize each row of ``g`` [G, gs] (float32) -> (packed uint8, scale fp16 [G], min fp16 [G]).

    On a GPU the native kernel needs ``gs * bits % 8 == 0`` (each group owns whole bytes);
    otherwise torch runs.
    """
    _check(bits, range_mode)
    lib = native.lib_for(g)
    G, gs = g.shape
    if lib is None or (g.is_cuda and (gs * bits) % 8):
        return quantize_groups_torch(g, bits, range_mode)
    g = g.float().contiguous()
    packed = torch.empty((G * gs * bits + 7) // 8, dtype=torch.uint8, device=g.device)
    scale = torch.empty(G, dtype=torch.float16, device=g.device)
    mn = torch.empty(G, dtype=torch.float16, device=g.device)
    args = [g.data_ptr(), G, gs, bits, _MODES[range_mode], packed.data_ptr(), scale.data_ptr(), mn.data_ptr()]
    if g.is_cuda:
        rc = lib.kite_cuda_quantize_groups(*args, native.stream(g))
    else:
        rc = lib.kite_quantize_groups(*args)
    native.check(rc, "quantize_groups")
    return packed, scale, mn


def quantize_plan(src: torch.Tensor, row_bits: torch.Tensor, base_bit: torch.Tensor, base_sc: torch.Tensor,
                  groups: torch.Tensor, range_mode: str, n_bytes: int, n_scales: int, *, whole_bytes: bool,
                  deq: torch.Tensor | None = None):
    """Quantize many rows of ``src`` [N, M] (float32), each at its own bit width, into one buffer laid out
    by the caller: the batched encoder's one launch per side (no host planning between the bit
    allocation and the codes).

    ``row_bits`` [N] int64 (0: the row is not stored); ``groups`` [n_g, 4] int64 rows of (part c, group
    g of the part, first column, size gs); group (r, j) is quantized as :func:`quantize_groups` would
    (``range_mode`` below 8 bits, min/max at 8), its codes packed LSB first from bit
    ``base_bit[r, c] + g * gs * bits`` of the returned bytes, its fp16 scale and minimum at index
    ``base_sc[r, c] + g``; every group must lie inside ``src``'s columns (the kernel does not check).
    ``whole_bytes``: every gs is a multiple of 8 (each group starts on a byte and owns whole bytes);
    otherwise groups share bytes. ``n_bytes`` / ``n_scales``: the buffers'
    sizes (an upper bound will do). ``deq`` (optional, float32 [N, M]): receives the dequantized
    values (``min + scale * code``) at the quantized positions.

    Returns (packed uint8 [n_bytes], scale fp16 [n_scales], min fp16 [n_scales]). All on ``src``'s
    device: the CUDA kernel when built, else :func:`quantize_plan_torch`.
    """
    _check(1, range_mode)
    lib = native.lib_for(src)
    dev = src.device
    packed = (torch.empty if whole_bytes else torch.zeros)(n_bytes + 8, dtype=torch.uint8, device=dev)
    scale = torch.empty(max(1, n_scales), dtype=torch.float16, device=dev)
    mn = torch.empty(max(1, n_scales), dtype=torch.float16, device=dev)
    if lib is None or not src.is_cuda:
        quantize_plan_torch(src, row_bits, base_bit, base_sc, groups, range_mode, packed, scale, mn, deq)
    else:
        src = src.float().contiguous()
        if deq is not None and (deq.dtype != torch.float32 or not deq.is_contiguous() or deq.shape != src.shape):
            raise ValueError("deq must be a contiguous float32 tensor shaped like src")
        ints = [t.to(torch.int64).contiguous() for t in (row_bits, base_bit, base_sc, groups)]
        native.check(lib.kite_cuda_quantize_plan(
            src.data_ptr(), src.shape[1], src.shape[0], ints[0].data_ptr(), ints[1].data_ptr(), ints[2].data_ptr(),
            base_bit.shape[1], ints[3].data_ptr(), groups.shape[0], _MODES[range_mode], 0 if whole_bytes else 1,
            packed.data_ptr(), scale.data_ptr(), mn.data_ptr(), deq.data_ptr() if deq is not None else None,
            src.shape[1], native.stream(src)), "quantize_plan")
    return packed[:n_bytes], scale[:n_scales], mn[:n_scales]


def quantize_plan_torch(src, row_bits, base_bit, base_sc, groups, range_mode, packed, scale, mn, deq=None) -> None:
    """:func:`quantize_plan` by classes of (bit width, group size): gather, :func:`quantize_groups`
    (native on the CPU), then scatter to the planned places (reads the tables on the host)."""
    dev = src.device
    rb, grp = row_bits.cpu(), groups.cpu()
    b_bit, b_sc = base_bit.cpu(), base_sc.cpu()
    out = packed.cpu().numpy() if packed.is_cuda else packed.numpy()
    for w in sorted(set(rb.unique().tolist()) - {0}):
        rows = torch.nonzero(rb == w).flatten()
        mode = range_mode if w < 8 else "minmax"
        for gs in sorted(set(grp[:, 3].tolist())):
            c, g, col = grp[grp[:, 3] == gs, :3].unbind(1)
            cols = (col[:, None] + torch.arange(gs)).reshape(-1)
            x = src.index_select(0, rows.to(dev)).index_select(1, cols.to(dev)).float().reshape(-1, gs)
            p, sc, m = quantize_groups(x, w, mode)
            at = (b_sc[rows][:, c] + g).reshape(-1).to(dev)
            scale[at], mn[at] = sc.to(dev), m.to(dev)
            bit = (b_bit[rows][:, c] + g * gs * w).reshape(-1).numpy()
            if (gs * w) % 8 == 0:   # whole bytes per group
                per = gs * w // 8
                out[(bit // 8)[:, None] + np.arange(per)] = p.cpu().numpy().reshape(-1, per)
            else:                    # a code may straddle bytes shared with the next group
                pos = (bit[:, None] + np.arange(gs) * w).reshape(-1)
                v = _unpack(p.cpu(), w, x.numel()).numpy().astype(np.uint32) << (pos & 7).astype(np.uint32)
                np.bitwise_or.at(out, pos >> 3, (v & 255).astype(np.uint8))
                np.bitwise_or.at(out, (pos >> 3) + 1, (v >> 8).astype(np.uint8))
            if deq is not None:
                d = dequantize_groups(p, x.shape[0], gs, w, sc, m).view(rows.numel(), -1)
                deq[rows.to(dev)[:, None], cols.to(dev)[None, :]] = d.to(dev)
    if packed.is_cuda:
        packed.copy_(torch.from_numpy(out))


def dequantize_groups(packed: torch.Tensor, G: int, gs: int, bits: int, scale: torch.Tensor,
                      mn: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`: float32 [G, gs] = min + scale * code."""
    _check(bits, "minmax")
    # the native kernel reads G * gs codes and G scales and minimums wherever the pointers lead:
    # never hand it buffers shorter than that (a damaged or crafted state would make it read past them)
    if G < 0 or gs < 0 or packed.dtype != torch.uint8 or packed.numel() < -(-G * gs * bits // 8) \
            or scale.dtype != torch.float16 or mn.dtype != torch.float16 or scale.numel() < G or mn.numel() < G:
        raise ValueError(f"dequantize_groups: {G} groups of {gs} {bits}-bit codes need {-(-G * gs * bits // 8)} "
                         f"code bytes and {G} fp16 scales and minimums; got {packed.numel()} {packed.dtype}, "
                         f"{scale.numel()} {scale.dtype}, {mn.numel()} {mn.dtype}")
    lib = native.cpu() if not packed.is_cuda else None
    if lib is None:
        return dequantize_groups_torch(packed, G, gs, bits, scale, mn)
    out = torch.empty(G, gs, dtype=torch.float32)
    packed, scale, mn = packed.contiguous(), scale.contiguous(), mn.contiguous()
    native.check(lib.kite_dequantize_groups(packed.data_ptr(), G, gs, bits, scale.data_ptr(), mn.data_ptr(),
                                            out.data_ptr()), "dequantize_groups")
    return out


# -------------------------------------------------------------------------------------------
# pure torch (the fallback, and the reference the tests compare with)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    c = codes.reshape(-1).to(torch.int32)
    if bits == 8:
        return c.to(torch.uint8)
    b = ((c[:, None] >> torch.arange(bits, dtype=torch.int32, device=c.device)) & 1).reshape(-1)
    pad = (-b.numel()) % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    b = b.view(-1, 8) << torch.arange(8, dtype=torch.int32, device=c.device)
    return b.sum(dim=1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    if bits == 8:
        return packed.reshape(-1)[:n].to(torch.int32)
    p = packed.reshape(-1).to(torch.int32)
    b = ((p[:, None] >> torch.arange(8, dtype=torch.int32, device=p.device)) & 1).reshape(-1)
    b = b[: n * bits].view(n, bits) << torch.arange(bits, dtype=torch.int32, device=p.device)
    return b.sum(dim=1)


def _codes(g, mn, st, levels):
    safe = torch.where(st > 0, st, torch.ones_like(st))
    return torch.round((g - mn) / safe).clamp(0, levels)


def quantize_groups_torch(g: torch.Tensor, bits: int, range_mode: str = "minmax"):
    _check(bits, range_mode)
    g = g.float()
    levels = (1 << bits) - 1
    if range_mode == "mse" and bits < 8:
        mu = g.mean(dim=1, keepdim=True)
        sd = g.std(dim=1, keepdim=True, unbiased=False)
        mn_mm = g.amin(dim=1, keepdim=True)
        cand_st = [sd * GAUSS_STEP[bits] * f for f in MSE_GRID]
        cand_mn = [mu - st * (levels / 2) for st in cand_st]
        cand_st.append((g.amax(dim=1, keepdim=True) - mn_mm) / levels)
        cand_mn.append(mn_mm)
        best = None
        for mn, st in zip(cand_mn, cand_st):
            mn, st = mn.to(torch.float16).float(), st.to(torch.float16).float()
            q = _codes(g, mn, st, levels)
            err = (mn + q * st - g).pow(2).sum(dim=1, keepdim=True)
            if best is None:
                best = [err, mn, st, q]
                continue
            better = err < best[0]
            best = [torch.where(better, err, best[0]), torch.where(better, mn, best[1]),
                    torch.where(better, st, best[2]), torch.where(better, q, best[3])]
        _, mn, st, q = best
        return _pack(q, bits), st.to(torch.float16).reshape(-1), mn.to(torch.float16).reshape(-1)
    mn16 = g.amin(dim=1, keepdim=True).to(torch.float16)
    mx = g.amax(dim=1, keepdim=True)
    s = ((mx - mn16.float()) / levels).to(torch.float16).float()
    s = torch.where((mn16.float() + s * levels) < mx, s * (1 + 2.0 ** -10), s).to(torch.float16)
    sf = s.float()
    q = torch.where(sf > 0, torch.round((g - mn16.float()) / torch.where(sf > 0, sf, 1.0)), 0.0)
    return _pack(q.clamp(0, levels), bits), s.reshape(-1), mn16.reshape(-1)


def dequantize_groups_torch(packed, G: int, gs: int, bits: int, scale, mn) -> torch.Tensor:
    codes = _unpack(packed, bits, G * gs).float().view(G, gs)
    return mn.float()[:, None] + scale.float()[:, None] * codes
