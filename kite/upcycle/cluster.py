"""k-means over span embeddings (cosine geometry, k-means++ seeding, deterministic)."""

from __future__ import annotations

import torch

from kite.kernels.kmeans import lloyd_cosine


def kmeans(x: torch.Tensor, k: int, iters: int = 30, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cluster rows of x [n, D] into k groups. Returns (assignment [n] long, centroids [k, D]).

    Rows are L2-normalised first; k is capped at the number of distinct rows. Empty clusters are
    reseeded with the points farthest from their centroids, and the returned cluster ids are
    renumbered 0..k'-1 over the non-empty ones, so every returned cluster has a member.
    """
    n = x.shape[0]
    if n == 0:
        raise ValueError("nothing to cluster")
    x = torch.nn.functional.normalize(x.float(), dim=1)
    # the seeding runs on the host whatever x's device (same seeds for the same rows; a CUDA
    # tensor takes no CPU generator), Lloyd's iterations on x's device
    xh = x.cpu()
    k = max(1, min(k, torch.unique(xh.round(decimals=5), dim=0).shape[0]))
    g = torch.Generator().manual_seed(seed)
    centroids = xh[torch.randint(n, (1,), generator=g)]
    for _ in range(1, k):  # k-means++
        d2 = (1 - xh @ centroids.T).clamp_min(0).min(dim=1).values
        if d2.sum() <= 0:
            idx = torch.randint(n, (1,), generator=g)
        else:
            idx = torch.multinomial(d2 / d2.sum(), 1, generator=g)
        centroids = torch.cat([centroids, xh[idx]])
    assign, centroids, _ = lloyd_cosine(x, centroids.to(x.device), iters)  # native when built, else torch
    used = torch.unique(assign)
    remap = torch.full((k,), -1, dtype=torch.long, device=assign.device)
    remap[used] = torch.arange(used.numel(), device=assign.device)
    return remap[assign], centroids[used]
