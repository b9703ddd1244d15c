"""RMSNorm in one Triton kernel, optionally with the residual add before it.

transformers' RMSNorm of the Llama family is about six kernels a call (a cast, pow, mean, add +
rsqrt, mul, cast, mul by the weight), and a decoder layer adds its residual in one more; in a
first forward of 16 tokens each of them is a launch that moves a few hundred KB. Here one program
per row reads the row once and writes the normalized row (and, with a residual, the sum too).

Rounding follows transformers' module: the sum rounded to the activations' dtype, the row normalized
in fp32, rounded, then multiplied by the weight and rounded again, so outputs equal the module's up to
the order of the row's sum of squares. Triton's interpreter (TRITON_INTERPRET=1) runs it on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, d_ptr, w_ptr, res_ptr, out_ptr, sx, sd, sr, so, N, eps,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        delta = tl.load(d_ptr + row * sd + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * sr + cols, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    xn = (xf * (1.0 / tl.sqrt(var + eps))).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + cols, (w * xn).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` [..., N] with ``weight`` [N] (the dtype of ``x``). With ``residual``: the
    normalized ``residual + x`` and that sum, as ``(sum, normalized)``."""
    shape, n = x.shape, x.shape[-1]
    xs = _rows(residual if residual is not None else x)
    out = torch.empty(xs.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    warps = 4 if block <= 2048 else 8
    if residual is None:
        _rms_norm_kernel[(xs.shape[0],)](xs, xs, weight, out, out, xs.stride(0), 0, 0, out.stride(0), n, eps,
                                         HAS_DELTA=False, BLOCK=block, num_warps=warps)
        return out.view(shape)
    ds = _rows(x)
    total = torch.empty_like(out)
    _rms_norm_kernel[(xs.shape[0],)](xs, ds, weight, total, out, xs.stride(0), ds.stride(0), total.stride(0),
                                     out.stride(0), n, eps, HAS_DELTA=True, BLOCK=block, num_warps=warps)
    return total.view(shape), out.view(shape)
