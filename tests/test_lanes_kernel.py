"""The lanes decode kernel (kite.kernels.lanes_triton) against the torch reference of the form
(kite.kernels.lanes.lanes_partial_torch): in Triton's interpreter on the CPU, compiled on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from kite.kernels import lanes as L
from kite.upcycle.codec import lanes as E


def _states(device: str, H: int = 2, d: int = 64, lengths=(700, 300), k_lanes: int = 64, v_lanes: int = 32,
            group: int = 128, separate: bool = False) -> L.Lanes | list[L.Lanes]:
    """States of structured random KV (a falling spectrum, an offset), of different lengths, stacked
    (or ``separate``: each its own Lanes, as a batch's rows hold them)."""
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(H, d, d, generator=gen) * (0.9 ** torch.arange(d))[None, :, None]
    out = []
    for T in lengths:
        k = torch.randn(H, T, d, generator=gen) @ A + 1.0
        v = torch.randn(H, T, d, generator=gen) @ A
        out.append(E.encode(k.to(device), v.to(device), k_lanes, v_lanes, group=group, sinks=1))
    return out if separate else L.stack(out)


def _check(device: str, dtype: torch.dtype, splits, tol: float, **shape) -> str:
    from kite.kernels.lanes_triton import lanes_decode

    x = _states(device, **shape)
    H, d = x.k_codes.shape[1], x.k_const.shape[-1]
    q = (torch.randn(x.states, 3 * H, d, generator=torch.Generator().manual_seed(1)) * 2).to(device, dtype)
    scale = 1 / math.sqrt(d)
    want, wl = L.lanes_partial_torch(q, x, scale)
    got, gl = lanes_decode(q, x, scale, splits=splits)
    err = float((got - want).abs().max())
    top = float(want.abs().max())
    assert err <= tol * top, f"{dtype} splits={splits}: max |diff| {err:.3g} of max |out| {top:.3g}"
    assert float((gl - wl).abs().max()) <= 50 * tol
    # the same states each in its own tensors (a batch's rows: the plan's pointer table, groups apart)
    from kite.kernels.lanes_triton import LanesPlan

    apart = LanesPlan(_states(device, separate=True, **shape))
    got1, _ = lanes_decode(q, apart, scale, splits=splits)
    err1 = float((got1 - want).abs().max())
    assert err1 <= tol * top, f"states apart: max |diff| {err1:.3g}"
    # with the sinks as rows kept raw, in the same softmax: as lanes_partial's CPU path merges them
    want2, _ = L.lanes_partial(q.cpu(), x.to("cpu"), scale)
    got2, _ = lanes_decode(q, x, scale, x.raw_k, x.raw_v, splits=splits)
    err2 = float((got2.cpu() - want2).abs().max())
    assert err2 <= tol * float(want2.abs().max()), f"with the sinks: max |diff| {err2:.3g}"
    return f"{dtype} splits={splits}: max |diff| {err:.3g} / max |out| {top:.3g}; with sinks {err2:.3g}"


def check_lanes_kernel_in_the_interpreter() -> None:
    """(Run by run_interpreted.) Two states of different lengths, one program and three per head;
    the kernel's fp16 operands (query scaled per group, probabilities)
    leave it within 0.5 % of the largest output."""
    from kite.testing.triton_interpreter import bridge_interpreter_gaps

    bridge_interpreter_gaps()
    for splits in (1, 3):
        print(_check("cpu", torch.float32, splits, 5e-3))


def _check_several_query_tokens(device: str, dtype: torch.dtype, T: int, **shape) -> str:
    """A batch row's question (T tokens) over its state in lanes through the kernel (the tokens folded
    into the query heads, a few a launch) against the torch reference row by row."""
    from kite.kernels import lanes_triton

    out = []
    for folded in (lanes_triton.FOLDED_ROWS, 8):      # the default, and chunks of 2 tokens (3 heads a KV head)
        lanes_triton.FOLDED_ROWS, kept = folded, lanes_triton.FOLDED_ROWS
        try:
            out.append(_several_query_tokens(device, dtype, T, **shape))
        finally:
            lanes_triton.FOLDED_ROWS = kept
    return "; ".join(out)


def _several_query_tokens(device: str, dtype: torch.dtype, T: int, **shape) -> str:
    from kite.kernels import lanes_triton
    from kite.runtime.resident import lanes_kernel_attend

    states = _states(device, separate=True, **shape)
    H, d = states[0].k_codes.shape[1], states[0].k_const.shape[-1]
    n = len(states)
    q = (torch.randn(n, 3 * H, T, d, generator=torch.Generator().manual_seed(2)) * 2).to(device, dtype)
    scale = 1 / math.sqrt(d)
    plans: dict = {}
    got, lse = lanes_kernel_attend(q, states, scale, plans, ("rows", 0))
    want = [L.lanes_partial(q[i:i + 1].float().cpu(), x.to("cpu"), scale) for i, x in enumerate(states)]
    wo, wl = torch.cat([w[0] for w in want]), torch.cat([w[1] for w in want])
    assert got.shape == wo.shape == (n, 3 * H, T, d) and lse.shape == wl.shape
    err = float((got.cpu() - wo).abs().max())
    assert err <= 5e-3 * float(wo.abs().max()), f"{dtype}, {T} query tokens a row: max |diff| {err:.3g}"
    assert float((lse.cpu() - wl).abs().max()) <= 0.25
    per, chunks = lanes_triton.token_chunks(T, 3)
    assert list(plans) == [("rows", 0, chunks)]
    return f"{dtype}, {T} query tokens a row: max |diff| {err:.3g} / max |out| {float(wo.abs().max()):.3g}"


def check_several_query_tokens_in_the_interpreter() -> None:
    """(Run by run_interpreted.) Four query tokens a row, on the CPU."""
    from kite.testing.triton_interpreter import bridge_interpreter_gaps

    bridge_interpreter_gaps()
    print(_check_several_query_tokens("cpu", torch.float32, 4))


@pytest.mark.slow
def test_several_query_tokens_a_row_in_the_interpreter():
    from kite.testing.triton_interpreter import run_interpreted

    print(run_interpreted("tests.test_lanes_kernel:check_several_query_tokens_in_the_interpreter"))


@pytest.mark.slow
def test_lanes_kernel_in_the_interpreter():
    from kite.testing.triton_interpreter import run_interpreted

    print(run_interpreted("tests.test_lanes_kernel:check_lanes_kernel_in_the_interpreter"))


def test_lanes_decode_refuses_a_query_that_does_not_fit():
    pytest.importorskip("triton")
    from kite.kernels.lanes_triton import lanes_decode

    x = _states("cpu")
    with pytest.raises(ValueError, match="does not fit"):
        lanes_decode(torch.randn(3, 6, 64), x, 0.125)
    with pytest.raises(ValueError, match="tile of 64 rows must divide the group size 96"):
        lanes_decode(torch.randn(2, 6, 64), _states("cpu", group=96), 0.125)
    with pytest.raises(ValueError, match="reads 32 lanes a row or more"):
        lanes_decode(torch.randn(2, 6, 64), _states("cpu", k_lanes=16), 0.125)


def test_lanes_partial_merges_the_sinks_on_the_cpu():
    """lanes_partial = one softmax over the sinks and the coded rows: attention over the decoded rows."""
    from kite.kernels.partials import raw_partial

    x = _states("cpu", lengths=(500, 500))
    q = torch.randn(2, 6, 64)
    out, lse = L.lanes_partial(q, x, 0.125)
    k, v = L.decode(x, "k"), L.decode(x, "v")
    n = x.raw_k.shape[2] + int(x.length[0])        # sinks + coded rows (500 tokens each), padding after
    assert n == 500
    want, wl = raw_partial(q[:, :, None], k[:, :, :n], v[:, :, :n], 0.125)
    assert torch.allclose(out, want[:, :, 0], atol=1e-4)
    assert torch.allclose(lse, wl[:, :, 0], atol=1e-4)


def test_the_lanes_kernel_compiles_for_the_h200_with_its_inline_ptx():
    """The inline PTX that unpacks four code bytes at a time assembles for sm_90a (ptxas, here), and
    the unpacking is its masks (lop3) on the shifted words, keys' and values' alike, with no
    per-nibble bias subtraction (sub.f16x2: the biases come off once a group), not an element-wise
    conversion."""
    pytest.importorskip("triton")
    from kite.testing.sm90 import compile_sm90

    try:
        asm = compile_sm90()
    except (ImportError, RuntimeError) as e:   # a Triton without its NVIDIA backend / ptxas
        pytest.skip(f"cannot compile for sm_90a here: {e}"[:200])
    ptx = asm["ptx"]
    # the keys' masks (low, high nibble), the values' (both, at the mantissa's top), the shifts
    assert "lop3.b32" in ptx and all(mask in ptx for mask in ("0x000f000f", "0x00f000f0", "0x03c003c0"))
    assert "shl.b32" in ptx and "shr.b32" in ptx
    assert "sub.f16x2" not in ptx
    assert "mma" in ptx     # the scores and value sums on the tensor cores
    # value codes lane-major within a group: a thread's four rows of a lane are one word in shared
    # memory (row-major codes were read a byte at a time there: 128 byte loads a tile)
    assert "ld.shared.b8" not in ptx and "ld.shared.u8" not in ptx


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_lanes_kernel_matches_the_reference_on_the_gpu(dtype, splits):
    """Compiled, at every query precision, head_dim 128 (lanes 128 and 64) and 64."""
    pytest.importorskip("triton")
    print(_check("cuda", dtype, splits, 5e-3, d=128, k_lanes=128, v_lanes=64, group=256, lengths=(2000, 700, 256)))
    print(_check("cuda", dtype, splits, 5e-3))


@cuda
@pytest.mark.parametrize("T", [2, 4, 9])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_several_query_tokens_a_row_match_the_reference_on_the_gpu(dtype, T):
    """A question's tokens through the kernel, compiled, at head_dim 128 (lanes 128 and 64) and 64."""
    pytest.importorskip("triton")
    print(_check_several_query_tokens("cuda", dtype, T, d=128, k_lanes=128, v_lanes=64, group=256,
                                      lengths=(2000, 700, 256)))
    print(_check_several_query_tokens("cuda", dtype, T))


# -- the GPU ------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("dtype,bits", [("fp32", 8), ("bf16", 8), ("bf16", 4)])
def test_the_decode_step_reads_rows_in_lanes_with_the_kernel_on_the_gpu(tiny_models, tmp_path, dtype, bits):
    """On a GPU the decode step of rows in lanes goes through the lanes kernel (the tiny model's head_dim
    16 at 8 bits: 32 lanes; at 4 bits, 16 lanes, the reference on the GPU): its logits against the rows
    after the rows the lanes decode to (bf16 bases)."""
    from kite.model import load_model
    from kite.runtime.batch_decode import BatchKVCache, forward_rows
    from kite.upcycle import StateFile, codec
    from kite.upcycle.compress import CompressSettings, compress_document
    from kite.upcycle.load.lanes import load_lanes
    from tests.tiny_models import CORPUS

    state = tmp_path / "s.upc"
    compress_document(load_model(str(tiny_models["qwen2"]), device="cpu"), CORPUS, state,
                      CompressSettings(codec=codec.settings_for(4), n_clusters=3, min_span_tokens=8,
                                       max_span_tokens=24), device="cpu")
    lm_gpu = load_model(str(tiny_models["qwen2"]), device="cuda", dtype=dtype)
    with StateFile(state) as sf:
        held, _ = load_lanes(sf, lm_gpu, lane_bits=(bits, bits))
    rows_kv = held.as_kv()
    prompt = lm_gpu.tokenizer("What does the contract say about payment?")["input_ids"]
    cache = BatchKVCache(lm_gpu.model, 4)
    rows = [cache.take(rows_kv), cache.take(held), cache.take(held)]
    pos = [held.next_position] * 3
    forward_rows(lm_gpu.model, cache, rows, [prompt] * 3, pos)
    logits = forward_rows(lm_gpu.model, cache, rows, [[7]] * 3, [p + len(prompt) for p in pos])
    # the kernel's plan is kept for the step where the kernel reads the lanes
    assert any(k[0] == "LanesPrefix" for k in cache.plans) == (bits == 8)
    top = float(logits[0].abs().max())
    for got in logits[1:]:
        err = float((got - logits[0]).abs().max()) / top
        print(f"{dtype}: rows in lanes vs their decoded rows, decode logits: max abs diff / max |logit| = {err:.2e}")
        assert err <= 3e-2
