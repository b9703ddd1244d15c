"""The joint-head codec's eigensolver on a GPU: every way to get 2 x 28 eigendecompositions of
512x512 Grams, timed side by side in one run, with their accuracy.

    python benchmarks/eigh_gpu.py [--layers 28] [--dim 512] [--tokens 16384] [--repeat 5]

Grams come from [layers, tokens, dim] fp32 data with a power-law spectrum (the KV of a trained model
decays; random weights give a flat one, so both are timed). Rows:

* ``torch.linalg.eigh`` (one ``syevd`` per matrix on the current stream);
* ``cusolverDnXsyevBatched`` through ``kite.kernels.cusolver`` (one call for the batch), fp32, fp64;
  direct or replayed from a CUDA graph;
* ``torch.linalg.eigh`` split over 8 host threads, one CUDA stream each;
* for scale: the Jacobi kernel on the per-head 128x128 blocks, and the Gram itself;
* the joint codec's projection ([layers, tokens, 512] @ [512, 512]) in fp32, TF32 and bf16.

Accuracy: max over matrices of ||G V - V diag(w)||_F / ||G||_F, ||V^T V - I||_max, and the largest
eigenvalue error relative to the largest eigenvalue, against fp64 ``torch.linalg.eigh``.

Baselines: each eigensolver against ``torch.linalg.eigh`` fp32 of the same spectrum, each projection
against fp32. Floors: the Gram and the projections at the bf16 tensor rate (2 L T D^2 FLOPs), the
eigensolvers at reading their Grams once from HBM.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import Result, bytes_ms, finish, flops_ms, parse, parser, time_ms  # noqa: E402
from harness.floors import bf16_text, hbm_text  # noqa: E402


def grams(L: int, T: int, D: int, decay: float, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = torch.arange(1, D + 1, device="cuda", dtype=torch.float32) ** (-decay)
    Q, _ = torch.linalg.qr(torch.randn(L, D, D, device="cuda", generator=g))
    X = torch.randn(L, T, D, device="cuda", generator=g) * s
    X = X @ Q.transpose(1, 2)
    X = X - X.mean(1, keepdim=True)
    return X, (X.transpose(1, 2) @ X) / T


def accuracy(G: torch.Tensor, w: torch.Tensor, V: torch.Tensor, w_ref: torch.Tensor) -> dict:
    G, w, V = G.double(), w.double(), V.double()
    res = torch.linalg.matrix_norm(G @ V - V * w[:, None, :]) / torch.linalg.matrix_norm(G)
    eye = torch.eye(G.shape[-1], dtype=torch.float64, device=G.device)
    orth = (V.transpose(1, 2) @ V - eye).abs().amax()
    ev = ((w.sort(dim=1).values - w_ref.sort(dim=1).values).abs().amax(dim=1) / w_ref.abs().amax(dim=1)).max()
    return {"residual": float(res.max()), "orthogonality": float(orth), "eigenvalue_rel_err": float(ev)}


def main(argv=None) -> int:
    ap = parser(__doc__, timing=True, repeat=5, warmup=1, device="cuda")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16384)
    args = parse(ap, argv)
    from kite.kernels import cusolver, eigh

    L, D, T = args.layers, args.dim, args.tokens
    res = Result("eigh_gpu", device=args.device)
    res.raw.update(cusolver_batched=cusolver.available())
    matmul = (f"2 x {L} x {T} x {D}^2 FLOPs {bf16_text()}", flops_ms(2 * L * T * D * D))

    def cuda_ms(fn, reps=None):
        return time_ms(fn, reps or args.repeat, args.warmup, device=args.device)

    def row(name: str, t, acc: dict | None = None, baseline=None, floor=(None, None)) -> None:
        res.timing(name, t, baseline=baseline, floor=floor[0], floor_value=floor[1], **(acc or {}))

    for decay in (0.0, 1.0):
        X, G1 = grams(L, T, D, decay, seed=0)
        _, G2 = grams(L, T, D, decay, seed=1)
        G = torch.cat([G1, G2])                            # both sides: 2L matrices
        tag = f"{2 * L} x {D}x{D}, spectrum ~ k^-{decay:g}"
        base = f"torch.linalg.eigh fp32, {tag}"
        read = (f"{2 * L} fp32 Grams read once {hbm_text()}", bytes_ms(G.numel() * 4))
        half = (read[0].replace(f"{2 * L} fp32", f"{L} fp32"), read[1] / 2)
        w64, _ = torch.linalg.eigh(G.double())
        row(f"Gram [{L}, {T}, {D}] fp32 (one side), spectrum ~ k^-{decay:g}", cuda_ms(lambda: X.transpose(1, 2) @ X),
            floor=matmul)
        ms = cuda_ms(lambda: torch.linalg.eigh(G), reps=3)
        w, V = torch.linalg.eigh(G)
        row(base, ms, accuracy(G, w, V, w64), floor=read)
        if cusolver.available():
            for dt in (torch.float32, torch.float64):
                Gd = G.to(dt)
                ms = cuda_ms(lambda: cusolver.syev_batched(Gd))
                w, V, info = cusolver.syev_batched(Gd)
                acc = accuracy(G, w, V, w64)
                acc["info_nonzero"] = int((info != 0).sum())
                row(f"cusolverDnXsyevBatched {str(dt)[6:]}, graph replay, {tag}", ms, acc, base, read)
            sides = [G[:L].contiguous(), G[L:].contiguous()]
            streams = [torch.cuda.Stream(), torch.cuda.Stream()]

            def two_streams():
                main = torch.cuda.current_stream()
                res = []
                for Gs, st in zip(sides, streams):
                    st.wait_stream(main)
                    with torch.cuda.stream(st):
                        res.append(cusolver.syev_batched(Gs))
                for st in streams:
                    main.wait_stream(st)
                return res
            ms = cuda_ms(two_streams)
            res = two_streams()
            torch.cuda.synchronize()
            w = torch.cat([r[0] for r in res])
            V = torch.cat([r[1] for r in res])
            row(f"cusolverDnXsyevBatched fp32, graph replay, each side ({L}) on its own stream + handle, {tag}",
                ms, accuracy(G, w, V, w64), base, read)
            Gh = G[:L].contiguous()
            row(f"cusolverDnXsyevBatched fp32, one side ({L} matrices), graph, 1 stream, {tag}",
                cuda_ms(lambda: cusolver.syev_batched(Gh)), floor=half)

        def threaded(n_threads: int = 8) -> None:
            chunks = G.chunk(n_threads)

            def work(c):
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    torch.linalg.eigh(c)
                s.synchronize()
            ts = [threading.Thread(target=work, args=(c,)) for c in chunks]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        row(f"torch.linalg.eigh fp32 in 8 threads x 1 stream, {tag}", cuda_ms(threaded, reps=3), None, base, read)
        H = D // 128
        blocks = torch.stack([G[:, h * 128:(h + 1) * 128, h * 128:(h + 1) * 128] for h in range(H)], 1)
        blocks = blocks.reshape(-1, 128, 128).contiguous()
        row(f"per-head blocks: eigh_desc (Jacobi kernel when built) {blocks.shape[0]} x 128x128, "
            f"spectrum ~ k^-{decay:g}", cuda_ms(lambda: eigh.eigh_desc(blocks)),
            floor=(f"{blocks.shape[0]} fp32 blocks read once {hbm_text()}", bytes_ms(blocks.numel() * 4)))
        X = G1 = G2 = G = blocks = None  # free before the next spectrum
        torch.cuda.empty_cache()

    X = torch.randn(L, T, D, device="cuda")
    U = torch.linalg.qr(torch.randn(L, D, D, device="cuda"))[0]
    ref = (X.double() @ U.double())
    for name, fn in (("fp32", lambda: X @ U),
                     ("bf16", lambda: (X.bfloat16() @ U.bfloat16()).float())):
        torch.backends.cuda.matmul.allow_tf32 = False
        ms = cuda_ms(fn)
        err = float(((fn().double() - ref).norm() / ref.norm()))
        row(f"project [{L}, {T}, {D}] @ [{D}, {D}] {name}", ms, {"rel_err": err},
            None if name == "fp32" else f"project [{L}, {T}, {D}] @ [{D}, {D}] fp32", matmul)
    torch.backends.cuda.matmul.allow_tf32 = True
    ms = cuda_ms(lambda: X @ U)
    err = float(((X @ U).double() - ref).norm() / ref.norm())
    row(f"project [{L}, {T}, {D}] @ [{D}, {D}] tf32", ms, {"rel_err": err},
        f"project [{L}, {T}, {D}] @ [{D}, {D}] fp32", matmul)
    torch.backends.cuda.matmul.allow_tf32 = False
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
