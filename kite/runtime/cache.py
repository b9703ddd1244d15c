"""The KV cache KITE generates with: per-layer prefixes (from a state) followed by live tokens."""

from __future__ import annotations

import torch

from kite.runtime.resident import KVPrefix

__all__ = ["KVPrefix", "cache_layers", "new_cache"]


def new_cache(model, prefix: KVPrefix | None = None):
    """A DynamicCache for `model`, seeded with `prefix` when given."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if prefix is not None:
        n_layers = model.config.num_hidden_layers
        if prefix.n_layers != n_layers:
            raise ValueError(f"prefix has {prefix.n_layers} layers, the model {n_layers}")
        param = next(model.parameters())
        for layer, (k, v) in enumerate(zip(prefix.keys, prefix.values)):
            cache.update(k.to(param.device, param.dtype).unsqueeze(0),
                         v.to(param.device, param.dtype).unsqueeze(0), layer)
    return cache


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, [B, H_kv, T, d] each."""
    return [(layer.keys, layer.values) for layer in cache.layers]
