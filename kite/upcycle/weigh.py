"""Measuring a model's layer weights (:class:`kite.upcycle.codec.LayerWeights`, `kite upcycle weigh`):
each calibration document coded at a ratio and decoded, each layer side in turn put back exact, the
continuation's KL this wins per unit of that side's relative squared error."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kite.errors import BadInput
from kite.runtime.cache import KVPrefix, new_cache
from kite.runtime.generate import forward_tokens
from kite.upcycle.capture import capture
from kite.upcycle.codec.layer import decode, encode, fit_state
from kite.upcycle.codec.layer_weights import ALPHA, FLOOR, LayerWeights
from kite.upcycle.codec.settings import settings_for
from kite.upcycle.quality import compare_logits, split_text
from kite.upcycle.rope import apply_rope, rope_cos_sin

__all__ = ["measure_layer_weights"]


def _decoded(keys_pre: list[torch.Tensor], values: list[torch.Tensor], settings, parts: int):
    """Every layer coded at ``settings`` in ``parts`` contiguous parts and decoded (pre-RoPE keys, values)."""
    T = keys_pre[0].shape[1]
    sets = list(torch.arange(T).chunk(parts))
    K, V = [], []
    for layer, lc in enumerate(fit_state(keys_pre, values, settings, sets)):
        Kh, Vh = torch.empty_like(keys_pre[layer]), torch.empty_like(values[layer])
        for idx in sets:
            k, v = decode(lc, encode(lc, keys_pre[layer][:, idx], values[layer][:, idx], idx))
            Kh[:, idx], Vh[:, idx] = k, v
        K.append(Kh)
        V.append(Vh)
    return K, V


@torch.inference_mode()
def measure_layer_weights(lm, texts: dict[str, str], ratio: float = 16.0, *, context_tokens: int = 1536,
                          continuation_tokens: int = 256, alpha: float = ALPHA, floor: float = FLOOR, parts: int = 8,
                          progress: Callable[[str, int, int], None] | None = None) -> LayerWeights:
    """The layer weights of ``lm`` measured on ``texts`` (calibration documents: never the ones the
    weights are judged on) at ``ratio``: per document, its first ``context_tokens`` coded (``parts``
    contiguous parts) and decoded, then each layer side alone put back exact; the KL of the next
    ``continuation_tokens`` against the full context that this wins, per unit of that side's relative
    squared error. ``progress(document, layer, n_layers)``."""
    if not texts:
        raise BadInput("layer weights: no calibration documents")
    if not alpha > 0 or not floor > 0:
        raise BadInput(f"layer weights: alpha and floor must be > 0, got {alpha} and {floor}")
    s = settings_for(ratio)
    L = lm.geometry.n_layers

    def score(keys_post, values, cont, start):
        prefix = KVPrefix(keys=list(keys_post), values=list(values), next_position=start)
        return forward_tokens(lm.model, cont, new_cache(lm.model, prefix), start)[:-1].cpu()

    splits = {}
    for name, text in texts.items():            # every document long enough before any slow work
        try:
            splits[name] = split_text(lm, text, context_tokens, continuation_tokens)
        except BadInput as e:
            raise BadInput(f"{name}: {e}") from None
    per_unit = {"k": torch.zeros(L, dtype=torch.float64), "v": torch.zeros(L, dtype=torch.float64)}
    kl_base = {}
    for name, (ctx, cont) in splits.items():
        targets = torch.tensor(cont[1:])
        cap = capture(lm, "", ids=ctx)
        keys_pre = [k.cpu().float() for k in cap.keys_pre]
        values = [v.cpu().float() for v in cap.values]
        cos, sin = rope_cos_sin(lm.model, torch.arange(len(ctx)))
        exact_k = [apply_rope(k, cos, sin) for k in keys_pre]
        full = score(exact_k, values, cont, len(ctx))
        Kd, Vd = _decoded(keys_pre, values, s, parts)
        coded_k = [apply_rope(k, cos, sin) for k in Kd]
        base = compare_logits(full, score(coded_k, Vd, cont, len(ctx)), targets)["kl_mean"]
        kl_base[name] = round(base, 6)
        for layer in range(L):
            for side, X, Xh in (("k", keys_pre[layer], Kd[layer]), ("v", values[layer], Vd[layer])):
                rel = float((X - Xh).pow(2).sum() / (X - X.mean(dim=1, keepdim=True)).pow(2).sum().clamp_min(1e-30))
                ks, vs = list(coded_k), list(Vd)
                if side == "k":
                    ks[layer] = exact_k[layer]
                else:
                    vs[layer] = values[layer]
                kl = compare_logits(full, score(ks, vs, cont, len(ctx)), targets)["kl_mean"]
                per_unit[side][layer] += (base - kl) / max(rel, 1e-9) / len(texts)
            if progress:
                progress(name, layer + 1, L)
    both = torch.cat([per_unit["k"], per_unit["v"]])
    mean = both.clamp_min(0).mean().clamp_min(1e-30)
    w = {side: (per_unit[side] / mean).clamp_min(floor) ** alpha for side in "kv"}
    norm = torch.cat([w["k"], w["v"]]).mean()
    meta = {"model_fingerprint": lm.fingerprints.base, "ratio": ratio, "alpha": alpha, "floor": floor,
            "context_tokens": context_tokens, "continuation_tokens": continuation_tokens, "parts": parts,
            "documents": list(texts), "kl_base": kl_base}
    return LayerWeights(tuple(round(float(x), 6) for x in w["k"] / norm),
                        tuple(round(float(x), 6) for x in w["v"] / norm), meta)
