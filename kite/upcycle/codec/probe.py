"""The attention probe: what a coded layer costs the attention of the document's own last queries.

The regenerator's basis or the document's own, per (layer, side)? The squared error of the keys
and values (plain, or weighted per dim: :mod:`.weights`) does not rank the candidates as the model
does (measured on SmolLM2 2026-12-01 at commit 15b2667, docs/PERFORMANCE.md "Training"). The probe measures the
thing itself: the last ``rows`` tokens of the document are queries (their captured ``q_proj``
outputs, RoPE applied at their positions) over the document's keys and values (causal), and a
candidate's cost is the squared change of the attention output after ``o_proj`` -- keys decoded
with the values exact, or values decoded with the keys exact. :func:`kite.upcycle.codec.fit_layer`
takes it as its ``metric`` and keeps, per side, the candidate the probe finds cheapest.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kite.upcycle.rope import apply_rope, rope_cos_sin

if TYPE_CHECKING:
    from kite.model import LoadedModel

_O_PROJ = re.compile(r"layers\.(\d+)\.self_attn\.o_proj$")
ROWS = 256


class AttentionProbe:
    """Built once per document from a capture with ``query_rows`` (:func:`kite.upcycle.capture.capture`)."""

    def __init__(self, lm: LoadedModel, query_tail: list[torch.Tensor], n_tokens: int, spread: int | None = None,
                 coded: int | None = None):
        """``query_tail``: per layer the last tokens' query outputs; ``spread``: use only that many
        of those rows, evenly spaced (default: all of them); ``coded``: the document's first tokens
        whose keys and values the codec codes and the probe reads (default all ``n_tokens``; fewer
        when a recomputed tail is kept as ids), the query rows staying at their own positions."""
        geo = lm.geometry
        self.H, self.d, self.T = geo.n_kv_heads, geo.head_dim, n_tokens
        self.n_q = lm.model.config.num_attention_heads
        if self.n_q % self.H:
            raise ValueError(f"{self.n_q} query heads do not group over {self.H} KV heads")
        tail = int(query_tail[0].shape[0]) if query_tail else 0
        if len(query_tail) != geo.n_layers or tail == 0:
            raise ValueError(f"the probe needs query rows of all {geo.n_layers} layers, got {len(query_tail)}")
        self.cos, self.sin = (t.float().cpu() for t in rope_cos_sin(lm.model, torch.arange(n_tokens)))
        idx = torch.arange(tail)
        if spread is not None and 0 < spread < tail:
            idx = torch.linspace(0, tail - 1, spread).round().long().unique()
        self.rows = int(idx.numel())
        positions = n_tokens - tail + idx
        q = [t.float().cpu()[idx].reshape(self.rows, self.n_q, self.d).permute(1, 0, 2) for t in query_tail]
        self.queries = [apply_rope(x, self.cos[positions], self.sin[positions]) for x in q]   # [n_q, S, d]
        self.o_proj: dict[int, torch.Tensor] = {}
        for name, module in lm.model.named_modules():
            m = _O_PROJ.search(name)
            if m is not None:
                self.o_proj[int(m.group(1))] = getattr(module, "base_layer", module).weight.detach().float().cpu()
        if sorted(self.o_proj) != list(range(geo.n_layers)):
            raise ValueError(f"found the output projections of layers {sorted(self.o_proj)}, not of all {geo.n_layers}")
        coded = n_tokens if coded is None else coded
        self.key_cos, self.key_sin = self.cos[:coded], self.sin[:coded]
        mask = torch.arange(coded)[None, :] > positions[:, None]                              # [S, T] future keys
        self.mask = torch.zeros(mask.shape).masked_fill(mask, float("-inf"))

    def _out(self, layer: int, K_post: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        rep = self.n_q // self.H
        q = self.queries[layer]
        scores = q @ K_post.repeat_interleave(rep, 0).transpose(1, 2) / self.d ** 0.5 + self.mask
        o = torch.softmax(scores, dim=-1) @ V.repeat_interleave(rep, 0)                     # [n_q, S, d]
        return o.permute(1, 0, 2).reshape(self.rows, -1) @ self.o_proj[layer].T            # [S, hidden]

    def metric(self, layer: int, K_pre: torch.Tensor, V: torch.Tensor) -> Callable[[str, torch.Tensor, torch.Tensor], float]:
        """``metric(side, X, X_hat)`` for this layer's keys (pre-RoPE) and values [H, T, d]: the
        summed squared change of the probe's attention output when that side is ``X_hat``."""
        K_pre, V = K_pre.float().cpu(), V.float().cpu()
        K_post = apply_rope(K_pre, self.key_cos, self.key_sin)
        ref = self._out(layer, K_post, V)

        def cost(side: str, X: torch.Tensor, X_hat: torch.Tensor) -> float:
            X_hat = X_hat.float().cpu()
            out = (self._out(layer, apply_rope(X_hat, self.key_cos, self.key_sin), V) if side == "k"
                   else self._out(layer, K_post, X_hat))
            return float((out - ref).double().pow(2).sum())

        return cost


__all__ = ["ROWS", "AttentionProbe"]
