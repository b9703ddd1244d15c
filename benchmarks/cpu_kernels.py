"""Native CPU kernels vs their pure-torch fallbacks, side by side (the issue's CPU target).

    make build-runtime && .venv/bin/python benchmarks/cpu_kernels.py [--repeat 5]

Shapes are the embedded model's (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, hidden 576) on
a 2,048-token document. Each figure is the median of --repeat runs after a warm-up, on random
inputs of --seed; each native row's baseline is its torch fallback. The load average before and
after is recorded because the machine may be shared. Each row's floor is the larger of its inputs read
and its output written once at this CPU's measured memory bandwidth and its least FLOPs (a k-means:
one assignment pass, 2 n D k; an eigh: the tridiagonal reduction, 4/3 D^3 a matrix; batched_pca: the
Gram matrices too, 2 B T d^2) at its measured fp32 rate (harness.floors.cpu_floor).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kite.kernels import eigh, kmeans, native, quant  # noqa: E402
from kite.upcycle import codec  # noqa: E402
from harness import Result, cpu_floor, finish, parse, parser, time_ms  # noqa: E402


def cases(seed: int, T: int = 2048, L: int = 30, H: int = 3, d: int = 64, hidden: int = 576):
    g = torch.Generator().manual_seed(seed)
    # quantization: one layer's PCA coefficients (192 columns x T tokens, groups of 256 tokens)
    x = torch.randn(192 * T // 256, 256, generator=g)
    yield ("quantize int4 minmax", f"[{x.shape[0]}, 256]",
           lambda: quant.quantize_groups(x, 4), lambda: quant.quantize_groups_torch(x, 4), x, 0)
    yield ("quantize int3 mse", f"[{x.shape[0]}, 256]",
           lambda: quant.quantize_groups(x, 3, "mse"), lambda: quant.quantize_groups_torch(x, 3, "mse"), x, 0)
    p, s, m = quant.quantize_groups_torch(x, 4)
    yield ("dequantize int4", f"[{x.shape[0]}, 256]",
           lambda: quant.dequantize_groups(p, *x.shape, 4, s, m),
           lambda: quant.dequantize_groups_torch(p, *x.shape, 4, s, m), (p, s, m), 0)
    # k-means over span embeddings (spans of 32 tokens)
    n = T // 32
    e = torch.nn.functional.normalize(torch.randn(n, hidden, generator=g), dim=1)
    init = e[:8].clone()
    yield ("k-means Lloyd (30 iters max)", f"n={n}, D={hidden}, k=8",
           lambda: kmeans.lloyd_cosine(e, init, 30), lambda: kmeans.lloyd_cosine_torch(e, init, 30), (e, init),
           2 * n * hidden * 8)
    # factorization: per-head Gram matrices, and the joint-heads ones (D = H*d)
    for B, D in ((2 * L * H // 4, d), (2 * L // 4, H * d)):
        X = torch.randn(B, 2 * D, D, generator=g, dtype=torch.float64)
        A = X.transpose(1, 2) @ X
        yield (f"eigh {B} x {D}x{D}", "float64", lambda A=A: eigh.eigh_desc(A), lambda A=A: eigh.eigh_desc_torch(A), A,
               B * 4 / 3 * D**3)
    Xk = torch.randn(H, T, d, generator=g) * torch.linspace(3, 0.05, d)
    Xb = Xk.repeat(4, 1, 1)
    yield ("batched_pca (Gram + eigh)", f"[{Xb.shape[0]}, {T}, {d}]",
           lambda: eigh.batched_pca(Xb), lambda: codec.batched_pca(Xb), Xb,
           Xb.shape[0] * (2 * T * d * d + 4 / 3 * d**3))


def nbytes(obj) -> int:
    """The bytes of the tensors in ``obj`` (a tensor, or tuples / lists of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    return sum(nbytes(o) for o in obj) if isinstance(obj, (tuple, list)) else 0


def main(argv=None) -> int:
    ap = parser(__doc__, timing=True, repeat=5, warmup=1, device="cpu")
    args = parse(ap, argv)
    if native.cpu() is None:
        raise SystemExit("native runtime not built (or KITE_RUNTIME=torch): run `make build-runtime`")
    res = Result("cpu_kernels", device="cpu")
    res.raw.update(runtime=native.cpu().kite_runtime_version().decode(), threads=torch.get_num_threads(),
                   load_before=os.getloadavg())
    for name, shape, fast, slow, inputs, flops in cases(args.seed):
        moved = nbytes(inputs) + nbytes(slow())
        floor, floor_ms = cpu_floor(moved, flops, f"inputs + output ({moved / 1e6:.3g} MB) once")
        ref = time_ms(slow, args.repeat, args.warmup)
        nat = time_ms(fast, args.repeat, args.warmup)
        res.timing(f"{name}, torch", ref, shape=shape, floor=floor, floor_value=floor_ms)
        res.timing(f"{name}, native", nat, baseline=f"{name}, torch", shape=shape, floor=floor, floor_value=floor_ms)
    res.raw["load_after"] = os.getloadavg()
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
