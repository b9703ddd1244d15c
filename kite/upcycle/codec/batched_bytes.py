"""The batched encoder's host side: copies of exactly the bytes written, and the blobs built from
slices of them in the codec blob format (:mod:`kite.upcycle.format.codec_blob`), as the per-layer
codec would write them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kite.kernels.streams import to_host
from kite.upcycle.codec.batched_fit import Fitted
from kite.upcycle.codec.quant import FLOAT_FORMATS, INT_FORMATS
from kite.upcycle.codec.settings import CodecSettings
from kite.upcycle.format import codec_blob


# the host side: copies back and the codec's byte format


@dataclass
class HostSide:
    """One side on the host (numpy; the arrays behind the copies are valid after host_sync)."""

    B: int
    D: int
    bits: np.ndarray          # [L, B, D] int64
    row_bits: np.ndarray      # [L, B*D] int64
    tables: np.ndarray        # [4, L, C, W] the coefficient runs (first byte, bytes, first scale, scales)
    basis_tables: np.ndarray | None   # [4, L, 1, W] the int basis' runs
    mean: np.ndarray = None   # [L, bytes]
    codes: tuple = ()         # (packed, scale, min) as uint8
    basis: tuple = ()         # int formats: (packed, scale, min) as uint8; float formats: (rows,)
    regen: np.ndarray | None = None   # [L] bool: the layer is coded on a regenerator's basis (none stored)

    def rank(self, layer: int) -> int:
        return int((self.row_bits[layer] > 0).sum())


def copy_back(fit: Fitted, codes: tuple, hs: HostSide, done) -> None:
    """Queue one side's host copies of exactly the bytes the tables say it wrote, once ``done``."""
    n_bytes, n_sc = int(hs.tables[1].sum()), int(hs.tables[3].sum())
    packed, scale, mn = codes
    hs.codes = tuple(to_host([packed[:n_bytes], scale[:n_sc].view(torch.uint8), mn[:n_sc].view(torch.uint8)],
                              after=done))
    st = fit.stored
    if hs.basis_tables is not None:
        nb, ns = int(hs.basis_tables[1].sum()), int(hs.basis_tables[3].sum())
        hs.basis = tuple(to_host([st["packed"][:nb], st["scale"][:ns].view(torch.uint8),
                                   st["min"][:ns].view(torch.uint8)], after=done))
    else:
        hs.basis = tuple(to_host([st["rows"].contiguous().view(torch.uint8)], after=done))
    hs.mean = to_host([fit.mean_st.contiguous().view(torch.uint8)], after=done)[0].reshape(fit.shape[0], -1)


def layer_blob(layer: int, sides: dict[str, HostSide], s: CodecSettings, H: int, d: int, T: int) -> bytes:
    """The 'L{layer}' blob (what ``to_bytes`` gives for the layer's LayerCodec)."""
    meta = {"settings": s.to_json(), "H": H, "d": d, "T_fit": T}
    table = []
    for prefix, hs in sides.items():
        B, D, R = hs.B, hs.D, hs.rank(layer)
        table.append((f"{prefix}.mean", "f32" if s.basis_fmt == "fp32" else "f16", [B, D], hs.mean[layer]))
        mode = "pca"
        if hs.regen is not None and hs.regen[layer]:   # RegenSide: the mean, the bits, no basis
            mode = "rpca"
        elif hs.basis_tables is not None:
            first, nbytes, first_sc, nsc = hs.basis_tables[:, layer, 0, INT_FORMATS[s.basis_fmt]]
            packed, scale, mn = hs.basis
            table += [(f"{prefix}.basis.codes", "u8", [int(nbytes)], packed[first:first + nbytes]),
                      (f"{prefix}.basis.scale", "f16", [R], scale[2 * first_sc:2 * (first_sc + nsc)]),
                      (f"{prefix}.basis.min", "f16", [R], mn[2 * first_sc:2 * (first_sc + nsc)])]
            meta[f"{prefix}.basis"] = {"fmt": s.basis_fmt, "shape": [D, R], "group_size": D, "axis": -2,
                                       "n": R * D, "padded_cols": D}
        else:   # the stored columns as a [D, R] matrix
            rows = hs.basis[0].reshape(hs.row_bits.shape[0], B * D, D, -1)[layer][hs.row_bits[layer] > 0]
            dt = FLOAT_FORMATS[s.basis_fmt]
            table.append((f"{prefix}.basis", codec_blob.dtype_name(dt), [D, R],
                          np.ascontiguousarray(rows.transpose(1, 0, 2)).tobytes()))
        b = hs.bits[layer]
        table.append((f"{prefix}.bits", "u8", [B, D], b.astype(np.uint8).tobytes()))
        meta[prefix] = {"mode": mode, "blocks": B, "dim": D, "rank_max": int((b > 0).sum(axis=1).max()) if b.size else 0}
    return codec_blob.encode_rows(meta, table)


def part_blob(layer: int, c: int, Tc: int, prefix: str, hs: HostSide, out_x: dict, forced: torch.Tensor) -> bytes:
    """The part blob of cluster c, one side (what ``to_bytes`` gives for ``encode``'s Blob)."""
    table = []
    if not hs.rank(layer):
        return codec_blob.encode_rows({"T": Tc}, table)
    if (prefix, c) in out_x:
        it = torch.int32 if Tc > 32767 else torch.int16
        table.append(("out.idx", codec_blob.dtype_name(it), [forced.numel()], forced.to(it).numpy().tobytes()))
        xh, shape = out_x[(prefix, c)]
        table.append(("out.x", "f16", list(shape[1:]), xh.reshape(shape[0], -1)[layer]))   # [H, n, d] fp16
    first, nbytes, first_sc, nsc = hs.tables[:, layer, c]     # [W] each: the part's runs, widths ascending
    a, b = int(first[0]), int(first[-1] + nbytes[-1])
    sa, sb = int(first_sc[0]), int(first_sc[-1] + nsc[-1])
    packed, scale, mn = hs.codes
    table += [("codes", "u8", [b - a], packed[a:b]), ("scale", "f16", [sb - sa], scale[2 * sa:2 * sb]),
              ("min", "f16", [sb - sa], mn[2 * sa:2 * sb])]
    return codec_blob.encode_rows({"T": Tc}, table)
