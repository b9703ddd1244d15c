"""The batch engine's steps on KITE's kernels (kite.runtime.kernel_step) decode what transformers'
forward decodes: on the CPU through Triton's interpreter (eager: a CPU has no CUDA graphs), on a GPU
eager and replayed from CUDA graphs, with rows after raw states and after states held in lanes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kite.testing.triton_interpreter import run_interpreted

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_lm(arch: str, device: str, dtype, layers: int = 3, **overrides):
    """A random tiny Llama-family model (fused forwards installed) as the batch engine takes it."""
    from transformers import AutoModelForCausalLM

    from kite.model import fused, geometry_from_config
    from kite.runtime.attention import register
    from tests.tiny_models import tiny_config, tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = tiny_config(arch, vocab_size=len(tok), layers=layers)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():   # attention that is not uniform
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    model = model.to(device, dtype).eval()
    model.config._attn_implementation = register()
    fused.fuse_forward(model, on_cpu=True)    # fp32 on a GPU too (the tests compare at fp32)
    return SimpleNamespace(model=model, tokenizer=tok, geometry=geometry_from_config(model.config),
                           eos_ids=lambda: set())


def ids(lm, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, lm.geometry.vocab_size, (n,), generator=g).tolist()


def raw_prefix(lm, n: int, seed: int, keep=None, gap: int = 0):
    """A state of ``n`` random tokens as raw KV (the model's own prefill); layer l keeps ``keep[l]``.
    The prefill runs transformers' own forward: under Triton's interpreter the fused kernels would
    take minutes over a few hundred tokens, and any KV serves as a state here."""
    from kite.model import fused
    from kite.runtime.cache import KVPrefix, cache_layers, new_cache
    from kite.runtime.generate import forward_tokens

    cache = new_cache(lm.model)
    before, fused.ENABLED = fused.ENABLED, False
    try:
        forward_tokens(lm.model, ids(lm, n, seed), cache, 0)
    finally:
        fused.ENABLED = before
    layers = cache_layers(cache)
    keep = keep or [slice(None)] * len(layers)
    return KVPrefix([k[0][:, s].contiguous() for (k, _), s in zip(layers, keep)],
                    [v[0][:, s].contiguous() for (_, v), s in zip(layers, keep)], n + gap)


def lanes_prefix(lm, prefix):
    """``prefix`` held in 4-bit lanes (the lanes resident form's coding), groups of 64 rows."""
    from kite.upcycle import lanes_of

    return lanes_of(prefix, lm.geometry.head_dim, prefix.keys[0].device, group=64)


def run(lm, requests, *, kernels: bool, max_rows: int = 3, graphs: bool = True, reserve: int | None = None,
        ahead: bool = True):
    """Every request (prompt, prefix, max_new_tokens[, stop ids]) through one BatchDecoder: the first
    two at once, the third after two steps, the rest as rows free up, the fourth cancelled after its
    third token; {request: (token ids, stop reason)} and the engine (its rows reserved for ``reserve``
    tokens first, when given). ``kernels`` False: transformers' own forward, the fused layers off.
    ``ahead`` False: no decode step launched before the host has the last one's tokens."""
    from kite.model import fused
    from kite.runtime import kernel_step
    from kite.runtime.batch_decode import BatchDecoder
    from kite.runtime.decoding import SequenceDecode

    dec = BatchDecoder(lm, max_rows=max_rows)
    dec.kernels = kernel_step.KernelStep(lm.model, dec.cache) if kernels else None
    if reserve is not None:
        dec.reserve(reserve)
    kept = {}
    result = SequenceDecode.result

    def with_ids(self, **kw):
        out = result(self, **kw)
        out.ids = list(self.new)
        return out

    SequenceDecode.result = with_ids
    before, kernel_step.GRAPHS = kernel_step.GRAPHS, graphs
    ahead_before, kernel_step.AHEAD = kernel_step.AHEAD, ahead
    fused_before, fused.ENABLED = fused.ENABLED, fused.ENABLED and kernels

    def add(i):
        p, x, n, *stop = requests[i]
        return dec.add(p, prefix=x, max_new_tokens=n, stop_ids=stop[0] if stop else None)
    try:
        handles = {}
        for i in (0, 1):
            handles[add(i)] = i
        out = dec.step()
        out.update(dec.step())
        handles[add(2)] = 2
        waiting, steps = list(range(3, len(requests))), 0
        cancel = None
        while len(dec) or waiting:
            while waiting and dec.fits(len(requests[waiting[0]][0]), requests[waiting[0]][1], requests[waiting[0]][2]):
                i = waiting.pop(0)
                h = add(i)
                handles[h] = i
                if i == 3:
                    cancel = (h, steps + 3)
            out.update(dec.step())
            steps += 1
            if cancel is not None and steps == cancel[1]:
                dec.cancel(cancel[0])
        for h, r in out.items():
            kept[handles[h]] = (r.ids, r.stop_reason)
    finally:
        SequenceDecode.result = result
        kernel_step.GRAPHS = before
        kernel_step.AHEAD = ahead_before
        fused.ENABLED = fused_before
    return kept, dec


def requests_for(lm, lanes: bool = False):
    n = lm.geometry.n_layers
    every_other = [slice(None)] + [slice(None, None, 2)] * (n - 2) + [slice(0, 0)]
    a = raw_prefix(lm, 40, 1, every_other, gap=3)         # layers of different lengths, one empty
    b = raw_prefix(lm, 70, 2)
    c = lanes_prefix(lm, raw_prefix(lm, 90, 3)) if lanes else raw_prefix(lm, 25, 3)
    return [(ids(lm, 6, 10), a, 9), (ids(lm, 3, 11), None, 7), (ids(lm, 9, 12), b, 12),
            (ids(lm, 4, 13), c, 10), (ids(lm, 1, 14), c, 8), (ids(lm, 5, 15), a, 6)]


def check_kernel_steps_in_the_interpreter() -> None:
    """(Run by run_interpreted.) Tiny Llama, then Qwen2 with a state in lanes, at fp32: the same tokens
    through the kernels as through transformers' forward, rows with states of different lengths per
    layer, joining and leaving (a row moved down when a lower one frees), one cancelled."""
    for arch, lanes in (("llama", False), ("qwen2", True)):
        lm = tiny_lm(arch, "cpu", torch.float32, layers=2)
        reqs = requests_for(lm, lanes)
        want, _ = run(lm, reqs, kernels=False)
        got, dec = run(lm, reqs, kernels=True)
        assert got == want, (arch, lanes)
        assert dec.cache.bytes_in_use() == 0
        print(f"{arch}, lanes {lanes}: {len(got)} requests, the same tokens")


@pytest.mark.slow   # Triton's interpreter on the CPU
def test_kernel_steps_decode_what_transformers_decodes_on_the_cpu():
    run_interpreted("tests.test_kernel_step:check_kernel_steps_in_the_interpreter", timeout=600)


def check_compiling_the_query_buckets_writes_nothing() -> None:
    """(Run by run_interpreted.) KernelStep.compile_queries runs a step of every query bucket on a row
    of count 0: the cache's KV and lengths stay as they were."""
    from kite.runtime import kernel_step
    from kite.runtime.batch_decode import BatchDecoder

    lm = tiny_lm("llama", "cpu", torch.float32, layers=2)
    prompt, prefix, n = requests_for(lm)[2]
    dec = BatchDecoder(lm, max_rows=3)
    dec.kernels = k = kernel_step.KernelStep(lm.model, dec.cache)
    dec.add(prompt, prefix=prefix, max_new_tokens=n)
    dec.step()                                   # a row holding KV
    keys = [t.clone() for t in dec.cache.keys]
    lengths = dec.cache.lengths.clone()
    k.compile_queries()
    assert k.prefill_compiled
    assert all(torch.equal(a, b) for a, b in zip(keys, dec.cache.keys))
    assert torch.equal(lengths, dec.cache.lengths)
    print("every query bucket ran; nothing written")


@pytest.mark.slow   # Triton's interpreter on the CPU
def test_compiling_the_query_buckets_writes_nothing():
    run_interpreted("tests.test_kernel_step:check_compiling_the_query_buckets_writes_nothing", timeout=600)


def test_the_compile_at_start_covers_every_attention_variant_a_batch_can_plan():
    """compile_queries runs the attention at one batch size of each variant (the merge kernel's power of
    two of chunks, Triton's int specialisations of the chunk count) a batch of up to the allocated rows
    plans: every batch size's variant is among them, at far fewer sizes than rows."""
    from kite.kernels.split_attention_triton import compile_variant, row_splits
    from kite.runtime.batch_cache import BatchKVCache
    from kite.runtime.kernel_step import QUERY_BUCKETS, KernelStep

    lm = tiny_lm("llama", "cpu", torch.float32, layers=1, hidden_size=256, num_attention_heads=4,
                 num_key_value_heads=2)
    cache = BatchKVCache(lm.model, 64)
    cache.reserve(64, 4096)
    step = KernelStep(lm.model, cache)

    def variant(B, T):
        return compile_variant(row_splits(B, 4, 2, T, cache.keys[0].shape[2], cache.keys[0].device))

    for T in QUERY_BUCKETS[1:]:
        warmed = step.attention_batches(T)
        assert warmed[0] == 1 and len(warmed) < 16
        assert {variant(B, T) for B in warmed} == {variant(B, T) for B in range(1, 65)}


def test_buckets_cover_every_batch_size():
    from kite.runtime.kernel_step import buckets

    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    for n in range(1, 70):
        assert all(any(b >= k for b in buckets(n)) for k in range(1, n + 1))


def test_query_lengths_run_at_a_few_buckets():
    from kite.runtime.kernel_step import MAX_QUERY, QUERY_BUCKETS, query_bucket

    assert QUERY_BUCKETS[-1] == MAX_QUERY
    assert [query_bucket(n) for n in (1, 2, 3, 5, 9, 17, 33, 64)] == [1, 2, 4, 8, 16, 32, 64, 64]
    assert all(n <= query_bucket(n) < 2 * n for n in range(1, MAX_QUERY + 1))


def test_a_cpu_model_keeps_transformers_forward(tiny_models):
    from kite.model import load_model
    from kite.runtime.batch_decode import BatchDecoder
    from kite.runtime.kernel_step import why_not

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    assert why_not(lm.model) == "not on a GPU"
    assert BatchDecoder(lm, max_rows=2).kernels is None


# ---- on a GPU (the H200 runs these) ------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gpu_graphed_steps_give_the_eager_steps_tokens_at_fp32(arch):
    """fp32, head size 64: transformers' forward, the kernels eager and the kernels graphed decode
    the same tokens; the graphs were captured and replayed."""
    lm = tiny_lm(arch, "cuda", torch.float32, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    reqs = requests_for(lm)
    want, _ = run(lm, reqs, kernels=False)
    eager, _ = run(lm, reqs, kernels=True, graphs=False)
    graphed, dec = run(lm, reqs, kernels=True, graphs=True)
    assert eager == want
    assert graphed == want
    assert dec.kernels.captures >= 1 and dec.kernels.replays > dec.kernels.captures
    assert any(T > 1 for _, T, *_ in dec.kernels._graphs)     # the questions' prefills replayed graphs too


@cuda
@pytest.mark.parametrize("lanes", [False, True])
def test_gpu_decode_steps_launched_ahead_give_the_tokens_of_steps_one_at_a_time(lanes):
    """Decode steps launched before the host has the last one's tokens (KernelStep.again: each row fed
    its argmax on the device), with rows joining, leaving, one cancelled and one stopped by an end
    token mid-way, raw rows or rows all in lanes: the tokens and stop reasons of steps one at a time."""
    lm = tiny_lm("qwen2", "cuda", torch.float32, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    if lanes:
        states = [lanes_prefix(lm, raw_prefix(lm, n, s)) for n, s in ((150, 1), (90, 2), (300, 3))]
        reqs = [(ids(lm, 4, 20 + i), states[i % 3], 10 + i) for i in range(6)]
    else:
        reqs = requests_for(lm)
    first, _ = run(lm, reqs, kernels=True, ahead=False)
    reqs[2] = (*reqs[2], {first[2][0][3]})          # its fourth token ends it (an end token)
    want, plain = run(lm, reqs, kernels=True, ahead=False)
    got, dec = run(lm, reqs, kernels=True, ahead=True)
    assert want[2][1] == "eos" and want[3][1] == "cancelled"
    assert got == want
    assert dec.kernels.ahead > 0 and plain.kernels.ahead == 0
    assert dec.cache.bytes_in_use() == 0


@cuda
def test_gpu_graphed_steps_at_bf16_stay_within_the_stated_tolerance():
    """bf16: the graphed step's logits against transformers' forward over the same rows, within 4 %
    of the largest logit (a batched bf16 matmul rounds differently from transformers' separate
    products; near-ties may flip a token on random weights, so logits are compared, not tokens)."""
    from kite.runtime import kernel_step
    from kite.runtime.batch_decode import BatchKVCache, forward_rows

    lm = tiny_lm("qwen2", "cuda", torch.bfloat16, hidden_size=512, num_attention_heads=8, num_key_value_heads=2)
    prefixes = [raw_prefix(lm, n, s) for n, s in ((300, 1), (40, 2), (1000, 3))]
    caches = [BatchKVCache(lm.model, 4) for _ in range(2)]
    rows = [[c.take(p) for p in prefixes] for c in caches]
    step = kernel_step.KernelStep(lm.model, caches[1])
    tokens = [[7], [8], [9]]
    positions = [p.next_position for p in prefixes]
    for _ in range(3):    # a few decode steps: the first captures, the rest replay
        want = forward_rows(lm.model, caches[0], rows[0], tokens, positions)
        got = step.logits(rows[1], tokens, positions)
        positions = [p + 1 for p in positions]
        for w, g in zip(want, got):
            assert (w - g).abs().max().item() <= 0.04 * w.abs().max().item()
    assert step.captures == 1 and step.replays == 3
    assert torch.equal(caches[0].lengths, caches[1].lengths)


@cuda
def test_gpu_rows_in_lanes_decode_in_the_same_step_as_raw_rows():
    """A batch of raw rows and rows held in lanes: the kernel step equals transformers' forward with
    the lanes form's attention (fp32 activations, bf16 lane bases)."""
    lm = tiny_lm("qwen2", "cuda", torch.float32, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    reqs = requests_for(lm, lanes=True)
    want, _ = run(lm, reqs, kernels=False)
    got, _ = run(lm, reqs, kernels=True)
    assert got == want


@cuda
def test_gpu_rows_all_in_lanes_are_replayed_from_a_graph_with_the_eager_tokens():
    """Every row held in lanes (states of different lengths, rows joining, leaving and cancelled):
    the graphed steps (decode, and the questions' prefills) read each row's state through the tables kept by cache row and gives the
    tokens of the eager step and of transformers' forward with the lanes form's attention."""
    lm = tiny_lm("qwen2", "cuda", torch.float32, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    states = [lanes_prefix(lm, raw_prefix(lm, n, s)) for n, s in ((150, 1), (90, 2), (300, 3))]
    reqs = [(ids(lm, 4, 20 + i), states[i % 3], 6 + i) for i in range(6)]
    want, _ = run(lm, reqs, kernels=False)
    eager, _ = run(lm, reqs, kernels=True, graphs=False)
    graphed, dec = run(lm, reqs, kernels=True, graphs=True)
    assert eager == want
    assert graphed == want
    assert dec.kernels.captures >= 1 and dec.kernels.replays > dec.kernels.captures
    assert dec.kernels.lanes_rows.held
    # the questions' prefills (rows all in lanes) replayed graphs too
    assert any(T > 1 and version is not None for _, T, _, version in dec.kernels._graphs)


def _check_lanes_tables(device: str, dtype, T: int) -> str:
    """What a step whose rows all hold lanes reads (LanesRows: tables by cache row, gathered by the
    step's rows, a question's T tokens T entries of its row's state) against the form's reference row
    by row: states of different lengths (more groups than the tables' first read), rows out of order,
    two rows on one state, a row's state replaced, the same part read again for other rows (as a
    captured step's replays read it)."""
    from kite.kernels import lanes as L
    from kite.runtime.batch_cache import BatchKVCache
    from kite.runtime.kernel_step import LanesRows

    lm = tiny_lm("qwen2", device, dtype, layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    states = [lanes_prefix(lm, raw_prefix(lm, n, s)) for n, s in ((150, 1), (1100, 2), (300, 3))]
    tables = LanesRows(BatchKVCache(lm.model, 5))
    beside = {2: states[0], 0: states[2], 1: states[2], 4: states[0]}
    tables.sync(beside)
    beside.update({4: states[1], 3: states[0]})       # a row's state replaced, a row joining
    tables.sync(beside)
    rows = torch.tensor([2, 4, 0, 3, 1], device=device)
    part = tables.part(rows)
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    # a captured step's part reads its rows from a static input, written again before each replay
    for order in ([2, 4, 0, 3, 1], [3, 1, 4, 2, 0]):
        rows.copy_(torch.tensor(order))
        for layer in range(lm.geometry.n_layers):
            q = torch.randn(len(order), 4, T, 64, generator=g).to(device, dtype)
            o, lse = part(layer, q, 0.125)
            for b, r in enumerate(order):
                wo, wl = L.lanes_partial(q[b:b + 1], beside[r].layers[layer], 0.125)
                err = float((o[b:b + 1] - wo).abs().max()) / float(wo.abs().max())
                worst = max(worst, err)
                assert err <= 5e-3, (order, layer, b, r, err)
                assert float((lse[b:b + 1] - wl).abs().max()) <= 0.05, (order, layer, b, r)
    return f"{dtype}, {T} tokens a row: max |diff| / max |out| {worst:.3g}"


def check_lanes_tables_in_the_interpreter() -> None:
    """(Run by run_interpreted.)"""
    from kite.testing.triton_interpreter import bridge_interpreter_gaps

    bridge_interpreter_gaps()
    print(_check_lanes_tables("cpu", torch.float32, 3))


@pytest.mark.slow
def test_the_lanes_tables_give_each_rows_tokens_its_own_state_in_the_interpreter():
    print(run_interpreted("tests.test_kernel_step:check_lanes_tables_in_the_interpreter"))


@cuda
@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_the_lanes_tables_give_each_rows_tokens_its_own_state(dtype, T):
    print(_check_lanes_tables("cuda", dtype, T))


@cuda
def test_gpu_reserved_rows_capture_every_bucket_before_the_first_request():
    """BatchDecoder.reserve allocates every row and captures each bucket's step up front; requests that
    fit then replay those graphs (lanes ones captured together at the first step in lanes, prefills too) and give the
    tokens of an engine that grew on demand."""
    from kite.runtime import kernel_step

    lm = tiny_lm("qwen2", "cuda", torch.float32, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    states = [lanes_prefix(lm, raw_prefix(lm, n, s)) for n, s in ((150, 1), (90, 2), (300, 3))]
    reqs = [(ids(lm, 4, 20 + i), states[i % 3], 6 + i) for i in range(6)]
    want, _ = run(lm, reqs, kernels=True)
    got, dec = run(lm, reqs, kernels=True, reserve=512)
    assert got == want
    k = dec.kernels
    assert dec.cache.rows_allocated == 3 and dec.cache.capacity >= 512
    # every bucket and the few-row prefills at every query length, raw and lanes, once: no regrowth, no recapture
    assert k.captures == 2 * (len(k.buckets) + len(k.prefill_buckets()) * (len(kernel_step.QUERY_BUCKETS) - 1))
    assert k.replays > 0
    assert k.prefill_compiled                     # every question length's kernels compiled at reserve
