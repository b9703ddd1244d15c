"""What opening a `.upc` state costs, and what the header checks add (kite/upcycle/format/header.py).

Synthetic states with real-sized headers (30 layers, 3 KV heads, a full fingerprints/geometry/codec
section, clusters of 32-128-token spans or, the worst case benchmarks/gpu_speed.py writes, one range
per token; blobs of a few bytes: opening reads no blob). Each row is the median wall time of opening
one (`StateFile(path)`): the first open of a header in the process (checked), and a repeat (the
check is kept by the header's checksum, so a repeat does what every open did before the checks:
read, hash and parse the header, index the blobs). Also the header's JSON parse alone. Each first
open is of another copy of the state whose header differs in one character. The first open has the
repeat as its baseline (what the checks add); every row's floor is the header's bytes read once at
this CPU's measured memory bandwidth (opening reads no blob).

    .venv/bin/python benchmarks/state_open.py [--repeat 40]
"""

from __future__ import annotations

import json
import os
import random
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, cpu_bytes_ms, cpu_mem_text, finish, parse, parser, time_ms  # noqa: E402


def make(path: Path, n_tokens: int, n_clusters: int, n_layers: int, per_token: bool, copies: int) -> list[Path]:
    from kite.upcycle.codec import settings_for
    from kite.upcycle.format import StateWriter, blob_key

    rnd = random.Random(0)
    ranges: dict[int, list] = {c: [] for c in range(n_clusters)}
    t = 0
    while t < n_tokens:
        e = t + 1 if per_token else min(n_tokens, t + rnd.randint(32, 128))
        ranges[rnd.randrange(n_clusters)].append([t, e])
        t = e
    w = StateWriter(register=False)
    items = []
    for layer in range(n_layers):
        items.append((blob_key(None, layer), os.urandom(64)))
        for c in range(n_clusters):
            items += [(blob_key(c, layer, "K"), os.urandom(32)), (blob_key(c, layer, "V"), os.urandom(32))]
    w.add_many(items, threads=1)
    fp = "kite-fp1:" + "ab" * 32
    meta = {"format": "kite-upc", "fingerprints": {"model": fp, "tokenizer": fp, "adapter": None, "combined": fp},
            "model": {"spec": "synthetic", "geometry": {
                "architecture": "LlamaForCausalLM", "model_type": "llama", "n_layers": n_layers, "n_heads": 9,
                "n_kv_heads": 3, "head_dim": 64, "hidden_size": 576, "vocab_size": 49152,
                "context_length": 32768, "rope": {"rope_theta": 100000.0, "rope_type": "default"}}},
            "n_tokens": n_tokens, "codec": settings_for(4).to_json(),
            "clusters": [{"id": c, "label": f"label-{c}", "confidence": 0.5, "token_ranges": r,
                          "n_tokens": sum(e - s for s, e in r), "preview": "x" * 120} for c, r in ranges.items()],
            "raw_kv_bytes_fp16": 2 * n_layers * 3 * 64 * 2 * n_tokens}
    paths = []
    for i in range(copies):
        meta["model"]["spec"] = f"synthetic-{i}"
        paths.append(path.with_name(f"{path.stem}-{i}.upc"))
        w.write(paths[-1], meta)
    return paths


def main(argv=None) -> int:
    ap = parser(__doc__, timing=True, repeat=40, warmup=0, device="cpu")
    args = parse(ap, argv)
    os.environ.setdefault("KITE_VERIFY_RECORD", "0")
    from kite.upcycle.format import StateFile

    cases = [("2K tokens, 8 clusters (SmolLM2 demo size)", 2048, 8, False),
             ("8K tokens, 16 clusters", 8192, 16, False),
             ("32K tokens, 64 clusters", 32768, 64, False),
             ("32K tokens, 64 clusters, a range per token", 32768, 64, True)]
    res = Result("state_open", device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        for name, tokens, clusters, per_token in cases:
            paths = make(Path(tmp) / "s.upc", tokens, clusters, 30, per_token, args.repeat)
            data = paths[0].read_bytes()
            (hlen,) = struct.unpack("<I", data[12:16])
            raw = data[32:32 + hlen]
            size = {"header_kb": round(hlen / 1e3, 1), "blobs": 30 * (1 + 2 * clusters),
                    "floor": f"the header ({hlen / 1e3:.4g} kB) read once {cpu_mem_text()}",
                    "floor_value": cpu_bytes_ms(hlen)}
            res.timing(f"{name}: header JSON parse", time_ms(lambda: json.loads(raw), args.repeat, args.warmup),
                       **size)
            todo = list(paths)
            first = time_ms(lambda: StateFile(todo.pop()).close(), args.repeat, 0)    # every call a new header
            res.timing(f"{name}: repeat open", time_ms(lambda: StateFile(paths[0]).close(), args.repeat, args.warmup),
                       **size)
            res.timing(f"{name}: first open (checked)", first, baseline=f"{name}: repeat open", **size)
            for p in paths:
                p.unlink()
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
