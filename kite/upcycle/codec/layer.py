"""The per-layer codec: fit a layer's shared part on the whole document, encode and decode parts.

Keys are stored *pre-RoPE* (:mod:`kite.upcycle.rope`) and values as they are, shaped
``[H_kv, T, d]``. A state is split into clusters (sets of token spans) that load independently, so
the stored form is one **shared part per layer** (:class:`LayerCodec`, from :func:`fit_layer`) and
one **part per (cluster, layer, K|V)** (a :class:`Blob`, two per :class:`EncodedPart` from
:func:`encode`). How each side is stored is its mode's registered coder (:mod:`.coders`). The codec
is pure torch; on a busy CPU run it with one intra-op thread (its ops are small).
"""

from __future__ import annotations

import torch

from kite.kernels.eigh import batched_pca
from kite.upcycle.codec.blob import EncodedPart, LayerCodec
from kite.upcycle.codec.coders import attach_regenerator, blocks, coder
from kite.upcycle.codec.settings import CodecSettings, settings_for
from kite.upcycle.codec.bits import SideBudget, allocation_cost
from kite.upcycle.codec.state_bits import allocate_state


def fit_layer(K_pre: torch.Tensor, V: torch.Tensor, settings: CodecSettings | str | float | None = None,
              pca: dict | None = None, budget_tokens: int | None = None,
              regenerator: dict | None = None, weights: dict | None = None,
              choice: str | None = None, metric=None, bits: dict | None = None,
              budgets: dict | None = None) -> LayerCodec:
    """Fit the shared per-layer part on the whole document's pre-RoPE keys and values [H, T, d].

    ``pca`` may carry precomputed ``{"k": (mean, evals, U), "v": (...)}`` from :func:`fit_layers`'
    batched path. ``budget_tokens`` (default: the T fitted on) is how many tokens the bit budget
    is spread over: the shared part is paid once for that many tokens, so a codec fitted on a
    sample and used for more tokens (the budgeted KV cache) gives its parts the bits they carry.
    ``regenerator``: this layer's calibrated ``{"k": (mean, variances, basis), "v": ...}``
    (:class:`kite.upcycle.codec.Regenerator`): each ``pca`` side is then coded on the regenerator's
    basis (``rpca``, no basis stored) unless the document's own basis is expected to leave less
    error for the same bytes.
    ``weights``: ``{"k": [B, D], "v": [B, D]}``, the distortion weight of each dim of the blocks
    (attention-aware: what a key error costs the scores, a value error the attention output; a
    weighted regenerator's, :meth:`kite.upcycle.codec.Regenerator.weights`). PCA sides then
    minimise the weighted squared error (weighted PCA) and, with a regenerator, each side keeps the
    candidate (the document's weighted basis, its plain basis, the regenerator's) whose *measured*
    weighted error on the document is lowest at the same byte budget.
    ``choice`` (with a regenerator): ``"measured"`` (the default with weights; without them the
    metric is the plain squared error and the candidates are the regenerator's basis and the
    document's) or ``"expected"`` (the default without weights: the error the bit allocation
    expects, as before weights existed).
    ``metric(side, X, X_hat) -> float`` (with a regenerator; implies ``choice="measured"``): what a
    candidate's decoded side costs, in place of the (weighted) squared error -- e.g. the attention
    probe's (:class:`kite.upcycle.codec.probe.AttentionProbe`).
    ``bits``: ``{"k": [B, D], "v": [B, D]}``, the components' bits as allocated over the whole state
    (:func:`fit_state`) for ``pca`` sides, in place of the layer's own budget; ``budgets``:
    ``{"k": SideBudget, "v": ...}``, each side's share of a state-wide budget (every candidate is
    allocated within it).
    """
    s = settings_for(settings)
    if K_pre.dim() != 3 or K_pre.shape != V.shape:
        raise ValueError(f"keys and values must both be [H, T, d], got {tuple(K_pre.shape)} and "
                         f"{tuple(V.shape)}")
    H, T, d = K_pre.shape
    tensors: dict[str, torch.Tensor] = {}
    meta: dict = {"settings": s.to_json(), "H": H, "d": d, "T_fit": T}
    weights = weights or {}
    choice = choice or ("measured" if weights or metric is not None else "expected")
    if choice not in ("measured", "expected"):
        raise ValueError(f"choice must be 'measured' or 'expected', got {choice!r}")
    for side, X, mode in (("k", K_pre, s.k_mode), ("v", V, s.v_mode)):
        w = weights.get(side) if mode == "pca" else None
        if regenerator is not None and mode == "pca" and (w is not None or choice == "measured"):
            _fit_measured(side, X, s, tensors, meta, (pca or {}).get(side), regenerator[side], budget_tokens, w,
                          metric, (budgets or {}).get(side))
        elif regenerator is not None and mode == "pca":
            _fit_best(side, X, s, tensors, meta, (pca or {}).get(side), regenerator[side], budget_tokens,
                      (budgets or {}).get(side))
        else:
            coder(mode).fit(side, X, s, tensors, meta, pca=(pca or {}).get(side), budget_tokens=budget_tokens,
                            weights=w, bits=(bits or {}).get(side) if mode == "pca" else None,
                            budget=(budgets or {}).get(side) if mode == "pca" else None)
    lc = LayerCodec(tensors=tensors, meta=meta)
    if regenerator is not None:
        attach_regenerator(lc, {side: regenerator[side][2] for side in ("k", "v")})
    return lc


