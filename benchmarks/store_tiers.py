"""What a read from each tier of the state store costs: fetch + whole verification (container,
every blob's checksum, content address), against the fetch alone and the verification alone.

One real state: a synthetic contract (kite.data, ~2,000 tokens) compressed by the embedded model at
--ratio (the pipeline's default config, so the state records its content address). Each tier is
opened alone on this machine's loopback: host memory, a local folder (page cache warm after the
first read), Debian's redis-server and moto's S3 server, both started here on free ports with
tests/services.py and stopped after. Per tier: median of --repeats reads through a TieredStore
(a hit, verified), of the tier's own get, and MB/s of the verified read.

    .venv/bin/python benchmarks/store_tiers.py [--tokens 2000] [--ratio 4] [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import os

    from kite.data.contracts import generate_contract
    from kite.store import TieredStore, open_store, verify_state
    from kite.upcycle import open_pipeline
    from tests.services import RedisService, S3Service

    work = Path(tempfile.mkdtemp(prefix="kite-store-bench-"))
    pipe = open_pipeline("smollm2-135m", ratio=args.ratio)
    text = generate_contract(0, args.tokens, seed=0, count_tokens=lambda s: len(pipe.lm.tokenizer(s).input_ids))["text"]
    t = time.perf_counter()
    result = pipe.compress(text, work / "state.upc")
    compress_s = time.perf_counter() - t
    data = (work / "state.upc").read_bytes()
    verify_ms = _median_ms(lambda: verify_state(data, result.address), args.repeats)

    for key, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench")):
        os.environ.setdefault(key, value)
    redis = RedisService(work / "redis").start()
    s3 = S3Service().start()
    try:
        bucket = s3.bucket()
        urls = {"mem": "mem://", "file": f"file://{work}/disk", "redis": redis.url,
                "s3": f"s3://{bucket}/states?endpoint_url={s3.endpoint}"}
        rows = []
        for name, url in urls.items():
            tier = open_store(url).tiers[0]
            store = TieredStore([tier])
            store.put(data)
            got = _median_ms(lambda: store.get(result.address), args.repeats)
            raw = _median_ms(lambda: tier.get(result.address), args.repeats)
            rows.append({"tier": name, "get_verified_ms": round(got, 2), "tier_get_ms": round(raw, 2),
                         "MB_per_s": round(len(data) / 1e6 / (got / 1e3), 1)})
            store.close()
    finally:
        redis.stop()
        s3.stop()
    out = {"state_bytes": len(data), "n_tokens": result.n_tokens, "ratio": args.ratio,
           "compress_s": round(compress_s, 2), "verify_only_ms": round(verify_ms, 2), "repeats": args.repeats,
           "tiers": rows}
    print(json.dumps(out, indent=2))
    print(f"\nstate {len(data):,} B ({result.n_tokens} tokens, ratio {args.ratio:g}); verification alone "
          f"{verify_ms:.2f} ms ({len(data) / 1e6 / (verify_ms / 1e3):.0f} MB/s)")
    print("| tier | get + verify (ms) | tier get alone (ms) | MB/s verified |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['tier']} | {r['get_verified_ms']} | {r['tier_get_ms']} | {r['MB_per_s']} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
