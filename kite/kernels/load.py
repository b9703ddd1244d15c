"""Fused load of one PCA-coded part: dequantize + reconstruct + re-apply RoPE, native or torch.

The part's coefficients are the codec's layout (:mod:`kite.upcycle.codec`): coefficient column j
has its own bit width; columns of one width form a class whose codes were packed together
(per column, groups of ``gs`` tokens, fp16 scale and minimum per group), classes in ascending
width order. :func:`pca_layout` turns the per-column widths into the bit and group offsets the
kernel reads; :func:`pca_load` writes the rebuilt keys or values [H, T, d] straight into rows of
a cache tensor [H, T_out, d] (fp32 / bf16 / fp16), RoPE applied at those rows' positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kite.kernels import native

__all__ = ["PcaLayout", "pca_layout", "pca_load", "prepare_pca_load", "pca_load_torch", "pca_coefs", "pca_coefs_torch",
           "pca_finish", "pca_finish_torch"]

_OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _rope_rows(X: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
    """X [H, n, d] rotated by RoPE at `rows` of cos/sin [T, d] (rotate-half layout); X when cos is None."""
    if cos is None:
        return X
    c, s = cos[rows].float(), sin[rows].float()
    half = X.shape[-1] // 2
    return X * c + torch.cat((-X[..., half:], X[..., :half]), dim=-1) * s


@dataclass
class PcaLayout:
    """Where each coefficient column's codes and groups are (int64 / uint8 tensors of length R)."""

    col_bits: torch.Tensor
    col_bitoff: torch.Tensor
    col_goff: torch.Tensor
    gs: int

    def to(self, device) -> PcaLayout:
        return PcaLayout(self.col_bits.to(device), self.col_bitoff.to(device), self.col_goff.to(device), self.gs)


