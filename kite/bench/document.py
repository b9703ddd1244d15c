"""One document's full-precision cache, prefilled once and shared by every method of a run."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kite.runtime.cache import KVPrefix, cache_layers, new_cache
from kite.runtime.generate import cache_kwarg

if TYPE_CHECKING:
    from kite.model import LoadedModel


@dataclass
class DocumentContext:
    key: str  # BenchCase.document_key
    ids: list[int]
    # post-RoPE K, V of every document token, every layer; None when a run reused full prefill's
    # answers and no method reads the cache (kite.bench.reuse)
    full: KVPrefix | None
    prefill_ms: float  # the measured prefill of the whole document (what full prefill pays)

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    def raw_kv_bytes(self, lm: LoadedModel) -> int:
        """The document's KV at fp16: what a plain cache holds for it."""
        return int(lm.geometry.kv_bytes_per_token("fp16") * self.n_tokens)


def document_ids(lm: LoadedModel, text: str) -> list[int]:
    """The document's token ids (no special tokens: states are made from the same ids)."""
    from kite.upcycle import tokenize_document

    return tokenize_document(lm.tokenizer, text)[0]


@torch.inference_mode()
def prefill_document(lm: LoadedModel, key: str, ids: list[int], chunk_tokens: int = 1024) -> DocumentContext:
    """Prefill `ids` in chunks (only the last position's logits are computed) and keep the KV."""
    model = lm.model
    cache = new_cache(model)
    t0 = time.perf_counter()
    for start in range(0, len(ids), chunk_tokens):
        chunk = torch.tensor([ids[start:start + chunk_tokens]], device=lm.device)
        pos = torch.arange(start, start + chunk.shape[1], device=lm.device).unsqueeze(0)
        model(input_ids=chunk, position_ids=pos, use_cache=True, logits_to_keep=1,
              **{cache_kwarg(model): cache})
    ms = (time.perf_counter() - t0) * 1e3
    keys = [k[0] for k, _ in cache_layers(cache)]
    values = [v[0] for _, v in cache_layers(cache)]
    return DocumentContext(key, ids, KVPrefix(keys, values, next_position=len(ids)), ms)


def take_tokens(full: KVPrefix, index: torch.Tensor | list[torch.Tensor], fp16: bool = True) -> KVPrefix:
    """A prefix of chosen tokens, kept at fp16 (rounded) like a real cache would hold them.

    `index`: one 1-D index for every layer and head, or per layer an [H, k] index (per head).
    """
    keys, values = [], []
    for layer, (k, v) in enumerate(zip(full.keys, full.values)):
        idx = index[layer] if isinstance(index, list) else index
        if idx.dim() == 1:
            kk, vv = k[:, idx], v[:, idx]
        else:
            g = idx.unsqueeze(-1).expand(-1, -1, k.shape[-1])
            kk, vv = torch.gather(k, 1, g), torch.gather(v, 1, g)
        if fp16:
            kk, vv = kk.half().to(k.dtype), vv.half().to(v.dtype)
        keys.append(kk)
        values.append(vv)
    return KVPrefix(keys, values, next_position=full.next_position)
