"""The split-KV attention kernel (kite.kernels.split_attention_triton) computes the attention KITE's
existing path computes (query heads of a KV head folded, sdpa with a boolean mask): on the CPU through
Triton's interpreter (where Triton is installed), on a GPU at bf16 / fp16, alone, inside a CUDA
graph, and as the attention of a whole model's forward over a cached prefix."""

from __future__ import annotations

import pytest
import torch

from kite.runtime import attention
from kite.runtime.attention import _folded_attention, kite_attention
from kite.testing.triton_interpreter import run_interpreted

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def reference(q, k, v, mask, scale):
    """The existing path in fp32: [B, q, Hq, d]. ``mask`` None = bottom-right causal."""
    B, _, QL, _ = q.shape
    KL = k.shape[2]
    if mask is None:
        mask = (torch.arange(KL, device=q.device)[None] <= torch.arange(QL, device=q.device)[:, None] + KL - QL)
        mask = mask[None, None]
    return _folded_attention(q.float(), k.float(), v.float(), mask.expand(B, 1, QL, KL), scale)


CASES = {   # B, Hq, Hkv, q, k, d, mask, splits
    "causal, 3 tokens after 197": (1, 4, 2, 3, 200, 16, False, None),
    "bool mask per row, ragged tile": (2, 6, 2, 5, 333, 32, True, None),
    "one decode token, no grouping": (1, 2, 2, 1, 100, 16, False, None),
    "one split": (1, 4, 1, 4, 130, 16, False, 1),
    "more splits than tiles": (1, 4, 2, 2, 70, 16, True, 50),
}


def check_split_kernel_in_the_interpreter() -> None:
    """(Run by run_interpreted.) Every case at fp32 / bf16 / fp16 against the folded sdpa path, and a
    row that sees no key."""
    from kite.kernels.split_attention_triton import split_kv_attention

    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
    for i, (case, (B, Hq, Hkv, QL, KL, D, use_mask, splits)) in enumerate(CASES.items()):
        for dtype in tol:
            g = torch.Generator().manual_seed(i)
            q, k, v = (torch.randn(B, h, n, D, generator=g).to(dtype) for h, n in ((Hq, QL), (Hkv, KL), (Hkv, KL)))
            mask = torch.rand(B, 1, QL, KL, generator=g) > 0.3 if use_mask else None
            out = split_kv_attention(q, k, v, mask, 0.3, splits=splits, block_n=16)
            err = (out.float() - reference(q, k, v, mask, 0.3)).abs().max().item()
            assert out.shape == (B, QL, Hq, D) and out.dtype == dtype, case
            assert err < tol[dtype], (case, dtype, err)
            print(f"{case}, {dtype}: max abs diff {err:.1e}")
    q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 1, 90, 16), torch.randn(1, 1, 90, 16)
    mask = torch.rand(1, 1, 3, 90) > 0.5
    mask[0, 0, 1] = False
    out = split_kv_attention(q, k, v, mask, 0.25, splits=4, block_n=16)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))      # a row that sees no key: zeros
    assert (out[:, [0, 2]] - reference(q, k, v, mask, 0.25)[:, [0, 2]]).abs().max().item() < 1e-5


