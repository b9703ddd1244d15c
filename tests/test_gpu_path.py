"""The GPU path of the codec and of loading, run on the CPU (torch fallbacks; CI has no GPU).

the batched encoder must write the bytes the per-layer codec writes; the staged load must rebuild what
load_prefix's host decode rebuilds.
"""

from __future__ import annotations

import os

import pytest
import torch

from kite.errors import BadInput, KiteError
from kite.kernels import eigh
from kite.upcycle import codec, load
from kite.upcycle.codec.batched_fit import joint_gram_fused
from kite.upcycle.compress import CompressSettings, compress_document
from kite.upcycle.load import load_prefix
from kite.upcycle.rope import rope_cos_sin
from kite.upcycle.format import StateFile
from tests.tiny_models import CORPUS

DOC = CORPUS.replace(". ", ".\n\n", 3)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["qwen2"]), device="cpu")


@pytest.mark.parametrize("seed", range(6))
def test_vectorized_bit_allocation_matches_the_heap(seed):
    g = torch.Generator().manual_seed(seed)
    s = codec.settings_for([4, 8, 2][seed % 3], range_mode="mse" if seed % 2 else "minmax")
    N, B, r = 4, (1, 4)[seed % 2], (48, 16)[seed % 2]
    T = (40, 300, 2048)[seed % 3]
    ev = (torch.rand(N, B, r, generator=g) ** (1 + seed % 4) * 10).sort(dim=-1, descending=True).values
    ev[0, 0, -3:] = 0  # components without variance get nothing
    budgets = [float(x) for x in torch.randint(500, 80000, (N,), generator=g) * T / 300]
    got = codec.allocate_bits_batched(ev, budgets, T, r, s)
    for n in range(N):
        want = codec.allocate_bits(ev[n], budgets[n], T, r, s)
        # same allocation (the heap and the sort agree; at the budget's edge one increment may differ)
        assert (got[n] - want).abs().sum() <= 1
        assert int(got[n].sum()) >= int(want.sum()) - 1


