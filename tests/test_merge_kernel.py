"""The in-place merge of a row's slots and its state's part (kite.kernels.merge_triton) against the
torch rule it replaces (kite.kernels.partials.merge): in Triton's interpreter on the CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kite.testing.triton_interpreter import run_interpreted


def _check(device: str, dtype: torch.dtype, tol: float) -> str:
    from kite.kernels.merge_triton import merge_into
    from kite.kernels.partials import merge

    g = torch.Generator().manual_seed(0)
    B, Q, Hq, D = 3, 2, 7, 32
    out = torch.randn(B, Q, Hq, D, generator=g).to(device, dtype)
    lse = torch.randn(B, Hq, Q, generator=g).to(device)
    o = torch.randn(B, Hq, Q, D, generator=g).to(device)
    s = torch.randn(B, Hq, Q, generator=g).to(device) + 2.0
    lse[0, 1, 0] = float("-inf")                 # the slots saw nothing: the state's part alone
    s[1, 2, 1] = float("-inf")                   # the state's part saw nothing: the slots alone
    lse[2, 3, 0] = s[2, 3, 0] = float("-inf")    # neither: zeros
    want, _ = merge([(o, s), (out.transpose(1, 2).float(), lse)])
    want = want.transpose(1, 2).to(dtype)
    # the slots' output as the split-KV kernel leaves it, and the state's part as a strided slice
    wide = torch.randn(B, Hq, Q + 1, D, generator=g).to(device)
    wide[:, :, :Q] = o
    got = merge_into(out.clone(), lse, wide[:, :, :Q], s)
    err = float((got.float() - want.float()).abs().max())
    assert err <= tol, f"{dtype}: max |diff| {err:.3g}"
    assert not got[2, 0, 3].any()
    bad = out.transpose(1, 2)                    # a last axis that is not contiguous is refused
    with pytest.raises(ValueError, match="contiguous"):
        merge_into(bad.transpose(2, 3), lse, o, s)
    return f"{dtype}: max |diff| {err:.3g}"


def check_merge_in_the_interpreter() -> None:
    """(Run by run_interpreted.)"""
    print(_check("cpu", torch.float32, 1e-5))


def test_the_merge_kernel_matches_the_torch_merge_in_the_interpreter():
    print(run_interpreted("tests.test_merge_kernel:check_merge_in_the_interpreter"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gpu_the_merge_kernel_matches_the_torch_merge(dtype, tol):
    print(_check("cuda", dtype, tol))
