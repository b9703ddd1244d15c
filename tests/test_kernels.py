"""Native kernels vs their pure-torch fallbacks (and the codec they serve), on fresh random inputs.

Native comparisons skip when build/libkite_runtime.so is not built (then only the fallbacks
run); CUDA ones skip without a GPU or without build/libkite_runtime_cuda.so.
"""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kite.kernels import eigh, kmeans, native, quant
from kite.kernels.backend import backend
from kite.kernels.locate import cpu_version, runtime_path, runtime_status
from kite.upcycle import codec
from kite.upcycle.codec import quant as upq

ROOT = Path(__file__).resolve().parent.parent
has_cpu = pytest.mark.skipif(native.cpu() is None, reason="native runtime not built (make build-runtime)")
has_cuda = pytest.mark.skipif(not torch.cuda.is_available() or native.cuda() is None,
                              reason="no GPU or CUDA runtime not built")


def _rng(seed=None):
    return torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))) if seed is None else seed)


def _native_quant(g, bits, mode):
    return quant.quantize_groups(g, bits, mode)


# ---------------------------------------------------------------------------------------------
# quantization


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("shape,gs,axis", [((37, 64), 32, -1), ((300, 5), 128, -2), ((9, 13), 0, -1)])
def test_quant_fallback_matches_upcycle_quant(bits, shape, gs, axis):
    x = torch.randn(*shape, generator=_rng()) * 3 + 1
    ref = upq.quantize(x, f"int{bits}", group_size=gs, axis=axis)
    g, _ = upq.grouped(x.float(), gs, axis)
    packed, scale, mn = quant.quantize_groups_torch(g, bits)
    assert torch.equal(packed, ref.tensors["codes"])
    assert torch.equal(scale, ref.tensors["scale"]) and torch.equal(mn, ref.tensors["min"])
    back = quant.dequantize_groups_torch(packed, *g.shape, bits, scale, mn)
    assert torch.equal(back, upq.grouped(upq.dequantize(ref), gs, axis)[0])
    assert torch.allclose(back, g, atol=float(scale.float().max()) / 2 + 1e-6)


@has_cpu
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("G,gs", [(257, 32), (64, 128), (3, 7), (1000, 5)])
def test_quant_minmax_native_bit_exact(bits, G, gs):
    g = torch.randn(G, gs, generator=_rng()) * torch.rand(G, 1, generator=_rng()) * 10
    g[0] = 0.5  # a constant group: zero range
    want = quant.quantize_groups_torch(g, bits)
    got = _native_quant(g, bits, "minmax")
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    back = quant.dequantize_groups(got[0], G, gs, bits, got[1], got[2])
    assert torch.equal(back, quant.dequantize_groups_torch(*want[:1], G, gs, bits, *want[1:]))


@has_cpu
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6])
def test_quant_mse_native_matches_fallback(bits):
    G, gs = 400, 128
    g = torch.randn(G, gs, generator=_rng()) * 2 - 0.3
    want = quant.quantize_groups_torch(g, bits, "mse")
    got = _native_quant(g, bits, "mse")
    # the grid choice compares squared errors whose sums differ in order: near-ties may flip
    same = (got[1] == want[1]) & (got[2] == want[2])
    assert same.float().mean() > 0.97
    e_native = (quant.dequantize_groups(got[0], G, gs, bits, got[1], got[2]) - g).pow(2).sum()
    e_torch = (quant.dequantize_groups_torch(want[0], G, gs, bits, want[1], want[2]) - g).pow(2).sum()
    assert e_native <= e_torch * 1.001


# ---------------------------------------------------------------------------------------------
# k-means


def _blobs(n=600, D=96, k=7):
    g = _rng()
    centers = torch.nn.functional.normalize(torch.randn(k, D, generator=g), dim=1)
    x = centers[torch.randint(k, (n,), generator=g)] + 0.15 * torch.randn(n, D, generator=g)
    x = torch.nn.functional.normalize(x, dim=1)
    init = x[torch.randperm(n, generator=g)[:k]].clone()
    return x, init


