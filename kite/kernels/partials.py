"""Attention taken in parts and merged exactly: each part returns its output normalized over its own
tokens and the log-sum-exp of its scores, and :func:`merge` makes them one softmax over the union.

A batch row whose state is held beside its slots (kite.runtime.resident) is attended so: the state's
part from its own form (e.g. kite.kernels.lanes), the row's slots by :func:`raw_partial`.
"""

from __future__ import annotations

import torch

__all__ = ["merge", "raw_partial"]


def raw_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [..., Hq, n, d] over raw keys / values [..., H, S, d] (``mask`` [..., 1|Hq, n, S]
    bool, True = visible): (out float32, lse float32; -inf and zeros where nothing is visible)."""
    Hq, H = q.shape[-3], k.shape[-3]
    if H != Hq:
        k = k.repeat_interleave(Hq // H, dim=-3)
        v = v.repeat_interleave(Hq // H, dim=-3)
    sc = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        sc = sc.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(sc, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    prob = torch.exp(sc - safe[..., None])
    return prob @ v.float(), lse


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over the union of the parts' tokens: (Σ_i w_i out_i with w_i ∝ exp(lse_i), its lse)."""
    lses = torch.stack([lse for _, lse in parts])                     # [n_parts, ...]
    top = lses.max(dim=0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lses - top)                                          # exp(-inf) = 0
    total = w.sum(dim=0).clamp_min(1e-30)
    out = sum(wi[..., None] * o for wi, (o, _) in zip(w, parts))
    return out / total[..., None], top + torch.log(total)
