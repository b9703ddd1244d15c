"""The KV cache KITE generates with: per-layer prefixes (from a state) followed by live tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVPrefix:
    """Post-RoPE keys and values to place in front of the live tokens, layer by layer.

    keys[l] / values[l]: [H_kv, P_l, d] (P_l may differ per layer, 0 for a layer left out).
    `next_position` is where the first live token sits: the document's length, whatever was
    loaded (invariant 2: loaded tokens keep their positions; absent ones leave a gap).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    next_position: int
    reader: bool = False   # made for the model's reader adapter: generation switches it on after it

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    def tokens_per_layer(self) -> list[int]:
        return [int(k.shape[-2]) for k in self.keys]

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in zip(self.keys, self.values))


@dataclass
class CodedPrefix:
    """A state resident in coded form, placed in front of the live tokens: attended from its codes,
    never rebuilt. Per layer (None where a layer holds nothing) either a
    kite.kernels.coded_attention.CodedLayer (the codec's own codes, built by
    ``kite.upcycle.load.resident.build_resident``) or a kite.kernels.lanes.Lanes of one state
    (nibble lanes, built by ``kite.upcycle.load.lanes.load_lanes``).

    ``cos`` / ``sin`` [P, d] float32: RoPE by absolute position, P > every coded token's position
    (CodedLayer: its keys are pre-RoPE; None for lanes, whose keys are post-RoPE).
    A batch row takes it in place of a KVPrefix (kite.runtime.batch_cache), its raw slots then hold
    only its live tokens.
    """

    layers: list                 # list[CodedLayer | Lanes | None]
    positions: torch.Tensor      # int64 [T]: the kept tokens' positions, ascending (empty: not kept)
    next_position: int
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    reader: bool = False

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def tokens_per_layer(self) -> list[int]:
        """Tokens each layer attends (coded rows and raw side-cache rows)."""
        from kite.kernels.lanes import Lanes

        def tokens(c) -> int:
            if c is None:
                return 0
            if isinstance(c, Lanes):                  # one state: its coded rows, then its sinks
                return int(c.length[0]) + int(c.raw_k.shape[2])
            return int((c.pos >= 0).sum()) + int(c.raw_k.shape[1])
        return [tokens(c) for c in self.layers]

    @property
    def lanes(self) -> bool:
        """Whether the layers are nibble lanes (kite.kernels.lanes) rather than the codec's codes."""
        from kite.kernels.lanes import Lanes

        return any(isinstance(c, Lanes) for c in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes the coded form occupies on its device (every tensor of every layer)."""
        return sum((c.nbytes() if callable(c.nbytes) else c.nbytes) for c in self.layers if c is not None)


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
