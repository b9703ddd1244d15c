"""Prefill a document (chunked) and capture its KV cache with pre-RoPE keys, and hidden states."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kite.runtime.batch import forward_groups, right_padded
from kite.runtime.cache import cache_layers, new_cache
from kite.runtime.generate import cache_kwarg
from kite.upcycle.rope import remove_rope, rope_cos_sin

if TYPE_CHECKING:
    from kite.model import LoadedModel


@dataclass
class Capture:
    """A document's cache: keys_pre[l] and values[l] are [H_kv, T, d] fp32 (keys before RoPE)."""

    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]  # each token's character range in `text`
    keys_pre: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → [T, hidden]
    prefill_ms: float = 0.0
    # with queries=True: per layer, the sum over the document's tokens of each query output's square
    # [H_q * d] float64 (pre-RoPE: q_proj's output), what a key error costs (kite.upcycle.codec.weights)
    query_sq: list[torch.Tensor] = field(default_factory=list)
    # with query_rows=N: per layer, the last N tokens' query outputs [N, H_q * d] fp32 (pre-RoPE)
    query_tail: list[torch.Tensor] = field(default_factory=list)
    # with keep_cache=True: the model's cache after the document (post-RoPE, the model's dtype), for
    # forwards that continue it (a teacher reading the full context) without a second prefill
    cache: object = field(default=None, repr=False)

    @property
    def n_tokens(self) -> int:
        return len(self.ids)


