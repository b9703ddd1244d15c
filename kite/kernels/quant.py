"""Group-wise asymmetric int quantization of a [G, gs] group matrix, native or torch.

Bit-for-bit the arithmetic of :func:`kite.upcycle.quant.quantize` on its grouped view (``minmax``;
``mse`` picks the same grid up to the summation order of each group's mean and std):
fp16 minimum and scale, codes against the stored fp16 values, codes packed LSB first into
``ceil(G * gs * bits / 8)`` bytes.
"""

from __future__ import annotations

import torch

from kite.kernels import native

__all__ = ["quantize_groups", "quantize_rows", "dequantize_groups", "quantize_groups_torch",
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


def quantize_rows(src: torch.Tensor, rows: torch.Tensor, col0: int, col1: int, gs: int, bits: int,
                  range_mode: str = "minmax"):
    """:func:`quantize_groups` of ``src[rows, col0:col1]`` cut into groups of ``gs`` columns (row by
    row), without gathering the rows first on a GPU (the native kernel reads them in place).

    ``src`` [N, M] float32, ``rows`` int64 indices on its device, ``col1 - col0`` a multiple of gs.
    """
    _check(bits, range_mode)
    if (col1 - col0) % gs or not 0 <= col0 <= col1 <= src.shape[1]:
        raise ValueError(f"columns [{col0}, {col1}) of {src.shape[1]} do not split into groups of {gs}")
    lib = native.lib_for(src)
    if (lib is None or not src.is_cuda or (gs * bits) % 8 or src.dtype != torch.float32
            or src.stride(1) != 1 or rows.numel() == 0 or col1 == col0):
        return quantize_groups(src[:, col0:col1].index_select(0, rows).reshape(-1, gs), bits, range_mode)
    rows = rows.to(torch.int64).contiguous()
    G = rows.numel() * ((col1 - col0) // gs)
    packed = torch.empty((G * gs * bits + 7) // 8, dtype=torch.uint8, device=src.device)
    scale = torch.empty(G, dtype=torch.float16, device=src.device)
    mn = torch.empty(G, dtype=torch.float16, device=src.device)
    native.check(lib.kite_cuda_quantize_rows(src.data_ptr(), src.stride(0), rows.data_ptr(), rows.numel(), col0,
                                             (col1 - col0) // gs, gs, bits, _MODES[range_mode], packed.data_ptr(),
                                             scale.data_ptr(), mn.data_ptr(), native.stream(src)), "quantize_rows")
    return packed, scale, mn


def dequantize_groups(packed: torch.Tensor, G: int, gs: int, bits: int, scale: torch.Tensor,
                      mn: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`: float32 [G, gs] = min + scale * code."""
    _check(bits, "minmax")
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
