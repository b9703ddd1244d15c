"""Attention read from a state's coded form: keys and values as coefficients × basis + mean, never
rebuilt as whole layers.

A :class:`CodedLayer` is one layer of one resident state (built at load by
``kite.upcycle.load.resident``): per side, the coefficient codes as uint8 (the codec's integer code
of each coefficient, at most 8 bits, unpacked), the codec's per-group scale and minimum (coefficient
= min + scale · code), the basis per KV head and the mean; keys are pre-RoPE. The tokens lie in tiles
of ``TILE`` rows, each tile inside one quantization group; padding rows and rows kept raw have
position -1. Rows the codec keeps exactly (sinks, outliers) sit in a small raw side cache (keys
post-RoPE) attended in the same softmax.

For a query q of KV head h at any position after the state's tokens:

* scores s_t = q · RoPE_{p_t}(c_t B_h + μ_h), RoPE applied to the rebuilt key tile at each token's
  position (cos / sin tables indexed by absolute position);
* values in coefficient space: Σ_t p_t v_t = (Σ_t p_t c_t) B_v,h + Σ_t p_t μ_v,h,g(t), so only the
  key side is rebuilt per tile (μ per quantization group: the codec's mean plus its columns coded at
  0 bits, which hold the group's minimum only and are not stored).

Keys coded after RoPE (``keys="coef"``; the default ``"rebuild"`` reads them as pre-RoPE): no
rotation, so a score is taken in coefficient space, s_t = c_t (B_h q) + μ_h,g(t) · q, with no key
rebuilt (the kernel's form; the reference rebuilds and skips the rotation, the same function).

Every function returns (output normalized over its tokens, log-sum-exp of its scores) so that parts
attended apart (coded tokens, the raw side cache, a batch row's live tokens) merge exactly
(:func:`merge`). :func:`coded_partial_torch` is the reference and the CPU fallback;
``kite.kernels.coded_attention_triton`` is the GPU decode kernel (one query token per sequence, the
query heads of a KV head sharing its rebuilt tile, many sequences of their own lengths per launch).
"""

from __future__ import annotations

import math

import torch

from kite.kernels.coded_layer import KEYS, TILE, CodedLayer, check_keys

__all__ = ["KEYS", "TILE", "CodedLayer", "check_keys", "coded_attention", "coded_decode_partial", "coded_partial",
           "coded_partial_torch", "merge", "raw_partial"]


def _cols(layer: CodedLayer, h: int, side: str) -> slice:
    R = (layer.k_basis if side == "k" else layer.v_basis).shape[1]
    c0 = 0 if layer.joint else h * R
    return slice(c0, c0 + R)