def _fit_best(side, X, s, tensors, meta, pca, regen, budget_tokens, budget=None) -> None:
    """Fit one side both ways (the document's basis, the regenerator's) and keep the one expected
    to leave less squared error at the same byte budget."""
    tried = []
    for mode, given in (("pca", pca), ("rpca", regen)):
        t, m = {}, {}
        err = coder(mode).fit(side, X, s, t, m, pca=given, budget_tokens=budget_tokens, budget=budget)
        tried.append((err, mode, t, m))
    _, _, t, m = min(tried, key=lambda x: (x[0], x[1] != "rpca"))
    tensors.update(t)
    meta.update(m)


def weighted_error(lc: LayerCodec, side: str, X: torch.Tensor, weights: torch.Tensor) -> float:
    """The weighted squared error (summed) of coding the tokens X [H, T, d] as one part of ``lc``'s
    ``side`` and decoding them; ``weights`` [B, D] over the blocks' dims. The document's first
    ``sink_tokens`` are its sinks (kept in fp16), as in a state."""
    Xh = _coded(lc, side, X)
    joint = lc.settings.joint_heads
    err = (blocks(X.float(), joint) - blocks(Xh, joint)).pow(2)      # [B, T, D]
    return float((err.sum(dim=1).double() * weights.double().to(err.device)).sum())


def _coded(lc: LayerCodec, side: str, X: torch.Tensor) -> torch.Tensor:
    """X [H, T, d] coded as one part of ``lc``'s ``side`` (the first ``sink_tokens`` as sinks) and decoded."""
    c = coder(lc.meta[side]["mode"])
    return c.decode(lc, side, c.encode(lc, side, X, torch.arange(X.shape[1])))


def _fit_measured(side, X, s, tensors, meta, pca, regen, budget_tokens, weights, metric=None, budget=None) -> None:
    """Fit one side each way -- the document's weighted basis, its plain basis, the regenerator's
    (weighted with the same weights) -- code the whole document with each and keep the one whose
    measured weighted error is lowest (ties go to the regenerator: no basis stored). ``weights``
    None: the plain squared error, of the regenerator's basis and the document's."""
    H, T, d = X.shape
    tried = []
    cands = (("rpca", regen, weights), ("pca", None, weights), ("pca", pca, None)) if weights is not None else \
        (("rpca", regen, None), ("pca", pca, None))
    if weights is None:
        B, _, D = blocks(X[:, :1], s.joint_heads).shape
        weights = torch.ones(B, D)
    for mode, given, w in cands:
        t, m = {}, {"settings": s.to_json(), "H": H, "d": d}
        coder(mode).fit(side, X, s, t, m, pca=given, budget_tokens=budget_tokens, weights=w, budget=budget)
        trial = LayerCodec(tensors=t, meta=m)
        if mode == "rpca":
            attach_regenerator(trial, {side: regen[2]}, sides=(side,))
        err = weighted_error(trial, side, X, weights) if metric is None else metric(side, X, _coded(trial, side, X))
        tried.append((err, len(tried), t, m))
    _, _, t, m = min(tried, key=lambda x: (x[0], x[1]))
    tensors.update(t)
    meta.update({key: value for key, value in m.items() if key not in ("settings", "H", "d")})


def fit_layers(KV: list[tuple[torch.Tensor, torch.Tensor]], settings=None) -> list[LayerCodec]:
    """Fit every layer, with all PCAs of the model in one batched Gram + eigh per side."""
    s = settings_for(settings)
    pcas: list[dict] = [dict() for _ in KV]
    for side, mode in (("k", s.k_mode), ("v", s.v_mode)):
        if mode != "pca":
            continue
        Xs = [blocks((k if side == "k" else v).float(), s.joint_heads) for k, v in KV]
        if len({tuple(x.shape) for x in Xs}) == 1:
            mean, ev, U = batched_pca(torch.cat(Xs, dim=0), center=s.center)
            B = Xs[0].shape[0]
            for i in range(len(KV)):
                pcas[i][side] = (mean[i * B:(i + 1) * B], ev[i * B:(i + 1) * B], U[i * B:(i + 1) * B])
    return [fit_layer(k, v, s, pca=p) for (k, v), p in zip(KV, pcas)]


def state_budgeted(settings) -> bool:
    """Whether these settings allocate bits over the whole state (:func:`fit_state`): ``budget="state"``
    with PCA keys and values."""
    s = settings_for(settings)
    return s.budget == "state" and s.k_mode == s.v_mode == "pca"


