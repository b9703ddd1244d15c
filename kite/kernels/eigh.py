"""Batched symmetric eigendecomposition and PCA of many small matrices, native or torch.

CPU: Householder + implicit QL in float64, one matrix per thread (``torch.linalg.eigh`` solves one
matrix at a time through LAPACK, far slower for many small ones). CUDA: one launch, one thread block
per matrix (parallel Jacobi in fp32 shared memory) for even d <= 128; larger d (the joint-head 512
dims of Qwen2-7B) goes to cuSOLVER's batched solver in one call (:mod:`kite.kernels.cusolver`;
``torch.linalg.eigh`` runs one ``syevd`` per matrix), and to torch when that is missing. The solvers
are compared in docs/PERFORMANCE.md (``benchmarks/eigh_gpu.py``). A matrix the batched solver did not converge on gets NaN eigenvalues
(no host sync here: callers check ``isfinite`` where they read the results back).
"""

from __future__ import annotations

import torch

from kite.kernels import cusolver, native

__all__ = ["eigh_desc", "eigh_desc_torch", "batched_pca", "centered_gram", "large_backend"]

CUDA_MAX_D = 128


def eigh_desc(A: torch.Tensor, max_sweeps: int = 15) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues [B, d] in descending order and eigenvectors [B, d, d] (column j = vector j) of
    symmetric ``A`` [B, d, d]. CPU: float64 results; CUDA: float32. Eigenvector signs are arbitrary.
    """
    B, d, _ = A.shape
    lib = native.lib_for(A)
    if A.is_cuda and (lib is None or d > CUDA_MAX_D or d % 2) and cusolver.available():
        evals, evecs, info = cusolver.syev_batched(A.float())
        evals = torch.where((info == 0)[:, None], evals, torch.full_like(evals, float("nan")))
        return evals.flip(-1), evecs.flip(-1)
    if lib is None or (A.is_cuda and (d > CUDA_MAX_D or d % 2)):
        return eigh_desc_torch(A)
    if A.is_cuda:
        a = A.float().contiguous()
        evals = torch.empty(B, d, dtype=torch.float32, device=A.device)
        evecs = torch.empty(B, d, d, dtype=torch.float32, device=A.device)
        rc = lib.kite_cuda_eigh_batched(a.data_ptr(), B, d, evals.data_ptr(), evecs.data_ptr(), max_sweeps,
                                        native.stream(a))
    else:
        a = A.double().contiguous()
        evals = torch.empty(B, d, dtype=torch.float64)
        evecs = torch.empty(B, d, d, dtype=torch.float64)
        rc = lib.kite_eigh_batched(a.data_ptr(), B, d, evals.data_ptr(), evecs.data_ptr())
    native.check(rc, "eigh_desc")
    return evals, evecs


def eigh_desc_torch(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    evals, evecs = torch.linalg.eigh(A)
    return evals.flip(-1), evecs.flip(-1)


def large_backend(device: str = "cpu") -> str:
    """What decomposes matrices the Jacobi kernel does not take (d > 128) on ``device``."""
    if str(device).startswith("cuda") and cusolver.available():
        return "cusolver-batched"
    return "torch"


def centered_gram(X: torch.Tensor, center: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """X [B, T, d] -> (mean [B, d], Gram of the centered rows over T [B, d, d]).

    Float64 on the CPU (as codec does); float32 on a GPU, where the matmul may use TF32 when the
    caller allows it (rounding errors of the inputs are unbiased, so over T = 16K tokens the Gram
    moves by ~1e-5 of its scale)."""
    wide = torch.float32 if X.is_cuda else torch.float64
    Xd = X.to(wide)
    mean = Xd.mean(dim=1) if center else torch.zeros(X.shape[0], X.shape[2], dtype=wide, device=X.device)
    Xc = Xd - mean[:, None, :]
    return mean, Xc.transpose(1, 2) @ Xc / max(1, X.shape[1])


def batched_pca(X: torch.Tensor, center: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PCA of many small matrices at once: X [B, T, d] -> mean [B, d], eigenvalues [B, d]
    (descending, per-token variances (Gram / T), clamped at 0; NaN where a GPU solver did not
    converge), U [B, d, d], all float32: one batched Gram and one batched symmetric eigensolver
    instead of a per-matrix SVD.

    Gram in float64 on the CPU (as codec does), float32 on a GPU (the Jacobi kernel is fp32).
    """
    mean, G = centered_gram(X, center)
    evals, evecs = eigh_desc(G)
    return mean.float(), evals.clamp_min(0).float(), evecs.float()