def by_row_reference(q, keys, values, rows, lengths, starts, scale):
    """Sequence b over buffer row rows[b]: key j visible to its token t iff j < lengths[b] and
    j <= starts[b] + t; fp32 (out [B, q, Hq, d], lse [B, Hq, q])."""
    from kite.kernels.partials import raw_partial

    B, Hq, QL, D = q.shape
    outs, lses = [], []
    for b in range(B):
        j = torch.arange(keys.shape[2])
        t = torch.arange(QL)
        vis = (j[None] < int(lengths[b])) & (j[None] <= int(starts[b]) + t[:, None])     # [q, k]
        o, lse = raw_partial(q[b:b + 1].float(), keys[int(rows[b])][None].float(), values[int(rows[b])][None].float(),
                             scale, vis[None, None])
        outs.append(torch.nan_to_num(o).transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def check_by_row_kernel_in_the_interpreter() -> None:
    """(Run by run_interpreted.) Sequences of different lengths reading rows of one buffer (out of
    order, one row twice, one sequence of length 0), one decode token and a padded 4-token query,
    with the log-sum-exp, at fp32 and bf16."""
    from kite.kernels.split_attention_triton import split_kv_attention

    g = torch.Generator().manual_seed(7)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)):
        for QL, lengths, starts in ((1, [120, 37, 0, 200], [119, 36, 0, 199]),
                                    (4, [120, 37, 5, 200], [116, 35, 1, 196])):
            keys, values = (torch.randn(5, 2, 208, 16, generator=g).to(dtype) for _ in range(2))
            q = torch.randn(4, 6, QL, 16, generator=g).to(dtype)
            rows = torch.tensor([3, 0, 4, 3], dtype=torch.int32)
            lens, st = torch.tensor(lengths, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)
            out, lse = split_kv_attention(q, keys, values, None, 0.3, splits=3, block_n=16, rows=rows,
                                          lengths=lens, starts=st, return_lse=True)
            ref, ref_lse = by_row_reference(q, keys, values, rows, lens, st, 0.3)
            assert out.shape == (4, QL, 6, 16) and lse.shape == (4, 6, QL)
            assert (out.float() - ref).abs().max().item() < tol, (dtype, QL)
            fin = torch.isfinite(ref_lse)
            assert torch.equal(fin, torch.isfinite(lse))
            assert (lse[fin] - ref_lse[fin]).abs().max().item() < tol * 10, (dtype, QL)
            print(f"by row, q={QL}, {dtype}: ok")


@pytest.mark.slow   # Triton's interpreter on the CPU: 13-25 s
def test_split_kernel_equals_the_folded_sdpa_path_on_the_cpu():
    """In Triton's interpreter: causal rule and bool masks, ragged row and key tiles, one decode token,
    one chunk and more chunks than tiles, at fp32 / bf16 / fp16; a row that sees no key gets zeros."""
    run_interpreted("tests.test_attention_split:check_split_kernel_in_the_interpreter")


@pytest.mark.slow   # Triton's interpreter on the CPU
def test_split_kernel_reads_rows_of_different_lengths_on_the_cpu():
    """In Triton's interpreter: each sequence reads its own buffer row up to its own length, its new
    tokens causal among themselves; the log-sum-exp for merging with another part."""
    run_interpreted("tests.test_attention_split:check_by_row_kernel_in_the_interpreter")


def test_the_cpu_keeps_the_existing_path():
    q, k, v = torch.randn(1, 4, 16, 16), torch.randn(1, 2, 2048, 16), torch.randn(1, 2, 2048, 16)
    assert not attention._splits_keys(q.bfloat16(), k.bfloat16(), None, 0.0)

    class Layer:
        layer_idx = 0

    out, _ = kite_attention(Layer, q, k, v, None, 0.25)
    assert (out - reference(q, k, v, None, 0.25)).abs().max().item() < 1e-5


# ---- on a GPU (the H200 runs these) ------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 28, 4, 16, 16400, 128), (2, 8, 2, 5, 3000, 64), (1, 28, 4, 1, 16385, 128)],
                         ids=["qwen2-7b 16 tokens after 16K", "two rows, 5 tokens after 3K", "decode token at 16K"])
