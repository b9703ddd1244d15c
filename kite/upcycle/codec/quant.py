"""Integer / float quantization with exact byte accounting.

* :func:`quantize` / :func:`dequantize`: group-wise asymmetric integer quantization
  (``x ~= mn + scale * q``, ``q`` in ``[0, 2**bits - 1]``), groups of ``group_size`` consecutive
  elements along one axis of a 2-D view (``axis=-1``: groups run along the last dimension, e.g.
  per token across channels -- KIVI's value layout; ``axis=-2``: groups run along the
  second-to-last dimension, e.g. per channel across tokens -- KIVI's key layout).  Scale and
  minimum are stored in fp16 and the codes are computed against the *stored* fp16 values, so
  dequantization is exactly what the encoder assumed.  ``range_mode="mse"`` picks each group's
  grid (step and offset) among Gaussian-optimal steps and min/max by least squared error, which
  at 1-3 bits is far better than min/max (2 bits on Gaussian data: ~0.12 vs ~0.3 of the variance).
* fp8 (``torch.float8_e4m3fn``) with an fp32 scale per group, and plain fp16 / bf16 / fp32 casts.

Every quantized tensor is a :class:`QTensor`: a dict of tensors plus a small JSON-able meta, with
``nbytes`` = the sum of its tensors' bytes (meta counted by the caller that serializes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kite.kernels.quant import dequantize_groups, quantize_groups

__all__ = [
    "INT_FORMATS", "FLOAT_FORMATS", "QTensor", "quantize", "dequantize", "tensors_nbytes", "grouped", "ungroup",
]

INT_FORMATS = {"int8": 8, "int7": 7, "int6": 6, "int5": 5, "int4": 4, "int3": 3, "int2": 2, "int1": 1}
FLOAT_FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                 "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0


def tensors_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass
class QTensor:
    """A quantized tensor: ``tensors`` (compact dtypes) + ``meta`` (fmt, shape, grouping)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return tensors_nbytes(self.tensors)


def grouped(x: torch.Tensor, group_size: int, axis: int) -> tuple[torch.Tensor, tuple]:
    """View ``x`` as [G, group] groups along ``axis`` (-1 or -2 of a >=2-D tensor; 1-D uses -1).

    Returns the [G, gs] matrix and what :func:`ungroup` needs.  Pads with the group's last
    element (replicate) so padding never widens a group's range.
    """
    if x.dim() == 1:
        x = x[None]
    if axis in (-2, x.dim() - 2):
        x = x.transpose(-1, -2)
        transposed = True
    else:
        transposed = False
    shape = x.shape  # [..., A, B]: groups along B
    B = shape[-1]
    gs = B if group_size <= 0 or group_size >= B else group_size
    pad = (-B) % gs
    m = x.reshape(-1, B)
    if pad:
        m = torch.cat([m, m[:, -1:].expand(-1, pad)], dim=1)
    return m.reshape(-1, gs), (shape, transposed, gs, pad)


def ungroup(g: torch.Tensor, info, orig_shape) -> torch.Tensor:
    shape, transposed, gs, pad = info
    B = shape[-1]
    m = g.reshape(-1, B + pad)[:, :B].reshape(shape)
    if transposed:
        m = m.transpose(-1, -2)
    return m.reshape(orig_shape)


def quantize(x: torch.Tensor, fmt: str, group_size: int = 0, axis: int = -1,
             range_mode: str = "minmax") -> QTensor:
    """Quantize ``x`` (float) to ``fmt`` (``int1..int8``, ``fp8``, ``fp16``, ``bf16``, ``fp32``).

    ``group_size`` <= 0 means one group per row along ``axis``.  Float casts ignore grouping
    except fp8, which uses one fp32 scale per group.
    """
    shape = list(x.shape)
    meta = {"fmt": fmt, "shape": shape}
    if fmt in ("fp32", "fp16", "bf16"):
        return QTensor({"data": x.to(FLOAT_FORMATS[fmt]).contiguous()}, meta)
    xf = x.float()
    g, info = grouped(xf, group_size, axis)
    meta.update(group_size=info[2], axis=-2 if info[1] else -1)
    if fmt == "fp8":
        amax = g.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        scale = (amax / FP8_MAX).float()
        q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QTensor({"data": q.contiguous(), "scale": scale.reshape(-1).contiguous()}, meta)
    if fmt not in INT_FORMATS:
        raise ValueError(f"unknown format {fmt!r}")
    bits = INT_FORMATS[fmt]
    # The arithmetic (fp16 minimum and scale, codes against the stored values, LSB-first packing;
    # "mse": the least-squared-error grid among Gaussian-optimal steps and min/max) lives in
    # kite.kernels.quant: native when libkite_runtime.so is built, torch otherwise.
    codes, scale, mn = quantize_groups(g, bits, range_mode if bits < 8 else "minmax")
    meta.update(n=g.numel(), padded_cols=g.shape[1])
    return QTensor({"codes": codes, "scale": scale, "min": mn}, meta)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    meta, t = q.meta, q.tensors
    fmt, shape = meta["fmt"], tuple(meta["shape"])
    if fmt in ("fp32", "fp16", "bf16"):
        return t["data"].to(dtype)
    # rebuild the grouping of a tensor of this shape
    probe = torch.empty(shape, device="meta") if len(shape) else torch.empty(1, device="meta")
    _, info = grouped(probe, meta["group_size"], meta["axis"])
    if fmt == "fp8":
        g = t["data"].float() * t["scale"].float()[:, None]
    else:
        gs = info[2]
        g = dequantize_groups(t["codes"], meta["n"] // gs, gs, INT_FORMATS[fmt], t["scale"], t["min"])
    return ungroup(g, info, shape).to(dtype)