@has_cpu
@pytest.mark.parametrize("k", [1, 7, 12])
def test_kmeans_native_matches_fallback(k):
    x, _ = _blobs()
    init = x[torch.randperm(x.shape[0], generator=_rng())[:k]].clone()
    a1, c1, it1 = kmeans.lloyd_cosine(x, init, 30)
    a2, c2, it2 = kmeans.lloyd_cosine_torch(x, init, 30)
    assert torch.equal(a1, a2) and it1 == it2
    assert torch.allclose(c1, c2, atol=1e-5)


@has_cpu
def test_kmeans_native_reseeds_empty_clusters():
    x, _ = _blobs(n=200, D=32, k=3)
    init = torch.cat([x[:3], x[:1]])  # two identical centroids: one stays empty at first
    a1, c1, _ = kmeans.lloyd_cosine(x, init, 10)
    a2, c2, _ = kmeans.lloyd_cosine_torch(x, init, 10)
    assert torch.equal(a1, a2)
    assert torch.bincount(a1, minlength=4).min() > 0


# ---------------------------------------------------------------------------------------------
# eigendecomposition / PCA


def _check_eigh(A, evals, evecs, atol):
    A, evals, evecs = A.double(), evals.double(), evecs.double()
    assert (evals[:, :-1] >= evals[:, 1:] - atol).all()
    resid = A @ evecs - evecs * evals[:, None, :]
    assert resid.abs().max() <= atol * max(1.0, A.abs().max().item())
    eye = torch.eye(A.shape[-1], dtype=torch.float64)
    assert (evecs.transpose(1, 2) @ evecs - eye).abs().max() <= atol