@pytest.mark.parametrize("use_mask", [False, True], ids=["causal rule", "bool mask"])
def test_gpu_kernel_split_kv_matches_the_fused_path(shape, dtype, use_mask):
    B, Hq, Hkv, QL, KL, D = shape
    q = torch.randn(B, Hq, QL, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, Hkv, KL, D, device="cuda", dtype=dtype) for _ in range(2))
    mask = None
    if use_mask:   # padding: a few early keys hidden per row, and the causal tail
        mask = (torch.arange(KL, device="cuda")[None] <= torch.arange(QL, device="cuda")[:, None] + KL - QL)
        mask = (mask[None, None] & (torch.rand(B, 1, 1, KL, device="cuda") > 0.05)).contiguous()
    from kite.kernels.split_attention_triton import split_kv_attention

    out = split_kv_attention(q, k, v, mask, D ** -0.5)
    ref = reference(q, k, v, mask, D ** -0.5)
    err = (out.float() - ref).abs().max().item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 3e-3), err
    assert attention._splits_keys(q, k, mask, 0.0)


@cuda
def test_gpu_queries_of_new_lengths_compile_no_new_kernels():
    """Continuations of 3, 5 and 6 tokens after a state (their folded rows one tile) run the kernels
    compiled for the first: the query's length is an argument, not a constant compiled in; each
    matches the reference."""
    from kite.kernels import split_attention_triton as sa

    k, v = (torch.randn(1, 4, 3000, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def compiled() -> int:
        caches = getattr(sa._partial_kernel, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton keeps its compiled kernels elsewhere")
        return sum(len(c[0]) for c in caches.values()) + sum(len(c[0]) for c in sa._merge_kernel.device_caches.values())

    counts = []
    for QL in (3, 5, 6):
        q = torch.randn(1, 8, QL, 64, device="cuda", dtype=torch.bfloat16)
        out = sa.split_kv_attention(q, k, v)
        assert (out.float() - reference(q, k, v, None, 64 ** -0.5)).abs().max().item() < 2e-2
        counts.append(compiled())
    assert counts[0] == counts[1] == counts[2], counts


@cuda
def test_gpu_kernel_split_kv_replays_in_a_cuda_graph():
    from kite.kernels.split_attention_triton import split_kv_attention

    q = torch.randn(1, 28, 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    eager = split_kv_attention(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        split_kv_attention(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = split_kv_attention(q, k, v)
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, eager)
    q.copy_(torch.randn_like(q))
    graph.replay()
    assert (out.float() - reference(q, k, v, None, 128 ** -0.5)).abs().max().item() < 2e-2


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_kernel_a_models_forward_over_a_cached_prefix_is_unchanged(dtype):
    """A random Qwen2 (head_dim 64, 4:1 grouping) prefills 3,000 tokens; a 16-token query's logits
    through KITE's attention are the same with the split-KV kernel and with the fused path."""
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    cfg._attn_implementation = attention.register()
    model = Qwen2ForCausalLM(cfg).to("cuda", dtype).eval()
    doc, query = torch.randint(512, (1, 3000), device="cuda"), torch.randint(512, (1, 16), device="cuda")
    logits = {}
    try:
        for split in (False, True):
            attention.SPLIT_KV = split
            with torch.inference_mode():
                cache = DynamicCache(config=cfg)
                model(doc, past_key_values=cache)
                logits[split] = model(query, past_key_values=cache).logits.float()
    finally:
        attention.SPLIT_KV = True
    diff = (logits[True] - logits[False]).abs().max().item()
    assert diff <= 0.02 * logits[False].abs().max().item(), diff


@cuda
def test_on_a_gpu_a_masked_prefill_chunk_runs_without_cudnn_and_as_the_fp32_path():
    """A document's second chunk (1,024 tokens after 1,024, bottom-right causal, query heads folded):
    KITE's attention leaves cuDNN's fused kernel out (its host time per call dwarfed the work) and
    gives the fp32 path's answer at bf16."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 64, device="cuda", generator=g).bfloat16()
               for h, n in ((9, 1024), (3, 2048), (3, 2048)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out, _ = kite_attention(None, q, k, v, None, scaling=0.125)
        torch.cuda.synchronize()
    assert not [e.key for e in prof.key_averages() if "cudnn" in e.key.lower()]
    want = reference(q, k, v, None, 0.125)
    assert torch.allclose(out.float(), want, atol=2e-2, rtol=0)
