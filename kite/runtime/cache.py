"""The KV cache KITE generates with: per-layer prefixes (from a state) followed by live tokens."""

from __future__ import annotations

import functools

import torch

from kite.runtime.resident import KVPrefix

__all__ = ["KVPrefix", "cache_layers", "new_cache"]


def new_cache(model, prefix: KVPrefix | None = None, reserve: int = 0):
    """A DynamicCache for `model`, seeded with `prefix` when given. ``reserve``: the tokens each layer
    is expected to hold in all (the prefix and what a forward appends): its keys and values then live
    in buffers of that length, written in place (:func:`reserved_layer`), so a long prefix is copied
    once rather than again at every append."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    if reserve > 0:
        # full-attention layers alone: a sliding window's layer keeps transformers' own
        cache.layers = [reserved_layer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if prefix is not None:
        n_layers = model.config.num_hidden_layers
        if prefix.n_layers != n_layers:
            raise ValueError(f"prefix has {prefix.n_layers} layers, the model {n_layers}")
        param = next(model.parameters())
        for layer, (k, v) in enumerate(zip(prefix.keys, prefix.values)):
            cache.update(k.to(param.device, param.dtype).unsqueeze(0),
                         v.to(param.device, param.dtype).unsqueeze(0), layer)
    return cache


def reserved_layer(capacity: int):
    """A transformers DynamicLayer whose keys and values are views of buffers of ``capacity`` tokens,
    allocated at its first update: an update copies only the new tokens, into the next free slots.
    One that would overflow them, that finds its tensors replaced (a reorder), or whose buffers were
    made under inference mode and is updated outside it, grows by concatenation as a DynamicLayer does."""
    return _reserved_layer_class()(capacity)


@functools.cache
def _reserved_layer_class():
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = capacity
            self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

        def update(self, key_states, value_states, *args, **kwargs):
            n, m = self.get_seq_length(), key_states.shape[-2]
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                if m <= self.capacity:
                    b, h = key_states.shape[:2]
                    self.buffers = (key_states.new_empty(b, h, self.capacity, key_states.shape[-1]),
                                    value_states.new_empty(b, h, self.capacity, value_states.shape[-1]))
            kb, vb = self.buffers or (None, None)
            # (buffers made under inference mode take no in-place write outside it)
            if (kb is None or n + m > self.capacity or kb.shape[:2] != key_states.shape[:2]
                    or (n > 0 and (self.keys.data_ptr(), self.values.data_ptr()) != (kb.data_ptr(), vb.data_ptr()))
                    or (kb.is_inference() and not torch.is_inference_mode_enabled())):
                self.buffers = None
                return super().update(key_states, value_states, *args, **kwargs)
            kb[:, :, n:n + m].copy_(key_states)
            vb[:, :, n:n + m].copy_(value_states)
            self.keys, self.values = kb[:, :, :n + m], vb[:, :, :n + m]
            return self.keys, self.values

    return ReservedLayer


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, [B, H_kv, T, d] each."""
    return [(layer.keys, layer.values) for layer in cache.layers]
