"""A state's recomputed tail: its document's last tokens, kept as token ids (``recompute`` in the
header, :func:`kite.upcycle.compress.recomputed_tail`), run through the model after the rebuilt
prefix so that their keys and values are the model's own, reading the prefix as the live tokens
after it will.

The continuation of a document reads its last tokens the most; coded at 16x their error is the
largest share of what the next tokens feel (docs/compression.md, "Recomputed tail"). Kept as ids
they cost a few bytes each, and the state's bytes go to the tokens before them; a load pays a
forward of the tail's tokens.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from kite.errors import BadInput
from kite.runtime.cache import KVPrefix, cache_layers, new_cache
from kite.runtime.generate import cache_kwarg

if TYPE_CHECKING:
    from kite.model import LoadedModel


def tail_ids(meta: dict) -> list[int]:
    """The token ids a state's loads recompute ([] for a state without a tail; the header's check,
    :func:`kite.upcycle.format.header.check_header`, has made sure they fit its document)."""
    tail = meta.get("recompute")
    return list(tail["ids"]) if tail else []


@torch.inference_mode()
def recompute_tail(lm: LoadedModel, keys: list[torch.Tensor], values: list[torch.Tensor], ids: list[int],
                   n_tokens: int, layers: set[int], reader: bool = False, reserve: bool = True) -> None:
    """Append to ``keys`` / ``values`` (per layer [H_kv, P, d], post-RoPE, in place) the KV of ``ids``
    at positions ``n_tokens - len(ids)`` onwards, as ``lm``'s model makes them after that prefix;
    only ``layers`` get them (a load into some layers keeps the others empty). ``reader``: the
    prefix is read with the model's reader adapter on. ``reserve``: the model's cache reserves the
    whole document, so the prefix is copied into it once (False: it grows by concatenation, as
    transformers' does; benchmarks compare both)."""
    if not ids:
        return
    model = lm.model
    param = next(model.parameters(), None)
    if param is None:
        raise BadInput("this state keeps its last tokens to be recomputed by the model, and this load has no "
                       "model weights to run them")
    start = n_tokens - len(ids)
    # the cache's layers reserve the whole document: the prefix is copied into them once, the tail
    # written after it, and a layer's result is the cache's own tensor (no copy of the prefix again)
    cache = new_cache(model, KVPrefix(keys, values, next_position=start), reserve=n_tokens if reserve else 0)
    device = param.device
    tokens = torch.tensor([ids], device=device)
    positions = torch.arange(start, n_tokens, device=device)[None]
    reading = lm.reading(reader) if reader and hasattr(lm, "reading") else nullcontext()
    with reading:
        model(input_ids=tokens, position_ids=positions, use_cache=True, logits_to_keep=1,
              **{cache_kwarg(model): cache})
    for layer, (k, v) in enumerate(cache_layers(cache)):
        if layer not in layers:
            continue
        if k.dtype == keys[layer].dtype and k.device == keys[layer].device and v.dtype == values[layer].dtype:
            keys[layer], values[layer] = k[0], v[0]
        else:
            keys[layer] = torch.cat([keys[layer], k[0, :, -len(ids):].to(keys[layer])], dim=1)
            values[layer] = torch.cat([values[layer], v[0, :, -len(ids):].to(values[layer])], dim=1)


__all__ = ["recompute_tail", "tail_ids"]
