"""Attention-aware distortion weights: what an error in a stored key or value costs the model.

The codec's PCA and bit allocation minimise a squared error. What attention feels is not the
plain squared error of the keys and values:

* a key error ``dk`` (pre-RoPE) moves a score by ``q . R dk``, with ``R`` the rotation of the
  key's position relative to the query's. Averaged over relative positions, a RoPE pair
  ``(i, i + d/2)`` of the error costs ``E[q_i^2 + q_{i+d/2}^2]`` per unit of its squared size
  (the rotation keeps each pair's energy and scatters its direction), summed over the query heads
  that read the KV head (GQA). So a key dim's weight is its RoPE pair's query energy, measured on
  the calibration documents (:attr:`kite.upcycle.capture.Capture.query_sq`);
* a value error ``dv`` reaches the residual stream as ``W_o dv`` (attention averages the values
  first): a value dim's weight is the energy of its ``o_proj`` columns, summed over the query heads
  that read the KV head. It is a property of the weights alone.

Only the weights' relative sizes inside one (layer, side) matter to the codec (each side has its
own byte budget), so each block's weights are scaled to mean 1; a floor keeps every dim's weight
above ``FLOOR`` of that mean (a dim no query reads is still stored, only coarsely).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kite.model import LoadedModel

FLOOR = 1e-3
_O_PROJ = re.compile(r"layers\.(\d+)\.self_attn\.o_proj$")


def key_weights(query_sq: torch.Tensor, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[H_kv, d] key weights from one layer's summed squared queries [H_q * d] (pre-RoPE,
    transformers' rotate-half pairing: dim i pairs with i + d/2; query head h reads KV head
    h // (H_q / H_kv))."""
    q = query_sq.double().reshape(-1, head_dim)                      # [H_q, d]
    half = head_dim // 2
    pair = q[:, :half] + q[:, half:2 * half]
    q = torch.cat([pair, pair] + ([q[:, 2 * half:]] if head_dim % 2 else []), dim=1)
    return _per_kv(q, n_kv_heads)


def value_weights(o_weight: torch.Tensor, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[H_kv, d] value weights from one layer's ``o_proj`` weight [hidden, H_q * d]."""
    e = o_weight.detach().double().pow(2).sum(dim=0).reshape(-1, head_dim)   # [H_q, d]
    return _per_kv(e, n_kv_heads)


def _per_kv(per_q: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    n_q = per_q.shape[0]
    if n_q % n_kv_heads:
        raise ValueError(f"{n_q} query heads do not group over {n_kv_heads} KV heads")
    return per_q.reshape(n_kv_heads, n_q // n_kv_heads, -1).sum(dim=1)


def model_value_weights(lm: LoadedModel) -> list[torch.Tensor]:
    """Every layer's value weights [H_kv, d] from the model's ``o_proj`` weights."""
    found = {}
    for name, module in lm.model.named_modules():
        m = _O_PROJ.search(name)
        if m is not None:
            weight = getattr(module, "base_layer", module).weight
            found[int(m.group(1))] = value_weights(weight.float().cpu(), lm.geometry.n_kv_heads, lm.geometry.head_dim)
    n = lm.geometry.n_layers
    if sorted(found) != list(range(n)):
        raise ValueError(f"found the output projections of layers {sorted(found)}, not of all {n}")
    return [found[i] for i in range(n)]


def as_blocks(w: torch.Tensor, joint: bool) -> torch.Tensor:
    """[H, d] weights -> [B, D] in the codec's blocks (joint: one block of H*d dims, head-major),
    each block scaled to mean 1 and floored at ``FLOOR``."""
    H, d = w.shape
    b = w.double().reshape(1, H * d) if joint else w.double()
    b = b / b.mean(dim=1, keepdim=True).clamp_min(1e-300)
    return b.clamp_min(FLOOR).float().contiguous()


__all__ = ["FLOOR", "as_blocks", "key_weights", "model_value_weights", "value_weights"]