def tokenize_document(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids (no special tokens added) and each token's character range."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def token_offsets(tokenizer, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """A text for `ids` (token pieces joined) and each token's character range in it."""
    pieces = tokenizer.batch_decode([[t] for t in ids])
    offsets, pos = [], 0
    for piece in pieces:
        offsets.append((pos, pos + len(piece)))
        pos += len(piece)
    return "".join(pieces), offsets


def _document(lm: LoadedModel, text: str, ids: list[int] | None) -> tuple[str, list[int], list[tuple[int, int]]]:
    from kite.errors import BadInput

    if ids is None:
        ids, offsets = tokenize_document(lm.tokenizer, text)
    else:
        text, offsets = token_offsets(lm.tokenizer, ids)
    if not ids:
        raise BadInput("the document is empty")
    limit = lm.geometry.context_length
    if limit and len(ids) > limit:
        raise BadInput(f"the document has {len(ids)} tokens, past the model's context of {limit}")
    return text, ids, offsets


@torch.inference_mode()
def capture(lm: LoadedModel, text: str, *, chunk_tokens: int = 1024, hidden_layers: Sequence[int] = (),
            progress: Callable[[int, int], None] | None = None,
            ids: list[int] | None = None, queries: bool = False, query_rows: int = 0,
            keep_cache: bool = False) -> Capture:
    """Prefill `text` in chunks of `chunk_tokens`, keeping K (pre-RoPE), V and some hidden states.

    hidden_layers: indices into HF's hidden_states (0 = embeddings, i = after layer i).
    progress(done_tokens, total_tokens) is called after each chunk.
    queries: also sum each layer's squared query outputs over the tokens (``Capture.query_sq``).
    query_rows: also keep the last ``query_rows`` tokens' query outputs per layer (``Capture.query_tail``).
    keep_cache: also keep the model's cache after the document (``Capture.cache``).
    """
    tail: dict[int, list[torch.Tensor]] = {}
    hooks = _tail_hooks(lm.model, tail, query_rows) if query_rows else []
    try:
        (cap,) = _prefill(lm, [_document(lm, text, ids)], chunk_tokens, hidden_layers, progress, keep_cache,
                          queries)
    finally:
        for h in hooks:
            h.remove()
    if query_rows:
        _all_layers(lm, tail)
        cap.query_tail = [torch.cat(tail[i])[-query_rows:] for i in sorted(tail)]
    return cap


def capture_many(lm: LoadedModel, texts: Sequence[str], *, chunk_tokens: int = 1024,
                 hidden_layers: Sequence[int] = (), progress: Callable[[int, int], None] | None = None,
                 ids: Sequence[list[int] | None] | None = None, keep_cache: bool = False,
                 queries: bool = False) -> list[Capture]:
    """:func:`capture` of several documents in one batch: each document's tokens from position 0,
    the shorter ones padded at their end, every chunk one forward of the whole batch at the same
    positions (the chunks' bounds are each document's own). No token sees a padding one (the padding
    comes after it and the attention is causal), so each capture is what :func:`capture` makes of its
    document alone, to the rounding of the batch's products. ``progress`` counts the documents' own
    tokens; each capture's ``prefill_ms`` is its share of the batch's, by tokens; ``queries``: each
    capture's ``query_sq`` sums its own tokens' queries (the last rows' queries: :func:`capture`
    alone). Group the documents with :func:`kite.runtime.batch.forward_groups`."""
    ids = list(ids) if ids is not None else [None] * len(texts)
    if len(ids) != len(texts):
        raise ValueError(f"{len(texts)} texts and {len(ids)} id lists")
    docs = [_document(lm, text, doc_ids) for text, doc_ids in zip(texts, ids)]
    return _prefill(lm, docs, chunk_tokens, hidden_layers, progress, keep_cache, queries) if docs else []


def iter_captures(lm: LoadedModel, texts: Sequence[str], *, chunk_tokens: int = 1024,
                  hidden_layers: Sequence[int] = (), keep_cache: bool = False,
                  queries: bool = False) -> Iterator[Capture]:
    """The capture of each text in order, the documents prefilled together in :func:`kite.runtime.batch.forward_groups`
    (:func:`capture_many`); a group is prefilled when its first capture is asked for, so at most one
    group's captures are held here. Every text is tokenized and checked first."""
    docs = [_document(lm, text, None) for text in texts]
    for group in forward_groups([len(doc_ids) for _, doc_ids, _ in docs], lm.device):
        yield from _prefill(lm, [docs[i] for i in group], chunk_tokens, hidden_layers, None, keep_cache, queries)


@torch.inference_mode()
def _prefill(lm: LoadedModel, docs: list[tuple[str, list[int], list[tuple[int, int]]]], chunk_tokens: int,
             hidden_layers: Sequence[int], progress, keep_cache: bool, queries: bool = False) -> list[Capture]:
    model, device = lm.model, lm.device
    lengths = [len(doc_ids) for _, doc_ids, _ in docs]
    n, total = max(lengths), sum(lengths)
    batch = right_padded([doc_ids for _, doc_ids, _ in docs], pad=0)[0].to(device)
    cache = new_cache(model, reserve=n)         # each chunk's keys written in place, not the cache copied per chunk
    hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in hidden_layers}
    # with queries: per layer, each document's sum of its own tokens' squared queries [B, H_q * d]
    query_sq: dict[int, torch.Tensor] = {}
    own_rows: list[torch.Tensor] = []       # the chunk's [B, t] mask of the documents' own tokens
    hooks = _query_sum_hooks(model, query_sq, own_rows) if queries else []
    t0 = time.perf_counter()
    try:
        for start in range(0, n, chunk_tokens):
            chunk = batch[:, start:start + chunk_tokens]
            positions = torch.arange(start, start + chunk.shape[1], device=device)
            if queries:
                own_rows[:] = [positions[None, :] < torch.tensor(lengths, device=device)[:, None]]
            out = model(input_ids=chunk, position_ids=positions.expand(len(docs), -1), use_cache=True,
                        output_hidden_states=bool(hidden_layers), logits_to_keep=1,
                        **{cache_kwarg(model): cache})
            for layer in hidden_layers:
                hidden[layer].append(out.hidden_states[layer].float())
            if progress:
                progress(sum(min(start + chunk_tokens, length) for length in lengths), total)
    finally:
        for h in hooks:
            h.remove()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    if queries:
        _all_layers(lm, query_sq)
    sums = [[query_sq[i][row].cpu() for i in sorted(query_sq)] for row in range(len(docs))] if queries else None
    cos, sin = rope_cos_sin(model, torch.arange(n), device=device)
    layers = [(remove_rope(k.float(), cos, sin), v.float()) for k, v in cache_layers(cache)]
    hidden_all = {layer: torch.cat(h, dim=1) for layer, h in hidden.items()}
    if len(docs) == 1:
        (text, ids, offsets), = docs
        return [Capture(text=text, ids=ids, offsets=offsets, keys_pre=[k[0] for k, _ in layers],
                        values=[v[0] for _, v in layers], hidden={l: h[0] for l, h in hidden_all.items()},
                        prefill_ms=prefill_ms, cache=cache if keep_cache else None,
                        query_sq=sums[0] if sums else [])]

    def own(t: torch.Tensor, row: int, length: int) -> torch.Tensor:
        # the row's tokens, copied out of the batch's tensor (a capture kept does not hold the batch)
        return t[row, ..., :length, :].clone(memory_format=torch.contiguous_format)

    caps = []
    for row, (text, ids, offsets) in enumerate(docs):
        length = len(ids)
        doc_cache = None
        if keep_cache:
            doc_cache = new_cache(model)
            for layer, (k, v) in enumerate(cache_layers(cache)):
                doc_cache.update(own(k, row, length)[None], own(v, row, length)[None], layer)
        caps.append(Capture(text=text, ids=ids, offsets=offsets, keys_pre=[own(k, row, length) for k, _ in layers],
                            values=[own(v, row, length) for _, v in layers],
                            hidden={l: own(h, row, length) for l, h in hidden_all.items()},
                            prefill_ms=prefill_ms * length / total, cache=doc_cache,
                            query_sq=sums[row] if sums else []))
    return caps


