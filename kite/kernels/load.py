"""Split load of PCA-coded parts (:mod:`kite.upcycle.gpu_load`), CUDA or torch fallback.

The parts' coefficients are the codec's layout (:mod:`kite.upcycle.codec`): coefficient column j
has its own bit width; columns of one width form a class whose codes were packed together
(per column, groups of ``gs`` tokens, fp16 scale and minimum per group), classes in ascending
width order. :func:`pca_coefs` dequantizes the coefficient columns of several parts into one
matrix; after the caller's matmul with the basis, :func:`pca_finish` adds the mean, puts back the
raw sink rows and writes the keys or values into rows of a cache tensor [H, T_out, d] (fp32 /
bf16 / fp16), RoPE applied at those rows' positions.
"""

from __future__ import annotations

import torch

from kite.kernels import native

__all__ = ["pca_coefs", "pca_coefs_torch", "pca_finish", "pca_finish_torch"]

_OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _rope_rows(X: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
    """X [H, n, d] rotated by RoPE at `rows` of cos/sin [T, d] (rotate-half layout); X when cos is None."""
    if cos is None:
        return X
    c, s = cos[rows].float(), sin[rows].float()
    half = X.shape[-1] // 2
    return X * c + torch.cat((-X[..., half:], X[..., :half]), dim=-1) * s


# ---------------------------------------------------------------------------------------------
# split load (kite.upcycle.gpu_load): dequantize coefficient columns -> matmul -> finish


def _f16_at(base: torch.Tensor, off: int, n: int) -> torch.Tensor:
    """n fp16 values at byte offset off of a uint8 tensor (any alignment)."""
    return base[off:off + 2 * n].clone().view(torch.float16)


def pca_coefs(base: torch.Tensor, tab: torch.Tensor, max_T: int, col_bits: torch.Tensor, col_bitoff: torch.Tensor,
              col_goff: torch.Tensor, out: torch.Tensor, *, tab_host=None) -> torch.Tensor:
    """Dequantize the coefficient columns of P parts held in ``base`` (uint8) into ``out`` [R, >= rows].

    ``tab`` int64 [P, 6]: row0, T, gs, codes_off, scale_off, min_off (bytes from ``base``'s start);
    ``col_bits`` uint8 [R]; ``col_bitoff`` / ``col_goff`` int64 [P, R]: column j of part p starts at
    bit col_bitoff[p, j] of the part's codes and group col_goff[p, j] of its scales / minimums
    (the codec's layout, as ``kite.upcycle.gpu_load`` works it out). Token t of part p lands in
    column row0 + t of out.
    ``tab_host``: the same table as a list (spares the torch fallback a device read).
    """
    R = out.shape[0]
    lib = native.lib_for(out) if out.is_cuda else None
    if lib is None or out.dtype not in _OUT_DTYPES or out.stride(1) != 1:
        return pca_coefs_torch(base, tab, col_bits, col_bitoff, col_goff, out, tab_host=tab_host)
    rc = lib.kite_cuda_pca_coefs(base.data_ptr(), tab.shape[0], tab.data_ptr(), max_T, R, col_bits.data_ptr(),
                                 col_bitoff.data_ptr(), col_goff.data_ptr(), out.data_ptr(), out.stride(0),
                                 _OUT_DTYPES[out.dtype], torch.cuda.current_stream(out.device).cuda_stream)
    native.check(rc, "pca_coefs")
    return out


def pca_coefs_torch(base, tab, col_bits, col_bitoff, col_goff, out, *, tab_host=None) -> torch.Tensor:
    rows = tab_host if tab_host is not None else tab.tolist()
    dev = out.device
    bits = col_bits.to(dev).long()
    c8 = base.to(dev).long()
    for p, (row0, T, gs, co, so, mo) in enumerate(rows):
        if T == 0 or out.shape[0] == 0:
            continue
        t = torch.arange(T, device=dev)
        bitpos = co * 8 + col_bitoff[p].to(dev)[:, None] + t[None, :] * bits[:, None]     # [R, T]
        byte, sh = bitpos >> 3, bitpos & 7
        v = c8[byte] | (c8[(byte + 1).clamp_max(c8.numel() - 1)] << 8)
        q = (v >> sh) & ((1 << bits[:, None]) - 1)
        g = col_goff[p].to(dev)[:, None] + t[None, :] // gs
        n = int(g.max()) + 1
        sc, mn = _f16_at(base, so, n).to(dev).float(), _f16_at(base, mo, n).to(dev).float()
        out[:, row0:row0 + T] = (mn[g] + sc[g] * q.float()).to(out.dtype)
    return out


def pca_finish(out: torch.Tensor, Y: torch.Tensor, mean: torch.Tensor, D: int, *, dest: torch.Tensor | None = None,
               ovr: torch.Tensor | None = None, ovr_host=None, base: torch.Tensor | None = None,
               cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """out [H, T_out, d] rows dest[t] (< 0: skipped; None: t) = RoPE(Y[t] + mean), sinks from ``base``.

    ``Y``: [T, D] (one block of D = H*d dims) or [B, T, D] (blocks of D dims), float32 / bf16 / fp16;
    ``mean`` float32 [H*d]; ``ovr`` int64 [n, 4]: token, byte offset in ``base`` of its part's fp16
    sink rows [H, n_part, d], n_part, index; ``cos`` / ``sin`` float32 [T_out, d] (None: no RoPE).
    """
    H, T_out, d = out.shape
    if Y.dim() == 2:
        T, sB, sT = Y.shape[0], 0, Y.stride(0)
    else:
        T, sB, sT = Y.shape[1], Y.stride(0), Y.stride(1)
    lib = native.lib_for(out) if out.is_cuda else None
    if (lib is None or out.dtype not in _OUT_DTYPES or Y.dtype not in _OUT_DTYPES or Y.stride(-1) != 1
            or not out.is_contiguous()):
        return pca_finish_torch(out, Y, mean, D, dest=dest, ovr=ovr, ovr_host=ovr_host, base=base, cos=cos, sin=sin)
    n_ovr = 0 if ovr is None else ovr.shape[0]
    rc = lib.kite_cuda_pca_finish(T, H, d, D, Y.data_ptr(), _OUT_DTYPES[Y.dtype], sB, sT, mean.data_ptr(),
                                  native.ptr(dest), T_out, n_ovr, native.ptr(ovr) if n_ovr else None,
                                  native.ptr(base), native.ptr(cos), native.ptr(sin), out.data_ptr(),
                                  _OUT_DTYPES[out.dtype], torch.cuda.current_stream(out.device).cuda_stream)
    native.check(rc, "pca_finish")
    return out


def pca_finish_torch(out, Y, mean, D: int, *, dest=None, ovr=None, ovr_host=None, base=None, cos=None, sin=None):
    H, T_out, d = out.shape
    Yf = Y.float() if Y.dim() == 2 else Y.float().permute(1, 0, 2).reshape(Y.shape[1], -1)
    T = Yf.shape[0]
    flat = Yf + mean.float().to(Yf.device)
    rows_ovr = ovr_host if ovr_host is not None else (ovr.tolist() if ovr is not None else [])
    if rows_ovr:
        flat = flat.clone()
        for t, off, n, k in rows_ovr:
            x = _f16_at(base, off, H * n * d).view(H, n, d)[:, k, :]
            flat[t] = x.reshape(-1).float().to(flat.device)
    X = flat.view(T, H, d).permute(1, 0, 2)                                   # [H, T, d]
    rows = dest if dest is not None else torch.arange(T, device=out.device)
    keep = rows >= 0
    X, rows = X[:, keep], rows[keep]
    out[:, rows] = _rope_rows(X, rows, cos, sin).to(out.dtype)
    return out
