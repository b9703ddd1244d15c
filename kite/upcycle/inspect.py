"""What `kite upcycle inspect` reports about a state, as plain data."""

from __future__ import annotations

from pathlib import Path

from kite.upcycle.format.container import FORMAT_VERSION, StateFile


def describe_state(path: str | Path, verify: bool = False) -> dict:
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
        report = {
            "path": str(path),
            "format_version": FORMAT_VERSION,
            "file_bytes": sf.file_size,
            "n_tokens": meta["n_tokens"],
            "created_at": meta.get("created_at"),
            "kite_version": meta.get("kite_version"),
            "fingerprints": meta["fingerprints"],
            "model": meta["model"]["spec"],
            "geometry": meta["model"]["geometry"],
            "source": meta.get("source"),
            "codec": meta["codec"],
            "raw_kv_bytes_fp16": meta["raw_kv_bytes_fp16"],
            "compression_ratio": meta["raw_kv_bytes_fp16"] / sf.file_size,
            "clusters": [{"id": c["id"], "label": c["label"], "confidence": c["confidence"],
                          "n_tokens": c["n_tokens"], "token_ranges": c["token_ranges"],
                          "preview": c["preview"], "bytes": per_cluster.get(c["id"], 0)}
                         for c in meta["clusters"]],
            "bytes": {"header": sf.file_size - data_bytes, "layer_codecs": layer_codecs,
                      "clusters": sum(per_cluster.values())},
            "tagger": meta.get("tagger"),
        }
        if verify:
            status = sf.verify()
            failed = [k for k, v in status.items() if v != "ok"]
            report["checksums"] = {"ok": len(status) - len(failed), "failed": failed,
                                   "errors": {k: status[k] for k in failed}}
    return report