_Q_PROJ = re.compile(r"layers\.(\d+)\.self_attn\.q_proj$")


def _all_layers(lm: LoadedModel, found: dict) -> None:
    """Refuse a capture whose hooks did not find every layer's query projection (``found``: by layer)."""
    if sorted(found) != list(range(lm.geometry.n_layers)):
        raise ValueError(f"found the query projections of layers {sorted(found)}, not of all {lm.geometry.n_layers}")


def _q_projs(model):
    for name, module in model.named_modules():
        m = _Q_PROJ.search(name)
        if m is not None:
            yield int(m.group(1)), module


def _query_sum_hooks(model, sums: dict[int, torch.Tensor], own_rows: list[torch.Tensor]) -> list:
    """Forward hooks on every layer's ``self_attn.q_proj``: add each document's squared query outputs
    [B, t, H_q * d] over its own tokens (``own_rows[0]``, [B, t]: padding left out) to ``sums`` [B, H_q * d]."""
    def hook(_mod, _inp, out, layer):
        q = out.detach().double().pow(2) * own_rows[0][..., None]
        sq = q.sum(dim=1)
        sums[layer] = sums[layer] + sq if layer in sums else sq

    return [module.register_forward_hook(lambda m, i, o, layer=layer: hook(m, i, o, layer))
            for layer, module in _q_projs(model)]


def _tail_hooks(model, tail: dict[int, list[torch.Tensor]], rows: int) -> list:
    """Forward hooks on every layer's ``self_attn.q_proj`` keeping its last ``rows`` tokens' outputs
    in ``tail`` (one document)."""
    def hook(_mod, _inp, out, layer):
        kept = tail.setdefault(layer, [])
        kept.append(out.detach().reshape(-1, out.shape[-1])[-rows:].float().cpu())
        while len(kept) > 1 and sum(t.shape[0] for t in kept[1:]) >= rows:
            kept.pop(0)

    return [module.register_forward_hook(lambda m, i, o, layer=layer: hook(m, i, o, layer))
            for layer, module in _q_projs(model)]
