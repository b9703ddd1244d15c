"""Attention read from the resident coded form (kite.kernels.coded_attention, kite.upcycle.load.resident)
against the rebuilt path: the staged load's rebuilt keys / values and ordinary attention."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kite.kernels.coded_attention import coded_attention
from kite.kernels.coded_layer import TILE, CodedLayer
from kite.upcycle import codec, load
from kite.upcycle.compress import CompressSettings, compress_document
from kite.upcycle.format import StateFile
from kite.upcycle.load.resident import build_resident
from kite.upcycle.rope import rope_cos_sin
from tests.tiny_models import CORPUS

DOC = CORPUS.replace(". ", ".\n\n", 3)
SPECS = {"ratio=4": codec.settings_for(4), "per-head": codec.settings_for(4, joint_heads=False),
         "ratio=8-sinks-outliers": codec.settings_for(8, sink_tokens=3, outliers=2, group_size=64)}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["qwen2"]), device="cpu")


def staged(lm, path, clusters=None):
    """The hot state of a load of ``path`` (selection as load_prefix builds it, sinks kept)."""
    state = StateFile(path)
    info = {c["id"]: c for c in state.meta["clusters"]}
    ids = sorted(info) if not clusters else clusters

    def pos(c):
        return torch.cat([torch.arange(s, e) for s, e in info[c]["token_ranges"]])

    sel = [(c, None) for c in ids] + [(c, pos(c) < 1) for c in sorted(set(info) - set(ids)) if (pos(c) < 1).any()]
    geo = lm.geometry
    hot = load.stage_state(state, sel, [pos(c) for c, _ in sel], list(range(geo.n_layers)), n_layers=geo.n_layers,
                           H=geo.n_kv_heads, d=geo.head_dim, threads=1, wait=True)
    state.close()
    return hot


def rebuilt_attention(q, k, v, scale):
    """Ordinary attention over rebuilt keys / values [H, T, d] (GQA): [Hq, n, d]."""
    rep = q.shape[0] // k.shape[0]
    return torch.nn.functional.scaled_dot_product_attention(
        q[None].float(), k.repeat_interleave(rep, 0)[None].float(), v.repeat_interleave(rep, 0)[None].float(),
        scale=scale)[0]


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("partial", [False, True])
def test_coded_attention_equals_attention_over_the_rebuilt_layer(lm, tmp_path, spec, partial):
    out = tmp_path / "s.upc"
    compress_document(lm, DOC, out, CompressSettings(codec=SPECS[spec], n_clusters=3, min_span_tokens=8,
                                                     max_span_tokens=24), device="cpu")
    clusters = None
    if partial:
        with StateFile(out) as sf:
            clusters = [next(c["id"] for c in sf.meta["clusters"] if c["token_ranges"][0][0] > 0)]
    hot = staged(lm, out, clusters)
    geo = lm.geometry
    cos, sin = rope_cos_sin(lm.model, hot.positions)
    keys, values = load.load_staged(hot, device="cpu", dtype=torch.float32, cos=cos, sin=sin)
    P = int(hot.positions.max()) + 8
    cos_tab, sin_tab = rope_cos_sin(lm.model, torch.arange(P))
    res = build_resident(hot, device="cpu", dtype=torch.float32, cos=cos_tab, sin=sin_tab, nibbles=True)
    assert res.tokens_per_layer() == [int(k.shape[1]) for k in keys]
    if spec == "per-head":      # per-head sides keep their <= 4-bit columns as nibbles, and count fewer bytes
        assert all(c.k_nib is not None and c.v_nib is not None for c in res.layers)
        flat = build_resident(hot, device="cpu", dtype=torch.float32, cos=cos_tab, sin=sin_tab, nibbles=False)
        assert sum(c.stream_bytes for c in res.layers) < sum(c.stream_bytes for c in flat.layers)
        for a, b in zip(res.layers, flat.layers):   # the same coefficients, columns in another order
            for side in "kv":
                ca, cb = (x.codes(side).float().sum() for x in (a, b))
                assert float(ca) == float(cb)
    scale = 1 / math.sqrt(geo.head_dim)
    g = torch.Generator().manual_seed(0)
    for layer in range(geo.n_layers):
        q = torch.randn(geo.n_heads, 2, geo.head_dim, generator=g) * 3
        want = rebuilt_attention(q, keys[layer], values[layer], scale)
        got = coded_attention(q, res.layers[layer], cos_tab, sin_tab, scale)
        assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))
        # live tokens after the state, attended in the same softmax (a causal mask among them)
        lk = torch.randn(geo.n_kv_heads, 2, geo.head_dim, generator=g)
        lv = torch.randn(geo.n_kv_heads, 2, geo.head_dim, generator=g)
        mask = torch.tensor([[True, False], [True, True]])
        k_all, v_all = torch.cat([keys[layer], lk], 1), torch.cat([values[layer], lv], 1)
        full = torch.cat([torch.ones(2, keys[layer].shape[1], dtype=torch.bool), mask], 1)
        rep = geo.n_heads // geo.n_kv_heads
        want = torch.nn.functional.scaled_dot_product_attention(
            q[None], k_all.repeat_interleave(rep, 0)[None], v_all.repeat_interleave(rep, 0)[None], attn_mask=full,
            scale=scale)[0]
        got = coded_attention(q, res.layers[layer], cos_tab, sin_tab, scale, lk, lv, mask[None])
        assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block", [1, 2, 4, "stream-bytes", "stream-align-1", "default"])
def test_triton_decode_kernel_matches_the_rebuilt_path(lm, tmp_path, spec, qdtype, block):
    """The batched GPU kernel (bf16 bases and tensor cores, fp32 softmax) over several sequences of
    different lengths against attention over the rebuilt path's bf16 keys / values: the one-tile and
    wide kernels (1, 2, 4 tiles a step), the stream kernel over one byte
    a code (its tables' alignment told to the compiler: 16 bytes here; and without, the session-9
    form), and the default configuration over nibble-packed codes (the stream kernel where the bases
    are per head)."""
    from kite.kernels.coded_attention import coded_decode_partial
    from kite.kernels.coded_attention_triton import CodedBatch

    kernel = {"default": {}, "stream-bytes": {"stream": True},
              "stream-align-1": {"stream": True, "align": 1}}.get(block, {"block": block, "stream": False})
    nibbles = block == "default"
    if block in ("stream-bytes", "stream-align-1") and spec != "per-head":
        pytest.skip("the stream kernel takes per-head bases")

    out = tmp_path / "s.upc"
    compress_document(lm, DOC, out, CompressSettings(codec=SPECS[spec], n_clusters=3, min_span_tokens=8,
                                                     max_span_tokens=24), device="cpu")
    with StateFile(out) as sf:
        other = next(c["id"] for c in sf.meta["clusters"] if c["token_ranges"][0][0] > 0)
    geo = lm.geometry
    scale = 1 / math.sqrt(geo.head_dim)
    P = int(geo.context_length)
    cos_tab, sin_tab = rope_cos_sin(lm.model, torch.arange(P), device="cuda")
    seqs = []
    for clusters in (None, [other], None):
        hot = staged(lm, out, clusters)
        cos, sin = rope_cos_sin(lm.model, hot.positions, device="cuda")
        keys, values = load.load_staged(hot, device="cuda", dtype=torch.bfloat16, cos=cos, sin=sin)
        seqs.append((keys, values, build_resident(hot, device="cuda", dtype=torch.bfloat16, cos=cos_tab, sin=sin_tab,
                                                  nibbles=nibbles)))
    g = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    if block == "stream-bytes":     # the aligned form is what runs (one byte a code, 32 columns a head)
        assert CodedBatch([res.layers[0] for _, _, res in seqs]).alignment == 16
    for layer in range(geo.n_layers):
        q = (torch.randn(len(seqs), geo.n_heads, geo.head_dim, generator=g, device="cuda") * 3).to(qdtype)
        got, lse = coded_decode_partial(q, [res.layers[layer] for _, _, res in seqs], cos_tab, sin_tab, scale,
                                        **kernel)
        for i, (keys, values, _) in enumerate(seqs):
            want = rebuilt_attention(q[i][:, None].float(), keys[layer], values[layer], scale)[:, 0]
            err = float((got[i] - want).abs().max() / want.abs().max())
            worst = max(worst, err)
            assert torch.isfinite(lse[i]).all()
    print(f"coded kernel (block {block}) vs rebuilt path, {spec}, q {qdtype}: max abs diff / max |out| = {worst:.2e}")
    # bf16 keys in both; the kernel also rounds q, the probabilities and the coefficients to bf16 for
    # its tensor-core products (measured on the H200: <= 2.4e-2 per head, <= 2.2e-2 joint, q of any dtype)
    assert worst <= 3e-2


def _prefixes(lm, tmp_path, spec, device, coded_dtype):
    """The same state as a rebuilt KVPrefix and as a CodedPrefix (resident coded form)."""
    from kite.runtime.cache import KVPrefix

    out = tmp_path / "s.upc"
    compress_document(lm, DOC, out, CompressSettings(codec=SPECS[spec], n_clusters=3, min_span_tokens=8,
                                                     max_span_tokens=24), device="cpu")
    with StateFile(out) as sf:
        n_tokens = int(sf.meta["n_tokens"])
    hot = staged(lm, out)
    cos, sin = rope_cos_sin(lm.model, hot.positions, device=device)
    keys, values = load.load_staged(hot, device=device, dtype=torch.float32, cos=cos, sin=sin)
    cos_tab, sin_tab = rope_cos_sin(lm.model, torch.arange(n_tokens + 1), device=device)
    coded = build_resident(hot, device=device, dtype=coded_dtype, cos=cos_tab, sin=sin_tab, next_position=n_tokens)
    return KVPrefix(keys, values, n_tokens), coded


@pytest.mark.parametrize("spec", ["ratio=4", "ratio=8-sinks-outliers"])
def test_a_batch_row_after_a_coded_state_decodes_as_after_the_rebuilt_state(lm, tmp_path, spec):
    """BatchDecoder: a row whose state stays in coded form gives the tokens and prompt NLL of the row
    after the same state rebuilt, beside a row without a state (CPU: the torch reference, fp32)."""
    from kite.runtime.batch_decode import BatchDecoder

    rebuilt, coded = _prefixes(lm, tmp_path, spec, "cpu", torch.float32)
    prompt = lm.tokenizer("What does the contract say about payment?")["input_ids"]
    dec = BatchDecoder(lm, max_rows=3)
    h_rebuilt = dec.add(prompt, prefix=rebuilt, max_new_tokens=8, stop_ids=set())
    h_plain = dec.add(prompt[:5], max_new_tokens=8, stop_ids=set())
    h_coded = dec.add(prompt, prefix=coded, max_new_tokens=8, stop_ids=set())
    assert dec.cache.row_lengths(dec._active[h_coded].row) == [0] * lm.geometry.n_layers   # nothing rebuilt
    res = dec.drain()
    assert res[h_coded].text == res[h_rebuilt].text and res[h_plain].text
    assert abs(res[h_coded].prompt_nll_bits - res[h_rebuilt].prompt_nll_bits) <= 1e-4
    assert res[h_coded].prefix_tokens == res[h_rebuilt].prefix_tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_batch_decode_step_reads_coded_rows_with_the_gpu_kernel(tiny_models, tmp_path, dtype):
    """On a GPU the decode step of coded rows goes through the Triton kernel: its logits against the
    same rows after the rebuilt state (bf16 bases in the kernel). At bf16 the model runs the fused
    layers load_model installs on a GPU (kite serve's forward): the same step with them off agrees."""
    from kite.model import fused, load_model
    from kite.runtime.batch_decode import BatchKVCache, forward_rows

    lm_gpu = load_model(str(tiny_models["qwen2"]), device="cuda", dtype=dtype)
    assert getattr(lm_gpu.model.model.layers[0], "_kite_fused", False) == (dtype == "bf16")
    rebuilt, coded = _prefixes(lm_gpu, tmp_path, "ratio=4", "cuda", torch.bfloat16)
    prompt = lm_gpu.tokenizer("What does the contract say about payment?")["input_ids"]
    steps = {}
    for on in (True, False) if dtype == "bf16" else (True,):
        fused.ENABLED = on
        try:
            cache = BatchKVCache(lm_gpu.model, 4)
            rows = [cache.take(rebuilt), cache.take(coded), cache.take(coded)]
            pos = [rebuilt.next_position] * 3
            forward_rows(lm_gpu.model, cache, rows, [prompt] * 3, pos)
            steps[on] = forward_rows(lm_gpu.model, cache, rows, [[7]] * 3, [p + len(prompt) for p in pos])
            assert cache.coded_batches                  # the kernel's tables were built for the decode step
        finally:
            fused.ENABLED = True
    logits = steps[True]
    top = float(logits[0].abs().max())
    for got in logits[1:]:
        err = float((got - logits[0]).abs().max()) / top
        print(f"{dtype}: coded rows vs rebuilt row, decode logits: max abs diff / max |logit| = {err:.2e}")
        assert err <= 3e-2
    if False in steps:
        err = max(float((a - b).abs().max()) for a, b in zip(steps[True], steps[False])) / top
        print(f"bf16: fused layers vs transformers' forward, same rows: max abs diff / max |logit| = {err:.2e}")
        assert err <= 3e-2


def test_load_coded_prefix_takes_what_load_prefix_takes_and_refuses_the_rest(lm, tmp_path):
    from kite.errors import BadInput
    from kite.upcycle.load import load_coded_prefix, load_prefix

    pca, exact = tmp_path / "pca.upc", tmp_path / "exact.upc"
    for path, s in ((pca, SPECS["ratio=4"]), (exact, codec.settings_for("exact"))):
        compress_document(lm, DOC, path, CompressSettings(codec=s, n_clusters=3, min_span_tokens=8,
                                                          max_span_tokens=24), device="cpu")
    rebuilt, _ = load_prefix(pca, lm)
    coded = load_coded_prefix(pca, lm)
    assert coded.tokens_per_layer() == rebuilt.tokens_per_layer()
    assert coded.next_position == rebuilt.next_position and coded.nbytes > 0
    with pytest.raises(BadInput, match="load it with load_prefix|load this one with load_prefix"):
        load_coded_prefix(exact, lm)


def _synthetic_layer(T: int, H: int, d: int, R: int, group_rows: int, gen, nib: tuple[int, int] = (0, 0)) -> CodedLayer:
    """A resident layer with per-head bases of R columns, random codes < 16, quantization groups of
    ``group_rows`` rows, one padding row; ``nib``: the nibble bytes a head of keys / values (their
    first 2 Nb columns packed two to a byte, the rest bytes of codes up to 255)."""

    C, G = H * R, -(-T // group_rows)
    pos = torch.arange(T, dtype=torch.int32)
    pos[5] = -1

    def tab(lo, hi):
        return torch.rand(G, C, generator=gen) * (hi - lo) + lo

    layer = CodedLayer(
        pos=pos, tile_group=(torch.arange(T // TILE) * TILE // group_rows).to(torch.int32),
        k_codes=torch.randint(0, 16, (T, C), dtype=torch.uint8, generator=gen), k_scale=tab(0.02, 0.06),
        k_min=tab(-0.5, -0.3), v_codes=torch.randint(0, 16, (T, C), dtype=torch.uint8, generator=gen),
        v_scale=tab(0.02, 0.06), v_min=tab(-0.5, -0.3),
        k_basis=(torch.randn(H, R, d, generator=gen) / math.sqrt(R)).bfloat16(),
        v_basis=(torch.randn(H, R, d, generator=gen) / math.sqrt(R)).bfloat16(),
        k_mean=torch.randn(G, H, d, generator=gen), v_mean=torch.randn(G, H, d, generator=gen),
        raw_k=torch.zeros(H, 0, d, dtype=torch.bfloat16), raw_v=torch.zeros(H, 0, d, dtype=torch.bfloat16), joint=False)
    if nib == (0, 0):
        return layer
    from kite.upcycle.load.resident import pack_nibbles

    packed = {}
    for side, nb in zip("kv", nib):
        full = getattr(layer, f"{side}_codes").view(T, H, R).clone()
        full[:, :, 2 * nb:] = torch.randint(0, 256, (T, H, R - 2 * nb), dtype=torch.uint8, generator=gen)
        packed[f"{side}_nib"], packed[f"{side}_codes"] = pack_nibbles(full.view(T, C), H, nb)
        scale = getattr(layer, f"{side}_scale").view(G, H, R).clone()
        scale[:, :, 2 * nb:] /= 16          # byte codes up to 255: coefficients of the same size as the nibbles'
        packed[f"{side}_scale"] = scale.view(G, C)
    return dataclasses.replace(layer, **packed)


def check_kernels_in_the_interpreter() -> None:
    """(Run by run_interpreted.) The one-tile kernel, groups of 256 and 64 rows, two sequences of
    their own lengths, against coded_partial_torch (the stream kernel: the next check). Not the wide
    kernel: Triton 3.6's interpreter gets its integer value-code product wrong (30-70 % of max |out|
    here), while on the H200 it matches the rebuilt path (test_triton_decode_kernel_matches_the_rebuilt_path,
    blocks 2 and 4)."""
    from kite.kernels import coded_attention_triton as tri
    from kite.kernels.coded_attention import coded_partial_torch, merge

    H, Hq, d, R = 2, 4, 32, 16
    inv = 1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(520)[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    for group_rows in (256, 64):
        gen = torch.Generator().manual_seed(group_rows)
        layers = [_synthetic_layer(T, H, d, R, group_rows, gen) for T in (512, 384)]
        q = torch.randn(2, Hq, d, generator=gen).bfloat16()
        o, lse = tri.coded_decode(q, tri.CodedBatch(layers), cos, sin, 1 / math.sqrt(d), splits=2, block=1,
                                  stream=False)
        out = merge([(o[:, s], lse[:, s]) for s in range(o.shape[1])])[0]
        for i, layer in enumerate(layers):
            want, _ = coded_partial_torch(q[i][:, None].float(), layer, cos, sin, 1 / math.sqrt(d))
            err = float((out[i] - want[:, 0]).abs().max() / want.abs().max())
            assert err <= 1e-2, (group_rows, i, err)
            print(f"groups of {group_rows} rows, one-tile kernel, sequence {i}: {err:.1e} of max |out|")


def check_stream_kernel_in_the_interpreter() -> None:
    """(Run by run_interpreted.) The stream kernel against coded_partial_torch: one byte a code and
    nibble-packed sides (keys / values with and without byte columns), blocks of 1, 2 and 4 tiles
    (halved where groups of 64 rows would straddle them), three sequences of their own lengths. The
    cases cover each side form with two geometries and each geometry with a nibble-packed form (the
    interpreter is slow: not every pair)."""
    from kite.kernels import coded_attention_triton as tri
    from kite.kernels.coded_attention import coded_partial_torch, merge

    H, Hq, d, R = 2, 6, 32, 32
    inv = 1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(520)[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    aligns = set()
    cases = (((0, 0), 256, 2), ((0, 0), 64, 4), ((16, 8), 256, 4), ((16, 8), 128, 1), ((16, 8), 256, 2),
             ((8, 16), 64, 4), ((8, 16), 128, 1))
    for nib, group_rows, block in cases:
        gen = torch.Generator().manual_seed(block + nib[0])
        layers = [_synthetic_layer(T, H, d, R, group_rows, gen, nib) for T in (512, 384, 96)]
        q = torch.randn(3, Hq, d, generator=gen).bfloat16()
        batch = tri.CodedBatch(layers)
        aligns.add(batch.alignment)
        for f16, align in ((True, None), (False, None), (True, 1)) if block == 2 else ((True, None),):
            o, lse = tri.coded_decode(q, batch, cos, sin, 1 / math.sqrt(d), splits=2, block=block, f16=f16,
                                      align=align)
            out = merge([(o[:, s], lse[:, s]) for s in range(o.shape[1])])[0]
            for i, layer in enumerate(layers):
                want, _ = coded_partial_torch(q[i][:, None].float(), layer, cos, sin, 1 / math.sqrt(d))
                err = float((out[i] - want[:, 0]).abs().max() / want.abs().max())
                assert err <= 1e-2, (nib, group_rows, block, f16, align, i, err)
                print(f"stream kernel ({'fp16' if f16 else 'bf16'} operands, tables aligned to "
                      f"{batch.alignment if align is None else align} bytes), nibble bytes {nib}, groups of "
                      f"{group_rows} rows, {block} tiles a step (aligned: {batch.aligned(block)}), sequence {i}: "
                      f"{err:.1e} of max |out|")
    # the stream kernel's ALIGN forms ran: 16 bytes (one byte a code; R = 32 columns) and 8 (the
    # nibble-packed sides have 8 nibble bytes a head on one side)
    assert {16, 8} <= aligns, aligns
    # values whose coefficients make the whole output (no means): the fp16 operands' value sums are
    # no less exact than the bf16 ones (the biased fp16 codes' 1024 Σp is taken off with the same p)
    gen = torch.Generator().manual_seed(0)
    layers = [_synthetic_layer(T, H, d, R, 256, gen, (8, 8)) for T in (512, 384)]
    layers = [dataclasses.replace(c, v_mean=torch.zeros_like(c.v_mean), v_min=torch.zeros_like(c.v_min))
              for c in layers]
    q = (torch.randn(2, Hq, d, generator=gen) * 3).bfloat16()
    errs = {}
    for f16 in (True, False):
        o, lse = tri.coded_decode(q, tri.CodedBatch(layers), cos, sin, 1 / math.sqrt(d), splits=2, block=2, f16=f16)
        out = merge([(o[:, s], lse[:, s]) for s in range(o.shape[1])])[0]
        errs[f16] = max(float((out[i] - coded_partial_torch(q[i][:, None].float(), c, cos, sin, 1 / math.sqrt(d))[0][:, 0])
                              .abs().max() / out[i].abs().max()) for i, c in enumerate(layers))
    print(f"value coefficients alone: fp16 operands {errs[True]:.1e}, bf16 {errs[False]:.1e} of max |out|")
    assert errs[True] <= errs[False] + 1e-3, errs


def _rope_tables(d: int, P: int = 520, dev: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (1e4 ** (torch.arange(0, d, 2, device=dev).float() / d))
    ang = torch.arange(P, device=dev)[:, None].float() * inv[None]
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def check_coef_keys_in_the_interpreter() -> None:
    """(Run by run_interpreted.) The stream kernel with keys in coefficient space (keys="coef": codes
    of post-RoPE keys scored as coefficients @ B q^T + μ · q) against
    coded_partial_torch(keys="coef"): one byte a code and nibble-packed sides, blocks of 1 / 2 / 4
    tiles, fp16 and bf16 operands, three sequences of their own lengths."""
    from kite.kernels import coded_attention_triton as tri
    from kite.kernels.coded_attention import coded_partial_torch, merge

    H, Hq, d, R = 2, 6, 32, 32
    cos, sin = _rope_tables(d)
    # each side form once, each geometry once, the operand types at blocks of 2 (the interpreter is slow)
    for nib, group_rows, block in (((0, 0), 256, 2), ((16, 8), 64, 4), ((8, 16), 128, 1), ((8, 16), 256, 2)):
        gen = torch.Generator().manual_seed(block + nib[0])
        layers = [_synthetic_layer(T, H, d, R, group_rows, gen, nib) for T in (512, 384, 96)]
        q = (torch.randn(3, Hq, d, generator=gen) * 3).bfloat16()
        batch = tri.CodedBatch(layers)
        for f16 in (True, False) if block == 2 else (True,):
            o, lse = tri.coded_decode(q, batch, cos, sin, 1 / math.sqrt(d), splits=2, block=block, f16=f16,
                                      keys="coef")
            out = merge([(o[:, s], lse[:, s]) for s in range(o.shape[1])])[0]
            for i, layer in enumerate(layers):
                want, _ = coded_partial_torch(q[i][:, None].float(), layer, cos, sin, 1 / math.sqrt(d), keys="coef")
                other, _ = coded_partial_torch(q[i][:, None].float(), layer, cos, sin, 1 / math.sqrt(d))
                err = float((out[i] - want[:, 0]).abs().max() / want.abs().max())
                # the switch matters: the same codes read as pre-RoPE keys attend otherwise
                apart = float((other - want).abs().max() / want.abs().max())
                assert err <= 1e-2 and apart > 10 * err, (nib, group_rows, block, f16, i, err, apart)
                print(f"coef keys, stream kernel ({'fp16' if f16 else 'bf16'} operands), nibble bytes {nib}, "
                      f"groups of {group_rows} rows, {block} tiles a step, sequence {i}: {err:.1e} of max |out| "
                      f"(rebuild form {apart:.1e} away)")


def test_coef_keys_reference_reads_the_codes_as_post_rope_keys():
    """coded_partial_torch(keys="coef"): attention over coefficients x basis + mean with no rotation
    (the keys were coded after RoPE); with RoPE at angle 0 both forms are the same function; an
    unknown form is refused."""
    from kite.kernels.coded_attention import coded_decode_partial, coded_partial_torch

    gen = torch.Generator().manual_seed(3)
    H, Hq, d, R = 2, 6, 32, 32
    layer = _synthetic_layer(256, H, d, R, 64, gen, (8, 8))
    cos, sin = _rope_tables(d)
    q = torch.randn(Hq, 2, d, generator=gen) * 3
    got, lse = coded_partial_torch(q, layer, cos, sin, 0.2, keys="coef")
    rows = layer.pos >= 0
    grp = layer.tile_group.long().repeat_interleave(TILE)
    coef = layer.k_min[grp] + layer.k_scale[grp] * layer.codes("k").float()
    keys = torch.stack([coef[:, h * R:(h + 1) * R] @ layer.k_basis[h].float() + layer.k_mean[grp, h]
                        for h in range(H)])
    vcoef = layer.v_min[grp] + layer.v_scale[grp] * layer.codes("v").float()
    vals = torch.stack([vcoef[:, h * R:(h + 1) * R] @ layer.v_basis[h].float() + layer.v_mean[grp, h]
                        for h in range(H)])
    want = rebuilt_attention(q, keys[:, rows], vals[:, rows], 0.2)
    assert (got - want).abs().max() <= 1e-4 * float(want.abs().max())
    flat_cos, flat_sin = torch.ones_like(cos), torch.zeros_like(sin)
    same, _ = coded_partial_torch(q, layer, flat_cos, flat_sin, 0.2)
    assert (same - got).abs().max() <= 1e-5 * float(want.abs().max())
    rotated, _ = coded_partial_torch(q, layer, cos, sin, 0.2)
    assert (rotated - got).abs().max() > 1e-2 * float(want.abs().max())
    with pytest.raises(ValueError, match="keys must be one of rebuild, coef"):
        coded_decode_partial(q[:, :1].transpose(0, 1), [layer], cos, sin, 0.2, keys="post")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nib", [(0, 0), (16, 8), (64, 29)])
@pytest.mark.parametrize("f16", [True, False])
def test_coef_keys_stream_kernel_matches_the_torch_reference_on_the_gpu(nib, f16):
    """The compiled stream kernel with keys in coefficient space at the benchmark's head geometry (7
    query heads a KV head, head_dim 128, 128 columns a head; one byte a code, and nibble-packed as
    measured on random-weight states: keys 64 / values 29 nibble bytes a head) against the fp32
    reference, three sequences of their own lengths; the rebuild form on the same codes beside it."""
    from kite.kernels.coded_attention import coded_decode_partial, coded_partial_torch

    H, Hq, d, R = 2, 14, 128, 128
    cos, sin = _rope_tables(d, 4200, "cuda")
    gen = torch.Generator().manual_seed(sum(nib) + f16)
    layers = [_synthetic_layer(T, H, d, R, 512, gen, nib) for T in (4096, 1024, 96)]
    layers = [dataclasses.replace(c, **{f.name: getattr(c, f.name).cuda() for f in dataclasses.fields(c)
                                        if isinstance(getattr(c, f.name), torch.Tensor)}) for c in layers]
    worst = {}
    for keys in ("coef", "rebuild"):
        q = (torch.randn(len(layers), Hq, d, device="cuda") * 3).bfloat16()
        got, lse = coded_decode_partial(q, layers, cos, sin, 1 / math.sqrt(d), keys=keys, f16=f16)
        worst[keys] = 0.0
        for i, layer in enumerate(layers):
            want, _ = coded_partial_torch(q[i][:, None].float(), layer, cos, sin, 1 / math.sqrt(d), keys=keys)
            assert torch.isfinite(got[i]).all() and torch.isfinite(lse[i]).all()
            worst[keys] = max(worst[keys], float((got[i] - want[:, 0]).abs().max() / want.abs().max()))
    print(f"stream kernel vs fp32 reference, nibble bytes {nib}, {'fp16' if f16 else 'bf16'} operands: "
          f"coef keys {worst['coef']:.2e}, rebuild {worst['rebuild']:.2e} of max |out|")
    assert worst["coef"] <= 1e-2, worst


def check_every_kernel_in_the_interpreter() -> None:
    """(Run by run_interpreted.) The three checks in one child process (its imports cost ~5 s)."""
    check_kernels_in_the_interpreter()
    check_stream_kernel_in_the_interpreter()
    check_coef_keys_in_the_interpreter()


def test_decode_kernels_equal_the_torch_reference_on_the_cpu():
    """In Triton's interpreter (tests/triton_interpreter.py): the one-tile decode kernel, the stream
    kernel (one byte a code and nibble-packed), the stream kernel with keys in coefficient space."""
    from kite.testing.triton_interpreter import run_interpreted

    print(run_interpreted("tests.test_coded_attention:check_every_kernel_in_the_interpreter"))


def test_coded_batch_alignment_is_what_every_table_and_column_count_allow():
    """The stream kernel promises the compiler CodedBatch.alignment (vector loads): the largest of 16 /
    8 / 4 / 2 / 1 bytes dividing every table address and column count, so a layer whose codes sit
    at an odd address, or whose heads have 24 columns, lowers it for the whole batch."""
    pytest.importorskip("triton")
    from kite.kernels.coded_attention_triton import CodedBatch, coded_decode

    gen = torch.Generator().manual_seed(0)
    layer = _synthetic_layer(128, 2, 32, 32, 64, gen)
    assert CodedBatch([layer]).alignment == 16
    assert CodedBatch([layer, _synthetic_layer(128, 2, 32, 24, 64, gen)]).alignment == 8
    odd = torch.empty(layer.k_codes.numel() + 1, dtype=torch.uint8)[1:].view(layer.k_codes.shape)
    odd.copy_(layer.k_codes)
    mixed = CodedBatch([layer, dataclasses.replace(layer, k_codes=odd)])
    assert mixed.alignment == 1
    # a promise the tables do not keep is refused before any launch
    cos = sin = torch.zeros(128, 32)
    with pytest.raises(ValueError, match="aligned to 1 bytes, not 16"):
        coded_decode(torch.zeros(2, 4, 32).bfloat16(), mixed, cos, sin, 1.0, splits=1, align=16)


def _stream_kernel_ptx_sm90(align: int, coef: bool = False) -> str:
    """The stream kernel's default configuration at the benchmark's geometry (4 KV heads x 7 query
    heads, head_dim 128, 128 code columns a head, one byte a code) compiled for sm_90a on this
    machine (Triton's own compiler and ptxas; no GPU needed): its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kite.kernels import coded_attention_triton as tri

    fn = tri.PER_HEAD_KERNELS["stream"]
    types = {"q_ptr": "*bf16", "ptrs": "*i64", "ints": "*i32", "cos_ptr": "*fp16", "sin_ptr": "*fp16",
             "tab_stride": "i32", "o_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    consts = dict(H=4, G=7, GP=16, D=128, HALF=64, HP=64, DP=128, TL=32, SUB=2, BT=64, NBKP=0, WKP=128, NBVP=0,
                  WVP=128, SPLITS=4, F16=True, ALIGN=align, COEF=coef)
    sig = {name: types.get(name, "constexpr") for name in fn.arg_names}
    # what the launcher specializes: tensors 16-byte aligned, the table stride (64) a multiple of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if types.get(name, "").startswith("*") or name == "tab_stride"}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2)).asm["ptx"]


def test_the_aligned_stream_kernel_loads_its_codes_as_vectors_on_the_h200():
    """What made the stream kernel 1.51x faster on the H200 (docs/PERFORMANCE.md, session 9b): told
    its tables' alignment, it loads its code tiles through 8-byte asynchronous copies (one block
    ahead); not told, every code is its own synchronous byte load. Checked on the PTX for sm_90a,
    compiled here."""
    pytest.importorskip("triton")
    try:
        ptx = {a: _stream_kernel_ptx_sm90(a) for a in (1, 16)}
    except (ImportError, RuntimeError) as e:   # a Triton without its NVIDIA backend / ptxas
        pytest.skip(f"cannot compile for sm_90a here: {e}"[:200])
    assert ptx[1].count("ld.global.b8 ") >= 128      # 64 key + 64 value codes a thread and block
    assert ptx[16].count("ld.global.b8 ") == 0
    copies8 = {a: sum(1 for line in p.splitlines() if "cp.async" in line and ", 0x8," in line) for a, p in ptx.items()}
    assert copies8[1] == 0 and copies8[16] >= 32, copies8   # [64, 128] bytes x keys and values, 2 stages


def test_the_coef_stream_kernel_scores_with_mma_sync_on_the_h200():
    """Keys in coefficient space take their scores as q B^T @ coefficients^T, query heads as the 16
    rows: an mma.sync product, not a Hopper wgmma (with tokens as the rows, a wgmma, the scores were
    wrong and varied run to run on the H200 under Triton 3.6, while the interpreter matched). Also
    no key rebuild: fewer wgmma than the rebuild form (its [64, 128] x [128, 64] key products). Checked
    on the PTX for sm_90a, compiled here."""
    pytest.importorskip("triton")
    try:
        ptx = {coef: _stream_kernel_ptx_sm90(16, coef) for coef in (False, True)}
    except (ImportError, RuntimeError) as e:   # a Triton without its NVIDIA backend / ptxas
        pytest.skip(f"cannot compile for sm_90a here: {e}"[:200])
    wgmma = {c: p.count("wgmma.mma_async") for c, p in ptx.items()}
    mma = {c: p.count("mma.sync") for c, p in ptx.items()}
    assert mma[False] == 0 and mma[True] >= 32, mma       # [16, 128] x [128, 64]: 4 x 8 k-steps of m16n8k16
    assert wgmma[True] < wgmma[False], wgmma
    assert ptx[True].count("ld.global.b8 ") == 0          # its code tiles still load as vectors
