"""Re-encode some clusters of a state at higher ratios, from its stored form (no document needed).

Each chosen part is decoded and coded again on the same layer codec at its own, smaller widths
(:mod:`kite.upcycle.codec.part_widths`); every other blob is copied as it is, and the file is
replaced atomically, so its path (and the state id health records are kept under) stays. The
header records each cluster's ratio and, under ``retuned``, when which cluster moved from what to
what. ``kite upcycle retune`` (:mod:`kite.yoco.flywheel`) decides the ratios.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

from kite.errors import BadInput
from kite.upcycle import codec
from kite.upcycle.codec.coders import PcaSide
from kite.upcycle.codec.part_widths import part_widths
from kite.upcycle.codec.regenerator import resolve
from kite.upcycle.codec.settings import ratio_of
from kite.upcycle.format.container import StateFile, StateWriter
from kite.upcycle.format.names import blob_key, group_leads
from kite.upcycle.load.selection import cluster_positions


def state_ratio(meta: dict) -> float | None:
    """The ratio a state's clusters without one of their own were coded at (None: a preset)."""
    lr = meta.get("label_ratios")
    return float(lr["default"]) if lr else ratio_of(meta.get("codec") or {})


def cluster_ratios(meta: dict) -> list[float | None]:
    """The ratio each cluster of a state was coded at, in cluster order."""
    default = state_ratio(meta)
    return [float(c["ratio"]) if c.get("ratio") is not None else default for c in meta["clusters"]]


def not_recodable(meta: dict) -> str | None:
    """Why a state's clusters cannot be coded again at other ratios (None: they can)."""
    c = meta.get("codec") or {}
    if c.get("k_mode") != "pca" or c.get("v_mode") != "pca" or None in cluster_ratios(meta):
        return f"coded with the {c.get('name', '?')} preset: per-cluster ratios need a PCA ratio"
    return None


def recode_clusters(path: str | Path, targets: dict[int, float], *, regenerator=None,
                    progress: Callable[[int, int], None] | None = None) -> int:
    """Code clusters ``targets`` (cluster index → a ratio above its current one) of the PCA-coded
    state at ``path`` again at those ratios; returns the new file's size. ``regenerator``: the
    state's, when it was coded on one (else the copy kept under KITE_HOME)."""
    path = Path(path)
    with StateFile(path) as state:
        meta = dict(state.meta)
        now = cluster_ratios(meta)
        why = not_recodable(meta)
        if why is not None:
            raise BadInput(f"{path}: {why}")
        for i, want in targets.items():
            if not 0 <= i < len(now):
                raise BadInput(f"{path}: no cluster {i} (it has {len(now)})")
            if want <= now[i]:
                raise BadInput(f"{path}: cluster {i} is at ratio {now[i]:g}; its stored form cannot be "
                               f"recoded at {want:g} (only higher ratios: fewer bytes)")
        fp = (meta.get("regenerator") or {}).get("fingerprint")
        regen = resolve(fp, regenerator) if fp is not None else None
        n_layers = int(meta["model"]["geometry"]["n_layers"])
        positions = {i: cluster_positions(state, meta["clusters"][i]["id"]) for i in targets}
        recoded: dict[str, bytes] = {}
        leads = group_leads(meta, n_layers)
        for done, layer in enumerate(leads):
            lc = codec.from_bytes(state.read(blob_key(None, layer)), codec.LayerCodec)
            if regen is not None:
                codec.attach_regenerator(lc, {s: regen.side(layer, s)[2] for s in ("k", "v")})
            for i, want in targets.items():
                kb, vb = blob_key(i, layer, "K"), blob_key(i, layer, "V")
                pk, pv = codec.from_bytes(state.read(kb)), codec.from_bytes(state.read(vb))
                K, V = codec.decode(lc, codec.EncodedPart(pk, pv))
                widths = {s: part_widths(lc, s, X, want, from_ratio=now[i], positions=positions[i],
                                         cap=PcaSide.part_widths(lc, s, blob))
                          for s, X, blob in (("k", K, pk), ("v", V, pv))}
                part = codec.encode(lc, K, V, positions[i], widths)
                recoded[kb], recoded[vb] = codec.to_bytes(part.k), codec.to_bytes(part.v)
            if progress:
                progress(done + 1, len(leads))
        writer = StateWriter()
        for key in state.index:
            writer.add(key, recoded[key] if key in recoded else state.read(key))
    clusters = [dict(cl, ratio=targets.get(i, now[i])) for i, cl in enumerate(meta["clusters"])]
    lr = dict(meta.get("label_ratios") or {"default": state_ratio(meta), "labels": {}})
    lr["labels"] = dict(sorted({**lr["labels"], **{clusters[i]["label"]: w for i, w in targets.items()}}.items()))
    meta.update(clusters=clusters, label_ratios=lr)
    meta.pop("entropy", None)     # every part is written plain (a part of its own widths is not entropy coded)
    meta["retuned"] = list(meta.get("retuned", [])) + [{
        "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "clusters": {str(i): [now[i], w] for i, w in sorted(targets.items())}}]
    return writer.write(path, meta)