def fit_state(keys_pre: list[torch.Tensor], values: list[torch.Tensor], settings, token_sets: list[torch.Tensor], *,
              overhead_bytes: int | None = None, layer_kwargs=None, layer_weights=None) -> list[LayerCodec]:
    """Fit every layer (pre-RoPE keys and values [H, T, d] per layer) with each component's bits
    allocated over the whole state's budget (:mod:`.state_bits`), its costs exact for the parts
    ``token_sets`` (index sets partitioning range(T)) the state will be coded in. ``overhead_bytes``:
    the container header's expected size (default: :func:`.state_bits.container_overhead`).
    Settings whose budget is per layer fit each layer on its own, as :func:`fit_layer` does.
    ``layer_kwargs(layer) -> dict``: more :func:`fit_layer` arguments per layer (a regenerator's:
    ``Regenerator.layer``); each layer side then gets the bits the state-wide allocation gave it on
    the document's own basis as its budget, and its candidates (the regenerator's basis, the
    document's) are allocated within it. ``layer_weights``: each (layer, side)'s weight in the
    state-wide allocation (:class:`.layer_weights.LayerWeights`; None: keys' ``k_weight``)."""
    s = settings_for(settings)
    if not state_budgeted(s):
        return [fit_layer(k, v, s, **(layer_kwargs(i) if layer_kwargs else {}))
                for i, (k, v) in enumerate(zip(keys_pre, values))]
    L = len(keys_pre)
    H, T, d = keys_pre[0].shape
    pcas: list[dict] = [dict() for _ in range(L)]
    evals = {}
    for side, Xs in (("k", keys_pre), ("v", values)):
        blocks_ = [blocks(x.float(), s.joint_heads) for x in Xs]
        mean, ev, U = batched_pca(torch.cat(blocks_, dim=0), center=s.center)
        B, D = blocks_[0].shape[0], blocks_[0].shape[2]
        for i in range(L):
            pcas[i][side] = (mean[i * B:(i + 1) * B], ev[i * B:(i + 1) * B], U[i * B:(i + 1) * B])
        evals[side] = ev.clamp_min(0).float().reshape(L, B, D)
    sets = [torch.as_tensor(t).reshape(-1) for t in token_sets]
    bits = allocate_state(evals, s, H, d, sets, overhead_bytes, layer_weights)
    if layer_kwargs is None:
        return [fit_layer(k, v, s, pca=p, bits={side: bits[side][i] for side in bits})
                for i, ((k, v), p) in enumerate(zip(zip(keys_pre, values), pcas))]
    parts = tuple(int(t.numel()) for t in sets if t.numel())
    B, D = evals["k"].shape[1:]
    return [fit_layer(k, v, s, pca=p, budgets={side: SideBudget(allocation_cost(bits[side][i], T, D, s, parts), parts)
                                               for side in bits}, **layer_kwargs(i))
            for i, ((k, v), p) in enumerate(zip(zip(keys_pre, values), pcas))]


def encode(layer_codec: LayerCodec, K_pre_sub: torch.Tensor, V_sub: torch.Tensor,
           positions=None, widths: dict | None = None) -> EncodedPart:
    """Encode one part (a cluster's tokens of one layer): pre-RoPE keys and values [H, T_sub, d].

    ``positions`` (1-D, the tokens' positions in the document) lets the codec keep the attention
    sinks (positions < ``sink_tokens``) in fp16; without it no token is treated as a sink.
    ``widths``: ``{"k": [R_k], "v": [R_v]}``, the part's own bit width per stored column of a PCA
    side (:mod:`.part_widths` computes them for a per-label ratio); a side not named uses its layer's.
    """
    if positions is not None:
        positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
        if positions.numel() != K_pre_sub.shape[1]:
            raise ValueError(f"{positions.numel()} positions for {K_pre_sub.shape[1]} tokens")
    H, d = layer_codec.meta["H"], layer_codec.meta["d"]
    for name, X in (("keys", K_pre_sub), ("values", V_sub)):
        if X.dim() != 3 or X.shape[0] != H or X.shape[2] != d:
            raise ValueError(f"{name} must be [{H}, T, {d}], got {tuple(X.shape)}")
    meta = layer_codec.meta
    widths = widths or {}
    return EncodedPart(k=coder(meta["k"]["mode"]).encode(layer_codec, "k", K_pre_sub, positions, widths.get("k")),
                       v=coder(meta["v"]["mode"]).encode(layer_codec, "v", V_sub, positions, widths.get("v")))


def decode(layer_codec: LayerCodec, part: EncodedPart) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode a part to float32 (pre-RoPE keys, values), each [H, T_sub, d]."""
    meta = layer_codec.meta
    return (coder(meta["k"]["mode"]).decode(layer_codec, "k", part.k),
            coder(meta["v"]["mode"]).decode(layer_codec, "v", part.v))


__all__ = ["batched_pca", "decode", "encode", "fit_layer", "fit_layers", "fit_state", "state_budgeted", "weighted_error"]
