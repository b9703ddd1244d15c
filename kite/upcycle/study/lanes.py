"""The nibble-lanes resident form's variants on a held-out document: each variant's lanes coded,
decoded and scored against the full context (benchmarks/lanes_quality.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from kite.kernels import lanes
from kite.upcycle.codec.lanes import encode as encode_lanes
from kite.upcycle.study.held_out import Document, relative_error

def lanes_prefix(doc: Document, k_lanes: int, v_lanes: int, group: int, clip: str, sinks: int = 1,
                 worst: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """Every layer of the document in lanes, decoded: (keys post-RoPE, values, byte counts). Bytes:
    ``state_bytes`` is ``Lanes.nbytes()`` summed over layers; ``state_bytes_unique_basis`` counts a
    basis row once per component (a component of 2 lanes has its row twice in ``k_basis`` /
    ``v_basis``); ``state_bytes_fp16_tables``: the weights and constants in fp16. ``worst``: the
    ``sinks`` raw rows are token 0 and the tokens coded worst (:func:`worst_first`), not the first
    ones (the rows come back in the document's order)."""
    keys, values, nbytes, fp16_tables, dup_rows = [], [], 0, 0, 0
    for k, v in zip(doc.keys_post, doc.cap.values):
        idx = None
        if worst:
            idx = worst_first(k, v, k_lanes, v_lanes, group, clip, sinks)[:, :, None].expand_as(k)
            k, v = k.gather(1, idx), v.gather(1, idx)
        x = encode_lanes(k, v, k_lanes, v_lanes, group=group, sinks=sinks, clip=clip)
        nbytes += x.nbytes()
        fp16_tables += x.nbytes(table_bytes=2)
        for side in "kv":
            basis = getattr(x, f"{side}_basis")[0]                     # [H, R, d]: lane c's component
            dup_rows += sum(int(b.shape[0]) - int(torch.unique(b, dim=0).shape[0]) for b in basis)
        n = x.raw_k.shape[2] + int(x.length[0])
        kd, vd = lanes.decode(x, "k")[0, :, :n].to(k.dtype), lanes.decode(x, "v")[0, :, :n].to(v.dtype)
        if idx is not None:                                                      # back to the document's order
            kd, vd = torch.empty_like(kd).scatter_(1, idx, kd), torch.empty_like(vd).scatter_(1, idx, vd)
        keys.append(kd)
        values.append(vd)
    d = doc.keys_post[0].shape[-1]
    return keys, values, {"state_bytes": nbytes, "state_bytes_unique_basis": nbytes - dup_rows * d * 2,
                          "state_bytes_fp16_tables": fp16_tables}


def worst_first(k: torch.Tensor, v: torch.Tensor, k_lanes: int, v_lanes: int, group: int, clip: str, keep: int
                ) -> torch.Tensor:
    """Per head an order of the T tokens [H, T] whose first ``keep`` (the form's raw rows, kept exact)
    are token 0 and the ``keep - 1`` tokens a first coding codes worst (relative squared error of key
    plus value); the rest in the document's order. Attention reads post-RoPE rows in any order."""
    x = encode_lanes(k, v, k_lanes, v_lanes, group=group, sinks=1, clip=clip)
    H, T, _ = k.shape
    err = sum((lanes.decode(x, side)[0, :, :T] - t.float()).pow(2).sum(-1) / t.float().pow(2).sum(-1).mean(-1, keepdim=True)
              for side, t in (("k", k), ("v", v)))                             # [H, T]
    err[:, 0] = float("inf")
    top = err.topk(min(keep, T), dim=1).indices.sort(dim=1).values               # [H, keep]
    rest = torch.ones_like(err, dtype=torch.bool).scatter_(1, top, False)
    return torch.cat((top, torch.arange(T).expand(H, T)[rest].view(H, T - top.shape[1])), dim=1)


def lanes_variants(d: int, ratio: float, groups: list[int], clips: list[str], split_groups: list[int],
                   sinks: list[int] = (), sinks_groups: list[int] | None = None, worst: list[int] = ()
                   ) -> list[tuple[str, int, int, int, str, int, bool]]:
    """(label, k_lanes, v_lanes, group, clip, raw rows, worst-first): equal lanes 4 d / R at every
    group and clip (1 sink); the splits (half the lanes on one side) at ``split_groups`` and the first
    clip; at the first clip and ``sinks_groups`` (None: the first group) more exact rows: the first
    tokens (``sinks``, ``_s``) or token 0 and the tokens coded worst (``worst``, ``_w``)."""
    n, c0 = int(round(4 * d / ratio)), clips[0]
    out = [(f"lanes_g{g}_{c}", n, n, g, c, 1, False) for g in groups for c in clips]
    for g in split_groups:
        out += [(f"lanes_k{n // 2}v{n}_g{g}_{c0}", n // 2, n, g, c0, 1, False),
                (f"lanes_k{n}v{n // 2}_g{g}_{c0}", n, n // 2, g, c0, 1, False)]
    for g in groups[:1] if sinks_groups is None else sinks_groups:
        out += [(f"lanes_g{g}_{c0}_s{s}", n, n, g, c0, s, False) for s in sinks]
        out += [(f"lanes_g{g}_{c0}_w{s}", n, n, g, c0, s, True) for s in worst]
    return out


def score_cell(doc: Document, m: dict, keys, values, nbytes: int, seconds: float, **extra) -> dict:
    """One variant's cell: its bytes and ratio to the raw fp16 KV, the scores ``m`` against the full
    context (PPL, its delta, KL mean / median / max, top-1), the key and value errors, its seconds."""
    kerr, verr = relative_error(keys, doc.keys_post), relative_error(values, doc.cap.values)
    return {"state_bytes": nbytes, "compression_ratio": round(doc.raw_bytes / nbytes, 3), **extra,
            "ppl": round(m["ppl_other"], 4), "ppl_delta": round(m["ppl_other"] - m["ppl_full"], 4),
            "kl": round(m["kl_mean"], 5), "kl_median": round(m["kl_median"], 5), "kl_max": round(m["kl_max"], 3),
            "top1": round(m["top1"], 4), "key_rel_error_mean": round(sum(kerr) / len(kerr), 4),
            "value_rel_error_mean": round(sum(verr) / len(verr), 4), "seconds": round(seconds, 1)}


def lanes_cells(doc: Document, variants: list[tuple], keys: list[torch.Tensor] | None = None,
                values: list[torch.Tensor] | None = None, prefix: str = "") -> dict:
    """Each lanes variant (:func:`lanes_variants`) of the document's KV, or of ``keys`` (post-RoPE) /
    ``values`` in its place (a codec's decoded KV: lanes on top of it), decoded and scored against the
    full context; cells labelled ``prefix + label``. Errors are against the document's own KV; with
    ``keys`` given, ``lanes_key_rel_error_mean`` / ``lanes_value_rel_error_mean`` are the lanes' own
    (against ``keys`` / ``values``)."""
    src = doc if keys is None else SimpleNamespace(keys_post=keys, cap=SimpleNamespace(values=values))
    out = {}
    for label, kl_, vl_, g, c, sk, w in variants:
        t1 = time.perf_counter()
        k, v, b = lanes_prefix(src, kl_, vl_, g, c, sk, w)
        extra = {}
        if keys is not None:
            ke, ve = relative_error(k, keys), relative_error(v, values)
            extra = {"lanes_key_rel_error_mean": round(sum(ke) / len(ke), 4),
                     "lanes_value_rel_error_mean": round(sum(ve) / len(ve), 4)}
        out[prefix + label] = score_cell(doc, doc.score(k, v), k, v, b["state_bytes"], time.perf_counter() - t1,
                                    k_lanes=kl_, v_lanes=vl_, group=g, clip=c, sinks=sk, worst_first=w,
                                    **{n: x for n, x in b.items() if n != "state_bytes"}, **extra)
    return out
