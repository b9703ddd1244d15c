"""The teacher of the reader adapter: the base model reading the full context, its top ``top_k``
log-probabilities over every response token, computed once per pair and kept for every epoch and
ratio.

A document's pairs are computed together after one prefill of it: ``rows`` pairs at a time in one
forward, each row its prompt and response after the document's cache (the cache repeated per row,
the rows right-padded: causal attention keeps a row's tokens from seeing its padding, so each row's
logits are those of the pair alone, up to the summation order of a batched matmul).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kite.errors import BadInput
from kite.runtime.cache import cache_layers
from kite.runtime.generate import cache_kwarg
from kite.upcycle.train.adapter import Example, tokenize_pair
from kite.upcycle.train.data import Pair

if TYPE_CHECKING:
    from kite.model import LoadedModel

TEACHER_ROWS = 8     # pairs per forward; the cache is repeated per row ([rows, H, T, d] per layer)


def check_pair(lm: LoadedModel, pair: Pair, ctx: list[int], prompt: list[int], response: list[int]) -> None:
    """BadInput naming the pair's line when its prompt or response has no tokens or the whole is
    past the model's context."""
    if not prompt or not response:
        raise BadInput(f"pairs line {pair.line}: the prompt and the response must have tokens")
    limit = lm.geometry.context_length
    if limit and len(ctx) + len(prompt) + len(response) > limit:
        raise BadInput(f"pairs line {pair.line}: context + prompt + response are "
                       f"{len(ctx) + len(prompt) + len(response)} tokens, past the model's context of {limit}")


def repeated_cache(model, cache, rows: int):
    """A new cache holding ``cache``'s tokens once per row (``cache`` itself is left as it is)."""
    from transformers import DynamicCache

    out = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(cache_layers(cache)):
        out.update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), layer)
    return out


@torch.inference_mode()
def _top_k(model, cache, start: int, rows: list[tuple[list[int], list[int]]], top_k: int):
    """One forward of ``rows`` (prompt, response) after ``cache`` (whose tokens end at ``start``):
    each row's top-k (indices, log-probabilities) [n_response, k] and its response tokens'
    log-probabilities [n_response]."""
    device = next(model.parameters()).device
    n = max(len(p) + len(r) - 1 for p, r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        seq = p + r[:-1]
        ids[i, :len(seq)] = torch.tensor(seq)
    ids = ids.to(device)
    pos = torch.arange(start, start + n, device=device).expand(len(rows), n)
    batch = cache if len(rows) == 1 else repeated_cache(model, cache, len(rows))
    logits = model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(model): batch}).logits
    out = []
    for i, (p, r) in enumerate(rows):
        logp = torch.log_softmax(logits[i, len(p) - 1:len(p) + len(r) - 1].float(), dim=-1)
        top = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
        own = logp.gather(1, torch.tensor(r, device=device)[:, None])[:, 0]
        out.append((top.indices, top.values, own))
    if len(rows) == 1:
        cache.crop(-n)         # back to the document alone
    return out


def document_examples(lm: LoadedModel, pairs: list[Pair], cache, ctx: list[int], top_k: int,
                      rows: int = TEACHER_ROWS) -> list[Example]:
    """The examples of one document's ``pairs`` after ``cache`` (the model's cache of the document's
    tokens ``ctx``), ``rows`` pairs per forward. The teacher's tensors are plain tensors (not
    inference tensors), so the adapter's loss can use them as they are."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    toks = []
    for p in pairs:
        _, prompt, response = tokenize_pair(lm.tokenizer, p, ctx)
        check_pair(lm, p, ctx, prompt, response)
        toks.append((prompt, response))
    out = []
    for at in range(0, len(toks), rows):
        chunk = toks[at:at + rows]
        for (prompt, response), (idx, logp, own) in zip(chunk, _top_k(lm.model, cache, len(ctx), chunk, top_k)):
            out.append(Example(pairs[len(out)].document_key, prompt, response, idx.clone(), logp.clone(), own.clone()))
    return out
