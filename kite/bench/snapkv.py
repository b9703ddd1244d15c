"""SnapKV-style selection: keep, per layer and KV head, the document tokens the last prompt
tokens (the observation window) attend to most, scores pooled along the tokens.

Query-aware, as in the paper: the document and the prompt are prefilled in full, the queries of
the observation window score the document's keys, and decoding runs on the selected tokens plus
the prompt. It saves memory during decoding, not prefill time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from kite.runtime.cache import KVPrefix


def _attention_modules(model) -> list:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:  # a peft wrapper
        layers = model.get_base_model().model.layers
    return [layer.self_attn for layer in layers]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


@contextlib.contextmanager
def capture_queries(model, window: int) -> Iterator[list[torch.Tensor | None]]:
    """While active, each layer's post-RoPE queries of the last `window` tokens of the latest
    forward land in the yielded list ([Hq, w, d] per layer)."""
    mods = _attention_modules(model)
    out: list[torch.Tensor | None] = [None] * len(mods)
    handles = []
    for i, mod in enumerate(mods):
        def hook(module, args, kwargs, i=i):
            hs = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            hs = hs[:, -window:]
            cos, sin = cos[:, -window:].unsqueeze(1), sin[:, -window:].unsqueeze(1)
            d = module.head_dim
            q = module.q_proj(hs).view(hs.shape[0], hs.shape[1], -1, d).transpose(1, 2)
            out[i] = (q * cos + _rotate_half(q) * sin)[0].float()
        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def select(full: KVPrefix, queries: list[torch.Tensor], window_keys: list[torch.Tensor],
           keep: int, kernel: int = 7) -> list[torch.Tensor]:
    """Per layer an [H_kv, keep] index of document tokens (sorted), from the window's attention.

    queries[l]: [Hq, w, d]; window_keys[l]: [H_kv, w, d] the window's own keys (the softmax runs
    over the document and the window, causal inside the window, as the model attends).
    """
    picks = []
    for layer, (k_doc, q) in enumerate(zip(full.keys, queries)):
        H, T, d = k_doc.shape
        rep = q.shape[0] // H
        k_all = torch.cat([k_doc.float(), window_keys[layer].float()], dim=1)
        k_all = k_all.repeat_interleave(rep, dim=0)                      # [Hq, T+w, d]
        scores = q @ k_all.transpose(1, 2) / d ** 0.5                    # [Hq, w, T+w]
        w = q.shape[1]
        causal = torch.ones(w, w, dtype=torch.bool).tril()
        scores[:, :, T:] = scores[:, :, T:].masked_fill(~causal, float("-inf"))
        attn = torch.softmax(scores, dim=-1)[:, :, :T].sum(1)             # [Hq, T]
        attn = attn.view(H, rep, T).sum(1)                                # [H_kv, T]
        if kernel > 1:
            attn = F.avg_pool1d(attn[:, None], kernel, stride=1, padding=kernel // 2,
                                count_include_pad=False)[:, 0, :T]
        k = min(keep, T)
        picks.append(torch.topk(attn, k, dim=-1).indices.sort(dim=-1).values)
    return picks
