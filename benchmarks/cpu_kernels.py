"""Native CPU kernels vs their pure-torch fallbacks, side by side (the issue's CPU target).

    make build-runtime && .venv/bin/python benchmarks/cpu_kernels.py [--reps 5] [--json out/cpu_kernels.json]

Shapes are the embedded model's (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, hidden 576) on
a 2,048-token document. Each figure is the median of --reps runs after a warm-up, on fresh random
inputs; the load average before and after is printed because the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kite.kernels import eigh, kmeans, native, quant  # noqa: E402
from kite.upcycle import codec  # noqa: E402


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def cases(T: int = 2048, L: int = 30, H: int = 3, d: int = 64, hidden: int = 576):
    g = torch.Generator().manual_seed(int(time.time()))
    # quantization: one layer's PCA coefficients (192 columns x T tokens, groups of 256 tokens)
    x = torch.randn(192 * T // 256, 256, generator=g)
    yield ("quantize int4 minmax", f"[{x.shape[0]}, 256]",
           lambda: quant.quantize_groups(x, 4), lambda: quant.quantize_groups_torch(x, 4))
    yield ("quantize int3 mse", f"[{x.shape[0]}, 256]",
           lambda: quant.quantize_groups(x, 3, "mse"), lambda: quant.quantize_groups_torch(x, 3, "mse"))
    p, s, m = quant.quantize_groups_torch(x, 4)
    yield ("dequantize int4", f"[{x.shape[0]}, 256]",
           lambda: quant.dequantize_groups(p, *x.shape, 4, s, m),
           lambda: quant.dequantize_groups_torch(p, *x.shape, 4, s, m))
    # k-means over span embeddings (spans of 32 tokens)
    n = T // 32
    e = torch.nn.functional.normalize(torch.randn(n, hidden, generator=g), dim=1)
    init = e[:8].clone()
    yield ("k-means Lloyd (30 iters max)", f"n={n}, D={hidden}, k=8",
           lambda: kmeans.lloyd_cosine(e, init, 30), lambda: kmeans.lloyd_cosine_torch(e, init, 30))
    # factorization: per-head Gram matrices, and the joint-heads ones (D = H*d)
    for B, D in ((2 * L * H // 4, d), (2 * L // 4, H * d)):
        X = torch.randn(B, 2 * D, D, generator=g, dtype=torch.float64)
        A = X.transpose(1, 2) @ X
        yield (f"eigh {B} x {D}x{D}", "float64", lambda A=A: eigh.eigh_desc(A), lambda A=A: eigh.eigh_desc_torch(A))
    Xk = torch.randn(H, T, d, generator=g) * torch.linspace(3, 0.05, d)
    Xb = Xk.repeat(4, 1, 1)
    yield ("batched_pca (Gram + eigh)", f"[{Xb.shape[0]}, {T}, {d}]",
           lambda: eigh.batched_pca(Xb), lambda: codec.batched_pca(Xb))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if native.cpu() is None:
        raise SystemExit("native runtime not built (or KITE_RUNTIME=torch): run `make build-runtime`")
    load_before = os.getloadavg()
    print(f"{native.cpu().kite_runtime_version().decode()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}", flush=True)
    rows = []
    for name, shape, fast, slow in cases():
        nat, ref = median_ms(fast, args.reps), median_ms(slow, args.reps)
        rows.append({"kernel": name, "shape": shape, "native_ms": nat, "torch_ms": ref, "speedup": ref / nat})
        print(f"  {name:32s} {shape:24s} native {nat:10.2f} ms   torch {ref:10.2f} ms   x{ref / nat:7.1f}",
              flush=True)
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    print("\n| kernel | shape | native ms | torch ms | torch / native |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r['shape']} | {r['native_ms']:.2f} | {r['torch_ms']:.2f} | {r['speedup']:.1f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"load_before": load_before, "load_after": load_after, "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
