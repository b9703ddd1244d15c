"""Prefill a document (chunked) and capture its KV cache with pre-RoPE keys, and hidden states."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

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
    model = lm.model
    device = lm.device
    cache = new_cache(model)
    hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in hidden_layers}
    query_sq: dict[int, torch.Tensor] = {}
    tail: dict[int, list[torch.Tensor]] = {}
    hooks = _query_hooks(model, query_sq if queries else None, tail, query_rows) if queries or query_rows else []
    t0 = time.perf_counter()
    try:
        _prefill(model, ids, chunk_tokens, device, cache, hidden, hidden_layers, progress)
    finally:
        for h in hooks:
            h.remove()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    for found in ([query_sq] if queries else []) + ([tail] if query_rows else []):
        if sorted(found) != list(range(lm.geometry.n_layers)):
            raise ValueError(f"found the query projections of layers {sorted(found)}, not of all "
                             f"{lm.geometry.n_layers}")
    cos, sin = rope_cos_sin(model, torch.arange(len(ids)), device=device)
    keys_pre, values = [], []
    for k, v in cache_layers(cache):
        keys_pre.append(remove_rope(k[0].float(), cos, sin))
        values.append(v[0].float())
    return Capture(text=text, ids=ids, offsets=offsets, keys_pre=keys_pre, values=values,
                   hidden={l: torch.cat(h) for l, h in hidden.items()}, prefill_ms=prefill_ms,
                   query_sq=[query_sq[i].cpu() for i in sorted(query_sq)],
                   query_tail=[torch.cat(tail[i])[-query_rows:] for i in sorted(tail)] if query_rows else [],
                   cache=cache if keep_cache else None)


_Q_PROJ = re.compile(r"layers\.(\d+)\.self_attn\.q_proj$")


def _query_hooks(model, sums: dict[int, torch.Tensor] | None, tail: dict[int, list[torch.Tensor]],
                 rows: int) -> list:
    """Forward hooks on every layer's ``self_attn.q_proj``: add its output's squares to ``sums``
    (unless None) and keep its last ``rows`` tokens' outputs in ``tail``."""
    handles = []
    for name, module in model.named_modules():
        m = _Q_PROJ.search(name)
        if m is None:
            continue

        def hook(_mod, _inp, out, layer=int(m.group(1))):
            q = out.detach().reshape(-1, out.shape[-1])
            if sums is not None:
                sq = q.double().pow(2).sum(dim=0)
                sums[layer] = sums[layer] + sq if layer in sums else sq
            if rows:
                kept = tail.setdefault(layer, [])
                kept.append(q[-rows:].float().cpu())
                while len(kept) > 1 and sum(t.shape[0] for t in kept[1:]) >= rows:
                    kept.pop(0)

        handles.append(module.register_forward_hook(hook))
    return handles


def _prefill(model, ids, chunk_tokens, device, cache, hidden, hidden_layers, progress) -> None:
    for start in range(0, len(ids), chunk_tokens):
        chunk = torch.tensor([ids[start:start + chunk_tokens]], device=device)
        pos = torch.arange(start, start + chunk.shape[1], device=device).unsqueeze(0)
        out = model(input_ids=chunk, position_ids=pos, use_cache=True,
                    output_hidden_states=bool(hidden_layers), logits_to_keep=1,
                    **{cache_kwarg(model): cache})
        for layer in hidden_layers:
            hidden[layer].append(out.hidden_states[layer][0].float())
        if progress:
            progress(min(start + chunk_tokens, len(ids)), len(ids))
