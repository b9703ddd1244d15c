"""A state's recomputed tail: its document's last tokens, kept as token ids (``recompute`` in the
header, :func:`kite.upcycle.compress.recomputed_tail`), run through the model after the rebuilt
prefix so that their keys and values are the model's own, reading the prefix as the live tokens
after it will.

The continuation of a document reads its last tokens the most; coded at 16x their error is the
largest share of what the next tokens feel (docs/compression.md, "Recomputed tail"). Kept as ids
they cost a few bytes each, and the state's bytes go to the tokens before them; a load pays a
forward of the tail's tokens. Several states loaded together share their tails' forwards where the
device batches forwards (:func:`recompute_tails`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kite.errors import BadInput
from kite.runtime.batch import forward_groups
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


@dataclass
class Tail:
    """One prefix's tail to recompute (:func:`recompute_tail`'s arguments): ``keys`` / ``values`` per
    layer [H_kv, P, d], appended to in place; ``ids`` at positions ``n_tokens - len(ids)`` onwards,
    into ``layers``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    ids: list[int]
    n_tokens: int
    layers: set[int]

    def whole(self) -> bool:
        """Whether every layer holds the whole prefix before the tail (what a batch of tails needs)."""
        start = self.n_tokens - len(self.ids)
        return (len(self.layers) == len(self.keys)
                and all(k.shape[1] == start and v.shape[1] == start for k, v in zip(self.keys, self.values)))


def recompute_tails(lm: LoadedModel, tails: Sequence[Tail], reader: bool = False) -> None:
    """:func:`recompute_tail` of each of ``tails``, several in one forward where the model's device
    batches forwards (:func:`kite.runtime.batch.forward_groups`: on a GPU the forward of a tail is
    bound by the host's launches, not by its tokens) and a tail's prefix is whole in every layer;
    the others one at a time. Each tail's keys and values are what its own forward makes, to the
    rounding of the batch's products."""
    together, alone = [], []
    for t in tails:
        if t.ids:
            (together if t.whole() else alone).append(t)
    for t in alone:
        recompute_tail(lm, t.keys, t.values, t.ids, t.n_tokens, t.layers, reader)
    if not together:
        return
    for group in forward_groups([t.n_tokens for t in together], next(lm.model.parameters()).device):
        if len(group) == 1:
            t = together[group[0]]
            recompute_tail(lm, t.keys, t.values, t.ids, t.n_tokens, t.layers, reader)
        else:
            _recompute_together(lm, [together[i] for i in group], reader)


@torch.inference_mode()
def _recompute_together(lm: LoadedModel, tails: list[Tail], reader: bool) -> None:
    """One forward of several tails: each row's prefix ends where the longest prefix ends (padding
    before it, masked), its tail's tokens after it at their own positions (padding after a shorter
    tail is never read: the attention is causal)."""
    model = lm.model
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    starts = [t.n_tokens - len(t.ids) for t in tails]
    p, n = max(starts), max(len(t.ids) for t in tails)
    cache = new_cache(model, reserve=p + n)
    for layer in range(len(tails[0].keys)):
        k0, v0 = tails[0].keys[layer], tails[0].values[layer]
        keys = torch.zeros(len(tails), k0.shape[0], p, k0.shape[-1], device=device, dtype=dtype)
        values = torch.zeros(len(tails), v0.shape[0], p, v0.shape[-1], device=device, dtype=dtype)
        for row, (t, start) in enumerate(zip(tails, starts)):
            keys[row, :, p - start:] = t.keys[layer]
            values[row, :, p - start:] = t.values[layer]
        cache.update(keys, values, layer)
    mask = torch.ones(len(tails), p + n, dtype=torch.long, device=device)
    tokens = torch.zeros(len(tails), n, dtype=torch.long, device=device)
    for row, (t, start) in enumerate(zip(tails, starts)):
        mask[row, :p - start] = 0
        tokens[row, :len(t.ids)] = torch.tensor(t.ids, device=device)
    positions = torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device)[None]
    reading = lm.reading(reader) if reader and hasattr(lm, "reading") else nullcontext()
    with reading:
        model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
              **{cache_kwarg(model): cache})
    for row, (t, start) in enumerate(zip(tails, starts)):
        span = slice(p - start, p + len(t.ids))
        for layer, (k, v) in enumerate(cache_layers(cache)):
            t.keys[layer] = k[row, :, span].to(t.keys[layer]).clone(memory_format=torch.contiguous_format)
            t.values[layer] = v[row, :, span].to(t.values[layer]).clone(memory_format=torch.contiguous_format)


__all__ = ["Tail", "recompute_tail", "recompute_tails", "tail_ids"]