def pca_layout(col_bits: list[int] | torch.Tensor, T: int, group_size: int) -> PcaLayout:
    """Offsets of the codec's layout for a part of T tokens (as ``codec._class_layout`` packs it)."""
    bits = [int(b) for b in (col_bits.tolist() if isinstance(col_bits, torch.Tensor) else col_bits)]
    gs = T if group_size <= 0 or group_size >= T else group_size
    gs = max(gs, 1)
    padded = -(-T // gs) * gs if T else 0
    bitoff, goff = [0] * len(bits), [0] * len(bits)
    byte = group = 0
    for bw in sorted(set(bits)):
        cols = [j for j, b in enumerate(bits) if b == bw]
        for c, j in enumerate(cols):
            bitoff[j] = byte * 8 + c * padded * bw
            goff[j] = group + c * (padded // gs)
        n = len(cols) * padded
        byte += (n * bw + 7) // 8
        group += n // gs
    return PcaLayout(torch.tensor(bits, dtype=torch.uint8), torch.tensor(bitoff, dtype=torch.int64),
                     torch.tensor(goff, dtype=torch.int64), gs)


def pca_load(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, layout: PcaLayout,
             blk_off: torch.Tensor, basis_t: torch.Tensor, mean: torch.Tensor, T: int, *,
             dest: torch.Tensor | None = None, override_idx: torch.Tensor | None = None,
             ovr_x: torch.Tensor | None = None, cos: torch.Tensor | None = None,
             sin: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild T tokens of one part into ``out`` [H, T_out, d] and return ``out``.

    ``codes`` uint8, ``scale`` / ``mn`` fp16: the part's blob tensors; ``blk_off`` int64 [B+1]:
    block b owns coefficient columns blk_off[b]:blk_off[b+1] and dims b*D:(b+1)*D of the flat
    H*d layout; ``basis_t`` [R, D] float32; ``mean`` [B, D] float32; ``dest`` int64 [T]: each
    token's row of ``out`` (default: row t); ``override_idx`` int32 [T] (-1: none) with ``ovr_x``
    fp16 [H, n, d]: raw pre-RoPE rows for sinks and outliers; ``cos`` / ``sin`` float32
    [T_out, d] (None: no RoPE). Every tensor on ``out``'s device.
    """
    return prepare_pca_load(out, codes, scale, mn, layout, blk_off, basis_t, mean, T, dest=dest,
                            override_idx=override_idx, ovr_x=ovr_x, cos=cos, sin=sin)()


def prepare_pca_load(out: torch.Tensor, codes, scale, mn, layout: PcaLayout, blk_off, basis_t, mean, T: int, *,
                     dest=None, override_idx=None, ovr_x=None, cos=None, sin=None):
    """:func:`pca_load` as a zero-argument launcher for repeated loads into the same buffers.

    Checks and pointers are worked out once (a native launch then costs one ctypes call, ~5 us,
    instead of ~100 us of Python). The caller keeps every tensor alive and updates them only in
    place. The launcher returns ``out``.
    """
    H, T_out, d = out.shape
    B, D = mean.shape
    R = basis_t.shape[0]
    lib = native.lib_for(out)
    if lib is None or out.dtype not in _OUT_DTYPES or not out.is_contiguous():
        return lambda: pca_load_torch(out, codes, scale, mn, layout, blk_off, basis_t, mean, T, dest=dest,
                                      override_idx=override_idx, ovr_x=ovr_x, cos=cos, sin=sin)
    n_ovr = ovr_x.shape[1] if ovr_x is not None else 0
    keep = [t.contiguous() if t is not None else None
            for t in (codes, scale, mn, basis_t.float(), mean.float(), cos, sin,
                      ovr_x.to(torch.float16) if ovr_x is not None else None)]
    codes, scale, mn, basis_t, mean, cos, sin, ovr = keep
    args = [T, R, B, D, H, d, native.ptr(codes), native.ptr(layout.col_bitoff), native.ptr(layout.col_bits),
            native.ptr(layout.col_goff), layout.gs, native.ptr(scale), native.ptr(mn), native.ptr(blk_off),
            native.ptr(basis_t), native.ptr(mean), native.ptr(dest), T_out, native.ptr(override_idx),
            native.ptr(ovr), n_ovr, native.ptr(cos), native.ptr(sin), out.data_ptr(), _OUT_DTYPES[out.dtype]]

    if out.is_cuda:
        fn, device = lib.kite_cuda_pca_load, out.device

        def launch():
            native.check(fn(*args, torch.cuda.current_stream(device).cuda_stream), "pca_load")
            return out
    else:
        fn = lib.kite_pca_load

        def launch():
            native.check(fn(*args), "pca_load")
            return out
    launch.keep = keep  # the contiguous copies the pointers refer to
    return launch


def pca_load_torch(out, codes, scale, mn, layout: PcaLayout, blk_off, basis_t, mean, T: int, *, dest=None,
                   override_idx=None, ovr_x=None, cos=None, sin=None) -> torch.Tensor:
    H, T_out, d = out.shape
    B, D = mean.shape
    dev = out.device
    bits = layout.col_bits.to(dev).long()
    t = torch.arange(T, device=dev)
    bitpos = layout.col_bitoff.to(dev)[None, :] + t[:, None] * bits[None, :]
    byte, sh = bitpos >> 3, bitpos & 7
    c8 = codes.to(dev).long()
    v = c8[byte] | (c8[(byte + 1).clamp_max(c8.numel() - 1)] << 8)
    q = (v >> sh) & ((1 << bits) - 1)
    g = layout.col_goff.to(dev)[None, :] + t[:, None] // layout.gs
    C = mn.to(dev).float()[g] + scale.to(dev).float()[g] * q.float()          # [T, R]
    Y = torch.empty(T, B * D, dtype=torch.float32, device=dev)
    for b in range(B):
        lo, hi = int(blk_off[b]), int(blk_off[b + 1])
        Y[:, b * D:(b + 1) * D] = C[:, lo:hi] @ basis_t[lo:hi].float() + mean[b].float()
    X = Y.view(T, H, d).permute(1, 0, 2).clone()                             # [H, T, d]
    if override_idx is not None:
        sel = torch.nonzero(override_idx >= 0).flatten()
        if sel.numel():
            X[:, sel] = ovr_x[:, override_idx[sel].long()].float()
    rows = dest if dest is not None else t
    out[:, rows] = _rope_rows(X, rows, cos, sin).to(out.dtype)
    return out


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
    (``kite.kernels.load.pca_layout``'s offsets). Token t of part p lands in column row0 + t of out.
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