@has_cpu
@pytest.mark.parametrize("B,d", [(5, 64), (3, 128), (4, 33), (2, 1)])
def test_eigh_native_matches_fallback(B, d):
    X = torch.randn(B, 2 * d + 3, d, generator=_rng(), dtype=torch.float64)
    X[..., : max(1, d // 4)] *= 10  # a spread spectrum, like keys
    A = X.transpose(1, 2) @ X
    ev, U = eigh.eigh_desc(A)
    ev_t, _ = eigh.eigh_desc_torch(A)
    assert torch.allclose(ev, ev_t, rtol=1e-9, atol=1e-9 * ev_t.abs().max().item())
    _check_eigh(A, ev, U, 1e-9)


@has_cpu
@pytest.mark.parametrize("center", [True, False])
def test_batched_pca_matches_codec(center):
    X = torch.randn(6, 300, 64, generator=_rng()) * torch.linspace(3, 0.1, 64) + 0.5
    m1, e1, U1 = eigh.batched_pca(X, center)
    m2, e2, U2 = codec.batched_pca(X, center)
    assert torch.allclose(m1, m2) and torch.allclose(e1, e2, rtol=1e-5, atol=1e-6)
    top = 8  # distinct leading eigenvalues: vectors agree up to sign
    assert torch.allclose((U1[..., :top] * U2[..., :top]).sum(1).abs(), torch.ones(6, top), atol=1e-4)


# ---------------------------------------------------------------------------------------------
# library, build, backend selection


def test_backend_follows_env(monkeypatch):
    monkeypatch.setenv("KITE_RUNTIME", "torch")
    assert backend() == "torch" and backend("cuda") == "torch"
    assert "forces the fallback" in runtime_status() or "not built" in runtime_status()
    x = torch.randn(50, 8)
    assert quant.quantize_groups(x, 3)[0].numel() == math.ceil(400 * 3 / 8)


@has_cpu
def test_library_reports_version():
    assert native.cpu().kite_runtime_abi() == native.ABI
    assert cpu_version().startswith("kite-runtime ")
    assert "CPU kernels" in runtime_status() and backend() == "native-cpu"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("make") is None, reason="no g++ / make")
def test_build_from_clean_tree(tmp_path):
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    r = subprocess.run(["make", "-C", str(tmp_path), "build-runtime", "KITE_NO_CUDA=1"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lib = ctypes.CDLL(str(tmp_path / "build" / "libkite_runtime.so"))
    lib.kite_runtime_version.restype = ctypes.c_char_p
    assert lib.kite_runtime_version().decode().startswith(f"kite-runtime {native.ABI}.")
    assert runtime_path() is None or runtime_path().name == "libkite_runtime.so"


# ---------------------------------------------------------------------------------------------
# CUDA kernels (GPU machines only)


@has_cuda
def test_cuda_kmeans_matches_fallback():
    x, init = _blobs(n=2000, D=512, k=12)
    a1, c1, it1 = kmeans.lloyd_cosine(x.cuda(), init.cuda(), 30)
    a2, c2, it2 = kmeans.lloyd_cosine_torch(x, init, 30)
    assert torch.equal(a1.cpu(), a2) and it1 == it2
    assert torch.allclose(c1.cpu(), c2, atol=1e-4)


@has_cuda
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_eigh_matches_fallback(d):
    _check_cuda_eigh(_gram_batch(40, d, 3, 0.1), atol=1e-4)


def _gram_batch(B: int, d: int, hi: float, lo: float) -> torch.Tensor:
    """B symmetric PSD d x d matrices with a decaying spectrum, on the GPU."""
    X = torch.randn(B, 3 * d, d, generator=_rng()) * torch.linspace(hi, lo, d)
    return (X.transpose(1, 2) @ X / (3 * d)).cuda()


def _check_cuda_eigh(A: torch.Tensor, atol: float) -> None:
    """eigh_desc on the GPU against torch's fp64 eigenvalues, and a true decomposition."""
    ev, U = eigh.eigh_desc(A)
    ev_ref, _ = eigh.eigh_desc_torch(A.cpu().double())
    assert torch.allclose(ev.cpu().double(), ev_ref, rtol=1e-4, atol=atol * ev_ref.max().item())
    _check_eigh(A.cpu(), ev.cpu(), U.cpu(), 2e-3)


@has_cuda
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_cuda_quant_matches_fallback(bits):
    g = torch.randn(3000, 256, generator=_rng()) * 2 + 0.1
    want = quant.quantize_groups_torch(g, bits)
    got = quant.quantize_groups(g.cuda(), bits)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)
    got = quant.quantize_groups(g.cuda(), bits, "mse")
    want = quant.quantize_groups_torch(g, bits, "mse")
    same = (got[1].cpu() == want[1]) & (got[2].cpu() == want[2])
    assert same.float().mean() > 0.97


@has_cuda
@pytest.mark.parametrize("sizes", [(512, 64, 512), (3, 100, 128, 7)])
@pytest.mark.parametrize("mode", ["minmax", "mse"])
def test_cuda_quantize_plan_matches_fallback(sizes, mode):
    """One launch over rows of mixed widths and parts of several group sizes (whole bytes per group, or
    groups sharing bytes: OR-ed into words), with the decoded values, as the torch fallback lays them."""
    src, row_bits, plan, groups, n_bytes, n_sc, whole = _plan_case(sizes, seed=11)
    want = [torch.zeros(n_bytes + 8, dtype=torch.uint8), torch.zeros(n_sc, dtype=torch.float16),
            torch.zeros(n_sc, dtype=torch.float16), torch.zeros_like(src)]
    quant.quantize_plan_torch(src, row_bits, plan.base_bit, plan.base_sc, groups, mode, *want)
    deq = torch.zeros_like(src).cuda()
    got = quant.quantize_plan(src.cuda(), row_bits.cuda(), plan.base_bit.cuda(), plan.base_sc.cuda(), groups.cuda(),
                              mode, n_bytes, n_sc, whole_bytes=whole, deq=deq)
    same = (got[1].cpu() == want[1]) & (got[2].cpu() == want[2])
    if mode == "minmax":
        assert same.all() and torch.equal(got[0].cpu(), want[0][:n_bytes]) and torch.equal(deq.cpu(), want[3])
    else:   # the kernel's mean and std sum in another order (as quantize_groups): a near-tie may pick another grid
        assert same.float().mean() > 0.95


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cusolver_batched_eigh_matches_fallback():
    from kite.kernels import cusolver

    if not cusolver.available():
        pytest.skip("cusolverDnXsyevBatched missing (cuSOLVER < 11.7)")
    A = _gram_batch(6, 512, 3, 0.01)
    _check_cuda_eigh(A, atol=1e-5)
    bad = A.clone()
    bad[2, 0, 0] = float("nan")
    ev_bad, _ = eigh.eigh_desc(bad)
    assert not torch.isfinite(ev_bad[2]).all() and torch.isfinite(ev_bad[[0, 1, 3, 4, 5]]).all()


def _plan_case(sizes, seed=0, n_rows=40):
    """Rows at widths 0-8 over parts of the given sizes (group size 128, a smaller part is one group of
    its size, each part padded to whole groups): src, row_bits, the encoder's plan, the group table,
    the buffer sizes, whether every group owns whole bytes."""
    from kite.upcycle.format.bitlayout import runs_plan as _plan

    g = torch.Generator().manual_seed(seed)
    gs = torch.tensor([min(n, 128) for n in sizes])
    ng = torch.tensor([-(-n // 128) if n > 128 else 1 for n in sizes])
    first = torch.cumsum(ng * gs, 0) - ng * gs
    groups = torch.cat([torch.stack([torch.full((int(n),), c), torch.arange(int(n)),
                                     first[c] + torch.arange(int(n)) * gs[c], torch.full((int(n),), int(gs[c]))], 1)
                        for c, n in enumerate(ng)])
    src = torch.randn(2 * n_rows, int((ng * gs).sum()), generator=g) * torch.rand(2 * n_rows, 1, generator=g) * 3
    row_bits = torch.randint(0, 9, (2 * n_rows,), generator=g)
    plan = _plan(row_bits.view(2, n_rows), ng, gs, 8)
    return (src, row_bits, plan, groups, int(plan.tables[1].sum()), int(plan.tables[3].sum()),
            all(int(x) % 8 == 0 for x in gs))


@pytest.mark.parametrize("sizes", [(512, 64, 300), (3, 100, 128, 7)])
@pytest.mark.parametrize("mode", ["minmax", "mse"])
def test_quantize_plan_puts_each_group_where_the_plan_says(sizes, mode):
    """Each group quantized as quantize_groups would, its codes at its planned bit, its scale and
    minimum at its planned index, its decoded values in place; bytes of no group stay zero."""
    src, row_bits, plan, groups, n_bytes, n_sc, whole = _plan_case(sizes)
    deq = torch.zeros_like(src)
    packed, scale, mn = quant.quantize_plan(src, row_bits, plan.base_bit, plan.base_sc, groups, mode, n_bytes, n_sc,
                                            whole_bytes=whole, deq=deq)
    bits_out = torch.zeros(n_bytes * 8, dtype=torch.uint8)
    want_deq = torch.zeros_like(src)
    C = plan.base_bit.shape[1]
    seen = torch.zeros(n_sc, dtype=torch.bool)
    for r in range(src.shape[0]):
        w = int(row_bits[r])
        for c, gi, col, gs in groups.tolist():
            if not w:
                continue
            x = src[r, col:col + gs][None]
            p, sc, m = quant.quantize_groups_torch(x, w, mode if w < 8 else "minmax")
            at = int(plan.base_sc.view(-1, C)[r, c]) + gi
            assert scale[at] == sc[0] and mn[at] == m[0]
            seen[at] = True
            codes = quant._unpack(p, w, gs)
            bit = int(plan.base_bit.view(-1, C)[r, c]) + gi * gs * w
            for i, q in enumerate(codes.tolist()):
                for b in range(w):
                    bits_out[bit + i * w + b] = (q >> b) & 1
            want_deq[r, col:col + gs] = quant.dequantize_groups_torch(p, 1, gs, w, sc, m)[0]
    assert seen.all()   # every planned scale written once: the runs tile the buffer
    want = (bits_out.view(-1, 8).long() << torch.arange(8)).sum(1).to(torch.uint8)
    assert torch.equal(packed, want)
    assert torch.equal(deq, want_deq)