def _coefs(layer: CodedLayer, side: str) -> torch.Tensor:
    """The dequantized coefficients [Tp, Hb * R] float32 (min + scale · code, per tile's group)."""
    scale, mn = (layer.k_scale, layer.k_min) if side == "k" else (layer.v_scale, layer.v_min)
    g = layer.tile_group.long().repeat_interleave(TILE)
    return mn[g] + scale[g] * layer.codes(side).float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def coded_partial_torch(q: torch.Tensor, layer: CodedLayer, cos: torch.Tensor, sin: torch.Tensor,
                        scale: float, keys: str = "rebuild") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [Hq, n, d] over the layer's coded rows (raw side cache not included):
    (out [Hq, n, d] float32, lse [Hq, n] float32; -inf where no row is attended).

    ``cos`` / ``sin`` [P, d] float32: RoPE at every absolute position P > max position (rotate-half
    layout). Every coded row is visible to every query row (the query follows the state).
    ``keys``: "rebuild" (codes of pre-RoPE keys, rotated at their positions) or "coef" (codes of
    post-RoPE keys: not rotated; ``cos`` / ``sin`` unused).
    """
    check_keys(keys)
    Hq, n, d = q.shape
    H = layer.k_mean.shape[1]
    rep = Hq // H
    valid = layer.pos >= 0
    p = layer.pos.long().clamp_min(0)
    c, s = cos[p].float(), sin[p].float()
    Ck, Cv = _coefs(layer, "k"), _coefs(layer, "v")
    g = layer.tile_group.long().repeat_interleave(TILE)                                 # group of each row
    out = torch.zeros(Hq, n, d, dtype=torch.float32, device=q.device)
    lse = torch.full((Hq, n), float("-inf"), dtype=torch.float32, device=q.device)
    if not bool(valid.any()):
        return out, lse
    for h in range(H):
        k = Ck[:, _cols(layer, h, "k")] @ layer.k_basis[h].float() + layer.k_mean[g, h]  # [Tp, d] pre-RoPE
        if keys == "rebuild":
            k = _rope(k, c, s)
        qh = q[h * rep:(h + 1) * rep].float()                                            # [rep, n, d]
        sc = (qh @ k.T) * scale                                                           # [rep, n, Tp]
        sc = sc.masked_fill(~valid, float("-inf"))
        lse[h * rep:(h + 1) * rep] = torch.logsumexp(sc, dim=-1)
        prob = torch.softmax(sc, dim=-1)
        coef = prob @ Cv[:, _cols(layer, h, "v")]                                         # [rep, n, Rv]
        out[h * rep:(h + 1) * rep] = coef @ layer.v_basis[h].float() + prob @ layer.v_mean[g, h]
    return out, lse


def raw_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [..., Hq, n, d] over raw keys / values [..., H, S, d] (``mask`` [..., 1|Hq, n, S]
    bool, True = visible): (out float32, lse float32; -inf and zeros where nothing is visible)."""
    Hq, H = q.shape[-3], k.shape[-3]
    if H != Hq:
        k = k.repeat_interleave(Hq // H, dim=-3)
        v = v.repeat_interleave(Hq // H, dim=-3)
    sc = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        sc = sc.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(sc, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    prob = torch.exp(sc - safe[..., None])
    return prob @ v.float(), lse


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over the union of the parts' tokens: (Σ_i w_i out_i with w_i ∝ exp(lse_i), its lse)."""
    lses = torch.stack([lse for _, lse in parts])                     # [n_parts, ...]
    top = lses.max(dim=0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lses - top)                                          # exp(-inf) = 0
    total = w.sum(dim=0).clamp_min(1e-30)
    out = sum(wi[..., None] * o for wi, (o, _) in zip(w, parts))
    return out / total[..., None], top + torch.log(total)


def coded_partial(q: torch.Tensor, layer: CodedLayer, cos: torch.Tensor, sin: torch.Tensor,
                  scale: float, keys: str = "rebuild") -> tuple[torch.Tensor, torch.Tensor]:
    """The coded rows and the raw side cache of one state, one softmax: (out, lse) as
    :func:`coded_partial_torch` (the torch reference; the batched GPU kernel is
    ``kite.kernels.coded_attention_triton.coded_decode``)."""
    coded = coded_partial_torch(q, layer, cos, sin, scale, keys)
    if layer.raw_k.shape[1] == 0:
        return coded
    return merge([coded, raw_partial(q, layer.raw_k, layer.raw_v, scale)])


def coded_attention(q: torch.Tensor, layer: CodedLayer, cos: torch.Tensor, sin: torch.Tensor,
                    scale: float | None = None, live_k: torch.Tensor | None = None,
                    live_v: torch.Tensor | None = None, live_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [Hq, n, d] over a resident state and the sequence's live tokens (raw keys /
    values [H, S, d] after it, ``live_mask`` [Hq|1, n, S]): [Hq, n, d] float32."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    parts = [coded_partial(q, layer, cos, sin, scale)]
    if live_k is not None and live_k.shape[-2]:
        parts.append(raw_partial(q, live_k, live_v, scale, live_mask))
    return merge(parts)[0]


def coded_decode_partial(q: torch.Tensor, layers, cos: torch.Tensor, sin: torch.Tensor,
                         scale: float, keys: str = "rebuild", **kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence, q [N, Hq, d], over each sequence's resident layer (coded rows and
    raw side cache, one softmax): (out [N, Hq, d], lse [N, Hq]) float32.

    ``layers``: a list of CodedLayer, or on a GPU a ``coded_attention_triton.CodedBatch`` of them
    (its tables built once per batch). On a GPU with Triton the batched kernel runs; elsewhere the
    torch reference, sequence by sequence. ``keys``: the keys' form (:func:`coded_partial_torch`;
    "coef" runs the stream kernel). ``kernel``: the GPU kernel's options (its configuration).
    """
    check_keys(keys)
    if q.is_cuda:
        try:
            from kite.kernels import coded_attention_triton as tri
        except ImportError:   # no Triton: the reference below
            tri = None
        if tri is not None:
            batch = layers if isinstance(layers, tri.CodedBatch) else tri.CodedBatch(list(layers))
            o, lse = tri.coded_decode(q, batch, cos, sin, scale, keys=keys, **kernel)
            parts = [(o[:, s], lse[:, s]) for s in range(o.shape[1])]
            if batch.raw_k.shape[2]:
                ro, rl = raw_partial(q[:, :, None], batch.raw_k, batch.raw_v, scale, batch.raw_mask)
                parts.append((ro[:, :, 0], rl[:, :, 0]))
            return merge(parts)
        layers = layers.layers if hasattr(layers, "layers") else layers
    outs = [coded_partial(q[i][:, None], layer, cos, sin, scale, keys) for i, layer in enumerate(layers)]
    return torch.stack([o[:, 0] for o, _ in outs]), torch.stack([lse[:, 0] for _, lse in outs])
