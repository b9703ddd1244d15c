"""What a read from each tier of the state store costs: fetch + whole verification (container,
every blob's checksum, content address), against the fetch alone and the verification alone.

One real state: a synthetic contract (kite.data, ~2,000 tokens) compressed by the embedded model at
--ratio (the pipeline's default config, so the state records its content address). Each tier is
opened alone on this machine's loopback: host memory, a local folder (page cache warm after the
first read), Debian's redis-server and moto's S3 server, both started here on free ports with
kite.testing.services and stopped after. Per tier: median of --repeat reads through a TieredStore
(a hit, verified; baseline: the tier's own get) and of the tier's own get (baseline: the verification
alone); MB/s of the verified read beside it. Every read's floor is the state's bytes moved once at this
CPU's measured memory bandwidth (a loopback socket copies through memory too; its round trip is left
out); the verification's, the state's bytes read once for its checksums.

    .venv/bin/python benchmarks/store_tiers.py [--tokens 2000] [--ratio 4] [--repeat 20]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import Result, cpu_bytes_ms, cpu_mem_text, finish, parse, parser, time_ms, wall  # noqa: E402


def main(argv=None) -> int:
    ap = parser(__doc__, timing=True, repeat=20, warmup=1, device="cpu")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--ratio", type=float, default=4.0)
    args = parse(ap, argv)

    import os

    from kite.data.contracts import generate_contract
    from kite.store import TieredStore, open_store, verify_state
    from kite.upcycle import open_pipeline
    from kite.testing.services import RedisService, S3Service

    work = Path(tempfile.mkdtemp(prefix="kite-store-bench-"))
    pipe = open_pipeline("smollm2-135m", ratio=args.ratio)
    text = generate_contract(0, args.tokens, seed=0, count_tokens=lambda s: len(pipe.lm.tokenizer(s).input_ids))["text"]
    with wall() as took:
        result = pipe.compress(text, work / "state.upc")
    data = (work / "state.upc").read_bytes()
    res = Result("store_tiers", device="cpu")
    floor = {"floor": f"the state ({len(data) / 1e6:.3g} MB) read once {cpu_mem_text()}",
             "floor_value": cpu_bytes_ms(len(data))}
    verify = res.timing("verification alone", time_ms(lambda: verify_state(data, result.address), args.repeat,
                                                      args.warmup), **floor)

    for key, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench")):
        os.environ.setdefault(key, value)
    redis = RedisService(work / "redis").start()
    s3 = S3Service().start()
    try:
        bucket = s3.bucket()
        urls = {"mem": "mem://", "file": f"file://{work}/disk", "redis": redis.url,
                "s3": f"s3://{bucket}/states?endpoint_url={s3.endpoint}"}
        for name, url in urls.items():
            tier = open_store(url).tiers[0]
            store = TieredStore([tier])
            store.put(data)
            raw = res.timing(f"{name}: tier get alone", time_ms(lambda: tier.get(result.address), args.repeat,
                                                               args.warmup), baseline=verify["name"], **floor)
            got = res.timing(f"{name}: get + verify", time_ms(lambda: store.get(result.address), args.repeat,
                                                              args.warmup), baseline=raw["name"], **floor)
            res.row(f"{name}: verified read", len(data) / 1e6 / (got["value"] / 1e3), "MB/s")
            store.close()
    finally:
        redis.stop()
        s3.stop()
    res.raw.update(state_bytes=len(data), n_tokens=result.n_tokens, ratio=args.ratio, compress_s=round(took.s, 2),
                   verify_mb_per_s=round(len(data) / 1e6 / (verify["value"] / 1e3), 1))
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
