"""The gated MLP's ``silu(gate) * up`` in one Triton kernel (transformers: two, plus the reads and
writes of the intermediate between them). ``gate`` and ``up`` may be column blocks of one
concatenated projection's output. Rounding follows torch: silu rounded to the activations' dtype,
then the product. Triton's interpreter (TRITON_INTERPRET=1) runs it on the CPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, sg, su, so, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(g_ptr + row * sg + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + cols, mask=ok, other=0.0).to(tl.float32)
    dt = o_ptr.dtype.element_ty
    a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(o_ptr + row * so + cols, (a * u).to(dt), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate / up [..., N] of one shape (last dim contiguous, rows any stride)."""
    shape, n = gate.shape, gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)
    if g.stride(-1) != 1:
        g = g.contiguous()
    if u.stride(-1) != 1:
        u = u.contiguous()
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    _silu_mul_kernel[(g.shape[0], triton.cdiv(n, BLOCK))](g, u, out, g.stride(0), u.stride(0), out.stride(0), n,
                                                         BLOCK=BLOCK, num_warps=4)
    return out.view(shape)