def _kv(L=2, H=2, T=600, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    K = torch.randn(L, H, T, d, generator=g) * torch.linspace(3, 0.1, d) + 1.0
    V = torch.randn(L, H, T, d, generator=g) * torch.linspace(2, 0.1, d)
    perm = torch.randperm(T, generator=g)
    sets = [perm[:250].sort().values, perm[250:420].sort().values, perm[420:].sort().values]
    return K, V, sets


@pytest.mark.parametrize("spec", ["ratio=4", "ratio=8", "ratio=2", "per-head", "minmax-3sinks"])
def test_batched_encode_writes_the_codec_bytes(spec):
    s = {"per-head": codec.settings_for(4, joint_heads=False),
         "minmax-3sinks": codec.settings_for(8, range_mode="minmax", sink_tokens=3, group_size=128)}.get(spec) \
        or codec.settings_for(spec)
    K, V, sets = _kv()
    enc = codec.encode_state(K, V, sets, s)
    lcs = codec.fit_state(list(K), list(V), s, sets)   # per layer unless the budget is the whole state's
    for layer in range(K.shape[0]):
        lc = lcs[layer]
        assert enc.layer_blobs[layer] == codec.to_bytes(lc)
        for c, idx in enumerate(sets):
            part = codec.encode(lc, K[layer][:, idx], V[layer][:, idx], idx)
            assert enc.part_blobs[layer][c] == (codec.to_bytes(part.k), codec.to_bytes(part.v))


@pytest.mark.parametrize("joint", [False, True])
def test_batched_encode_mixed_group_sizes_and_sinks(joint):
    # parts of three group sizes (a 3-token part holding both sinks, a 100-token part, two parts of whole
    # and padded 128-token groups): one projection over all of them, rows picked per (size, width)
    s = codec.settings_for(8, joint_heads=joint, group_size=128, sink_tokens=2)
    K, V, _ = _kv(T=700, seed=3)
    g = torch.Generator().manual_seed(4)
    rest = torch.randperm(697, generator=g) + 3
    sets = [torch.arange(3), rest[:100].sort().values, rest[100:356].sort().values, rest[356:].sort().values]
    enc = codec.encode_state(K, V, sets[::-1], s)
    lcs = codec.fit_state(list(K), list(V), s, sets[::-1])
    for layer in range(K.shape[0]):
        lc = lcs[layer]
        assert enc.layer_blobs[layer] == codec.to_bytes(lc)
        for c, idx in enumerate(sets[::-1]):
            part = codec.encode(lc, K[layer][:, idx], V[layer][:, idx], idx)
            assert enc.part_blobs[layer][c] == (codec.to_bytes(part.k), codec.to_bytes(part.v))


def test_batched_codec_refuses_what_it_does_not_take():
    K, V, sets = _kv(L=1, T=64)
    assert not codec.supports_batched("int4")
    with pytest.raises(ValueError):
        codec.encode_state(K, V, sets, "int4")
    with pytest.raises(ValueError):
        codec.encode_state(K, V, [sets[0][:10]], "ratio=4")


def test_batched_encode_takes_the_clusters_from_a_function():
    """The fit is queued before the caller clusters: same bytes as with the sets given up front."""
    K, V, sets = _kv(L=2)
    calls = []

    def later():
        calls.append(1)
        return sets
    a = codec.encode_state(K, V, sets, "ratio=4")
    b = codec.encode_state(K, V, later, "ratio=4")
    assert calls == [1] and a.layer_blobs == b.layer_blobs and a.part_blobs == b.part_blobs
    with pytest.raises(ValueError, match="partition"):
        codec.encode_state(K, V, lambda: sets[:1], "ratio=4")


def test_batched_codec_names_the_layer_it_cannot_fit():
    K, V, sets = _kv(L=2, T=128)
    K[1, 0, 5, 3] = float("nan")
    with pytest.raises(KiteError, match=r"k Gram of layer\(s\) \[1\]"):
        codec.encode_state(K, V, sets, "ratio=4")


def test_fused_joint_gram_matches_the_blocks_gram():
    """The GPU's one-pass interleave + centering gives the Gram of the joint-head blocks."""
    X = torch.randn(3, 4, 200, 16, generator=torch.Generator().manual_seed(5)) + 2.0
    blocks = X.permute(0, 2, 1, 3).reshape(3, 200, 64)
    for center in (True, False):
        mean, G = joint_gram_fused(X, center)
        mean_ref, G_ref = eigh.centered_gram(blocks, center)
        assert torch.allclose(mean, mean_ref.float(), atol=1e-5)
        assert torch.allclose(G, G_ref.float(), rtol=1e-4, atol=1e-4)


def test_compress_document_batched_matches_per_layer(lm, tmp_path):
    st = CompressSettings(codec=codec.settings_for(4), n_clusters=3, min_span_tokens=8, max_span_tokens=24)
    a = compress_document(lm, DOC, tmp_path / "a.upc", st)
    b = compress_document(lm, DOC, tmp_path / "b.upc", st, device="cpu")
    assert a.state_bytes == b.state_bytes
    with StateFile(a.path) as fa, StateFile(b.path) as fb:
        assert list(fa.index) == list(fb.index)
        for key in fa.index:
            assert fa.read(key) == fb.read(key), key


def _staged_load(path, lm, clusters=None, layers=None, sink_tokens=4, device="cpu", dtype=torch.float32):
    """The staged load (on the CPU unless told), selection built as load_prefix builds it."""
    state = path if isinstance(path, StateFile) else StateFile(path)
    info = {c["id"]: c for c in state.meta["clusters"]}
    ids = sorted(info) if not clusters else [int(c) for c in clusters]

    def pos(c):
        return torch.cat([torch.arange(s, e) for s, e in info[c]["token_ranges"]])

    selection = [(c, None) for c in ids]
    if clusters:
        for c in sorted(set(info) - set(ids)):
            keep = pos(c) < sink_tokens
            if keep.any():
                selection.append((c, keep))
    geo = lm.geometry
    layer_list = list(range(geo.n_layers)) if layers is None else layers
    hot = load.stage_state(state, selection, [pos(c) for c, _ in selection], layer_list, n_layers=geo.n_layers,
                               H=geo.n_kv_heads, d=geo.head_dim, threads=2)
    cos, sin = rope_cos_sin(lm.model, hot.positions, device=device)
    keys, values = load.load_staged(hot, device=device, dtype=dtype, cos=cos, sin=sin,
                                        n_layers=geo.n_layers)
    state.close()
    return hot, keys, values


def test_staging_a_truncated_state_is_one_clear_error(lm, tmp_path):
    """Blobs read back to back with one preadv: a file cut short names the part that is cut off."""
    out = tmp_path / "s.upc"
    compress_document(lm, DOC, out, CompressSettings(codec=codec.settings_for(4), n_clusters=3, min_span_tokens=8,
                                                     max_span_tokens=24), device="cpu")
    with StateFile(out) as sf:
        last = max(sf.index.values(), key=lambda e: e.offset)
        raw = [e for e in sf.index.values() if e.codec == "raw"]
    assert last.codec == "raw" and len(raw) > 3     # the run read in one call ends with the cut blob
    state = StateFile(out)                          # cut short after it was opened (sized whole)
    os.truncate(out, out.stat().st_size - 10)
    with pytest.raises(BadInput, match=rf"truncated .upc state \(part {last.key} is cut off\)"):
        _staged_load(state, lm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", ["ratio=4", "per-head"])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_split_load_matches_the_torch_fallback(lm, tmp_path, spec, partial, dtype):
    """The CUDA split load (pca_coefs + bf16 matmul + pca_finish, sinks and RoPE included) against
    the same load by the torch fallback on the CPU."""
    s = codec.settings_for(4, joint_heads=False) if spec == "per-head" else codec.settings_for(spec)
    out = tmp_path / "s.upc"
    compress_document(lm, DOC, out, CompressSettings(codec=s, n_clusters=3, min_span_tokens=8, max_span_tokens=24))
    with StateFile(out) as sf:
        other = next(c for c in sf.meta["clusters"] if c["token_ranges"][0][0] > 0)
    clusters, layers = ([str(other["id"])], [0, 2]) if partial else (None, None)
    _, k_ref, v_ref = _staged_load(out, lm, clusters=clusters, layers=layers)
    _, k_gpu, v_gpu = _staged_load(out, lm, clusters=clusters, layers=layers, device="cuda", dtype=dtype)
    for ref, got in zip(k_ref + v_ref, k_gpu + v_gpu):
        if ref is None:
            assert got is None
            continue
        assert got.is_cuda and got.dtype == dtype and got.shape == ref.shape
        # the coefficient matmul runs in bf16 on tensor cores: ~0.3 % of the rows' norm
        assert (got.float().cpu() - ref).norm() <= 0.01 * ref.norm()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rebuild_graphs_are_captured_on_the_second_load(lm, tmp_path):
    """Into the same buffers: the first load runs eagerly and marks them, the second captures each
    layer's rebuild, the third replays it; all three write what an eager load writes. Without the
    native CUDA library (no `make build-runtime`) the torch fallback cannot be captured: every load
    runs eagerly, with the same result."""
    from kite.kernels import native

    out = tmp_path / "s.upc"
    compress_document(lm, DOC, out, CompressSettings(codec=codec.settings_for(4), n_clusters=3, min_span_tokens=8,
                                                     max_span_tokens=24))
    hot, k_ref, v_ref = _staged_load(out, lm, device="cuda", dtype=torch.bfloat16)   # fresh buffers: eager
    geo = lm.geometry
    cos, sin = rope_cos_sin(lm.model, hot.positions, device="cuda")
    bufs = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in zip(k_ref, v_ref)]
    seen = []
    for _ in range(3):
        for k, v in bufs:
            k.zero_()
            v.zero_()
        load.load_staged(hot, device="cuda", dtype=torch.bfloat16, cos=cos, sin=sin, out=bufs,
                             n_layers=geo.n_layers)
        torch.cuda.synchronize()
        graphs = [g for key, g in hot.graphs.items() if key[2] in {k.data_ptr() for k, _ in bufs}]
        seen.append(sorted({type(g).__name__ for g in graphs}))
        for (k, v), kr, vr in zip(bufs, k_ref, v_ref):
            assert torch.equal(k, kr) and torch.equal(v, vr)
    if native.cuda() is not None:
        assert seen == [["NoneType"], ["CUDAGraph"], ["CUDAGraph"]]
    else:
        assert seen == [[], [], []]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compress_document_on_the_gpu(lm, tiny_models, tmp_path):
    """A model on the GPU: spans clustered from CUDA features, the batched codec on the device, and a
    state that decodes like the CPU's (the GPU fit is fp32, so not byte for byte)."""
    from kite.model import load_model

    lm_gpu = load_model(str(tiny_models["qwen2"]), device="cuda", dtype="fp32")
    cs = CompressSettings(codec=codec.settings_for(4), n_clusters=3, min_span_tokens=8, max_span_tokens=24)
    compress_document(lm_gpu, DOC, tmp_path / "g.upc", cs)
    compress_document(lm, DOC, tmp_path / "c.upc", cs)
    with StateFile(tmp_path / "g.upc") as a, StateFile(tmp_path / "c.upc") as b:
        assert a.meta["n_tokens"] == b.meta["n_tokens"] and len(a.meta["clusters"]) == len(b.meta["clusters"])
    got, _ = load_prefix(tmp_path / "g.upc", lm)
    ref, _ = load_prefix(tmp_path / "c.upc", lm)
    for layer in range(lm.geometry.n_layers):
        for x, y in ((got.keys[layer], ref.keys[layer]), (got.values[layer], ref.values[layer])):
            assert torch.isfinite(x).all()
            assert (x - y).norm() <= 0.25 * y.norm()


@pytest.mark.parametrize("spec", ["ratio=4", "per-head", "ratio=2", "ratio=16"])   # int8, fp16, int6 bases
@pytest.mark.parametrize("partial", [False, True])
def test_gpu_load_matches_host_decode(lm, tmp_path, spec, partial):
    s = codec.settings_for(4, joint_heads=False) if spec == "per-head" else codec.settings_for(spec)
    out = tmp_path / "s.upc"
    # (the codec's decode alone: no recomputed tail, which ``auto`` keeps at 16x)
    compress_document(lm, DOC, out, CompressSettings(codec=s, n_clusters=3, min_span_tokens=8, max_span_tokens=24,
                                                     recompute_tokens=0))
    if partial:
        with StateFile(out) as sf:
            other = next(c for c in sf.meta["clusters"] if c["token_ranges"][0][0] > 0)
        clusters, layers = [str(other["id"])], [0, 2]
    else:
        clusters, layers = None, None
    ref, report = load_prefix(out, lm, clusters=clusters, layers=layers)
    hot, keys, values = _staged_load(out, lm, clusters=clusters, layers=layers)
    assert hot.bytes_read == report.bytes_read
    assert int(hot.positions.numel()) == report.tokens
    for layer in range(lm.geometry.n_layers):
        rk, rv = ref.keys[layer], ref.values[layer]
        if rk.shape[1] == 0:
            assert keys[layer] is None
            continue
        for got, want in ((keys[layer], rk), (values[layer], rv)):
            assert got.shape == want.shape
            assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)


def test_hot_tier_lru_and_spare_buffers():
    tier = load.HotTier(capacity_bytes=250, spare=1, pin=False)

    def hot(key, n):
        return load.HotState(key=key, buffer=tier.buffer(n), H=1, d=2, rows=0, dest=torch.zeros(0),
                                 positions=torch.zeros(0), layers=[])

    tier.put(hot("a", 100))
    tier.put(hot("b", 100))
    assert tier.get("a") is not None            # a is now the most recent
    tier.put(hot("c", 100))                     # over 250 bytes: b (least recent) goes
    assert tier.get("b") is None and tier.get("a") is not None and tier.get("c") is not None
    assert tier.hits == 3 and tier.misses == 1
    spare = tier._spare[0]
    assert tier.buffer(50).data_ptr() == spare.data_ptr()   # reused, not allocated
