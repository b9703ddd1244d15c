"""What `kite upcycle inspect` reports about a state, as plain data."""

from __future__ import annotations

from pathlib import Path

from kite.upcycle.address import check_address
from kite.upcycle.format.container import FORMAT_VERSION, StateFile
from kite.upcycle.load import check_parts


def describe_state(path: str | Path, verify: bool = False) -> dict:
    """The header as plain data (fingerprints, geometry, codec, clusters with their bytes); with
    `verify`, every part's checksum too, and the checks a load makes of each part before decoding it. Opening checks the header and the file's size."""
    with StateFile(path) as sf:
        meta = sf.meta
        per_cluster: dict[int, int] = {}
        layer_codecs = 0
        for key, entry in sf.index.items():
            if key.startswith("c"):
                per_cluster[int(key[1:].split("/")[0])] = per_cluster.get(int(key[1:].split("/")[0]), 0) + entry.length
            else:
                layer_codecs += entry.length
        data_bytes = sum(e.length for e in sf.index.values())
        coded = [e for e in sf.index.values() if e.codec == "rans"]
        fps = meta.get("fingerprints") or {}
        raw = meta.get("raw_kv_bytes_fp16")
        report = {
            "path": str(path),
            "format_version": FORMAT_VERSION,
            "file_bytes": sf.file_size,
            "n_tokens": meta["n_tokens"],
            "created_at": meta.get("created_at"),
            "kite_version": meta.get("kite_version"),
            # the combined fingerprint, as `kite model info` prints it and `upcycle migrate` takes it
            "fingerprint": fps.get("combined"),
            "fingerprints": fps,
            "model": meta["model"].get("spec"),
            "geometry": meta["model"]["geometry"],
            "source": meta.get("source"),
            "codec": meta["codec"],
            # groups of layers coded on one basis each (None: a codec per layer)
            "layer_groups": meta.get("layer_groups"),
            # the layer weights the bit allocation used (their fingerprint; None: every layer side alike)
            "layer_weights": (meta.get("layer_weights") or {}).get("fingerprint"),
            "raw_kv_bytes_fp16": raw,
            "compression_ratio": raw / sf.file_size if raw is not None else None,
            "clusters": [{"id": c["id"], "label": c["label"], "confidence": c.get("confidence"),
                          "n_tokens": c["n_tokens"], "token_ranges": c["token_ranges"],
                          "preview": c.get("preview", ""), "bytes": per_cluster.get(c["id"], 0)}
                         for c in meta["clusters"]],
            "bytes": {"header": sf.file_size - data_bytes, "layer_codecs": layer_codecs,
                      "clusters": sum(per_cluster.values())},
            # parts stored with their codes entropy coded (compression.entropy_coding; None: none)
            "entropy_coded": {"parts": len(coded), "of_parts": sum(1 for k in sf.index if k.startswith("c")),
                              "bytes_saved": sum(e.raw_length - e.length for e in coded)} if coded else None,
            # the document's last tokens kept as ids, run through the model by every load (0: none)
            "recomputed_tokens": int((meta.get("recompute") or {}).get("tokens", 0)),
            "tagger": meta.get("tagger"),
            # the content address, recomputed from the header and checked (None: unaddressed)
            "address": check_address(meta, sf.format_version, str(path)),
            # the keyed digest (None: unsigned); `checked`: this KITE has the key, and the open checked it
            "signature": _signature(meta),
        }
        if verify:
            status = sf.verify()
            # then, of the parts whose bytes are whole, what a load checks before decoding them
            status.update({k: v for k, v in check_parts(sf, verify=False).items() if status.get(k) == "ok"})
            failed = [k for k, v in status.items() if v != "ok"]
            report["checksums"] = {"ok": len(status) - len(failed), "failed": failed,
                                   "errors": {k: status[k] for k in failed}}
    return report


def _signature(meta: dict) -> dict | None:
    from kite.upcycle.format import signing_policy

    sec = meta.get("signature")
    if not isinstance(sec, dict):
        return None
    return {"scheme": sec.get("scheme"), "key_id": sec.get("key_id"), "checked": signing_policy().key is not None}
