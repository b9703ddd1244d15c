"""Keys coded before or after RoPE with the codec's own fit / encode / decode: what a state's path
(pre-RoPE) and a kernel reading coefficients with no rebuild (post-RoPE) each cost at a ratio, and
how much of the keys' variance their top principal components hold."""

from __future__ import annotations

import torch

import kite.upcycle.codec as codec
from kite.upcycle.rope import apply_rope

WHERE = ("pre", "post")
MODES = (*WHERE, "post_rmean")


def coded_keys(keys_pre: list[torch.Tensor], values: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
               settings: codec.CodecSettings, where: str, part_tokens: int = 0
               ) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Code a document's keys and values [H, T, d] per layer with the codec's own fit / encode /
    decode and return the keys as attention reads them (post-RoPE), the values, and every stored
    byte (layer codecs + parts).

    ``where="pre"``: keys coded before RoPE, rotated after decoding (a state's path);
    ``where="post"``: keys coded as the cache holds them (``apply_rope(keys_pre)``), used as decoded;
    ``where="post_rmean"``: the per-head pre-RoPE mean mu (stored fp16, paid from the keys' bit
    budget) taken out first, the rest coded post-RoPE, ``apply_rope(mu)`` added back: a score
    kernel then reads ``q . R_t mu`` from the cos/sin tables (d per token) and the rest from
    coefficients, still with no rebuild.
    ``part_tokens``: code the tokens as contiguous parts of this many (0: one part)."""
    if where not in MODES:
        raise ValueError(f"where must be one of {MODES}, got {where!r}")
    means = [k.mean(dim=1, keepdim=True).half().float() if where == "post_rmean" else None for k in keys_pre]
    stored = keys_pre if where == "pre" else [apply_rope(k if mu is None else k - mu, cos, sin)
                                               for k, mu in zip(keys_pre, means)]
    T = values[0].shape[1]
    if where == "post_rmean" and settings.k_mode == "pca":   # the fp16 means are paid from the keys' budget
        settings = codec.settings_for(settings, k_bits=settings.k_bits - 16 / T)
    layer_codecs = codec.fit_layers(list(zip(stored, values)), settings)
    step = part_tokens or T
    keys, vals, nbytes = [], [], 0
    for lc, K, V, mu in zip(layer_codecs, stored, values, means):
        nbytes += codec.nbytes(lc)
        ks, vs = [], []
        for a in range(0, T, step):
            part = codec.encode(lc, K[:, a:a + step], V[:, a:a + step], positions=torch.arange(a, min(a + step, T)))
            nbytes += codec.nbytes(part)
            k, v = codec.decode(lc, part)
            ks.append(k)
            vs.append(v)
        k, v = torch.cat(ks, dim=1), torch.cat(vs, dim=1)
        if where == "pre":
            k = apply_rope(k, cos, sin)
        elif mu is not None:
            k = k + apply_rope(mu.expand_as(k), cos, sin)
            nbytes += mu.numel() * 2
        keys.append(k)
        vals.append(v)
    return keys, vals, nbytes


def variance_fractions(keys: torch.Tensor, tops: list[int]) -> dict:
    """For keys [H, T, d]: the fraction of the centred variance in the top-k principal components
    (per head, mean over heads) for each k in ``tops``, and the share of the keys' energy (sum of
    squares) in their per-head mean."""
    mean, evals, _ = codec.batched_pca(keys.float(), center=True)      # [H, d], [H, d] descending
    total = evals.sum(-1).clamp_min(1e-30)
    out = {f"top{k}": round(float((evals[:, :k].sum(-1) / total).mean()), 4) for k in tops}
    energy = keys.double().pow(2).sum(dim=(1, 2))                        # [H]
    out["mean_energy_share"] = round(float((mean.double().pow(2).sum(-1) * keys.shape[1] / energy).mean()), 4)
    return out
