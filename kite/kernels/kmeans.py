"""Cosine k-means Lloyd iterations (the loop of :func:`kite.upcycle.cluster.kmeans`), native or torch."""

from __future__ import annotations

import torch

from kite.kernels import native

__all__ = ["lloyd_cosine", "lloyd_cosine_torch"]


def lloyd_cosine(x: torch.Tensor, centroids: torch.Tensor, iters: int = 30) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Lloyd iterations from ``centroids`` [k, D] over L2-normalised rows ``x`` [n, D] (float32).

    Returns (assignment [n] int64, centroids [k, D], iterations run). Assign = argmax cosine
    (first on ties); an empty cluster takes the point least similar to its centroid; centroids =
    normalised member sums; stops when the assignment repeats. CPU or CUDA tensors.
    """
    lib = native.lib_for(x)
    if lib is None:
        return lloyd_cosine_torch(x, centroids, iters)
    x = x.float().contiguous()
    C = centroids.float().clone().contiguous()
    n, D = x.shape
    assign = torch.empty(n, dtype=torch.long, device=x.device)
    if x.is_cuda:
        rc = lib.kite_cuda_kmeans_cosine(x.data_ptr(), n, D, C.data_ptr(), C.shape[0], iters,
                                         assign.data_ptr(), native.stream(x))
    else:
        rc = lib.kite_kmeans_cosine(x.data_ptr(), n, D, C.data_ptr(), C.shape[0], iters, assign.data_ptr())
    return assign, C, native.check(rc, "lloyd_cosine")


def lloyd_cosine_torch(x: torch.Tensor, centroids: torch.Tensor, iters: int = 30):
    x = x.float()
    centroids = centroids.float().clone()
    n, k = x.shape[0], centroids.shape[0]
    assign = torch.zeros(n, dtype=torch.long, device=x.device)
    it = 0
    while it < iters:
        it += 1
        sim = x @ centroids.T
        new_assign = sim.argmax(dim=1)
        counts = torch.bincount(new_assign, minlength=k)
        empties = torch.nonzero(counts == 0).flatten().tolist()
        if empties:
            own = sim.gather(1, new_assign[:, None]).squeeze(1)
            for empty, far in zip(empties, torch.argsort(own, stable=True).tolist()):
                new_assign[far] = empty
        sums = torch.zeros_like(centroids).index_add_(0, new_assign, x)
        centroids = torch.nn.functional.normalize(sums, dim=1)
        if torch.equal(new_assign, assign):
            break
        assign = new_assign
    return assign, centroids, it
