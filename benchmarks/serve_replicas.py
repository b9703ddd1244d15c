"""`kite serve --replicas N` on this machine: requests/s and prefix-cache hit rate for 1, 2 and 4
replicas on Ray Serve (embedded model, CPU), against one plain `kite serve`, and Ray's overhead
per request.

A stream of greedy completions over `--states` generated contracts with Zipf popularity (s = 1),
`--clients` clients at once, each request naming its contract's state. Every server has the same
prefix cache per replica (`--prefix-cache-gb`; a state's loaded KV is what a hit reuses), so more
replicas also means more memory in all. Measured per setup: requests/s over the whole burst, the
hit rate (the fraction of requests whose load came from the prefix cache: `kite.load.timings_ms`
has `cached`), the share of requests the busiest replica took (header x-kite-replica), and the mean
latency of sequential requests (one client) for the overhead: Ray's 1 replica minus the plain
server, same requests; and the routing alone (GET /v1/models through the endpoint against the
replica's own URL, no model work). Every answer is checked against the plain server's.

    .venv/bin/python benchmarks/serve_replicas.py

Rows: requests/s of each Ray setup, the plain server's the baseline; the sequential latency of Ray's
one replica and the routing alone against the replica's own URL. A sequential request's floor is its
--max-tokens one-row decode steps (each the larger of the weights read once at this CPU's measured
memory bandwidth and 2 x parameters FLOPs at its measured fp32 rate; harness.floors); the routing
rows are loopback round trips with no model work: no hardware floor.
"""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kite.data.contracts import generate_contracts  # noqa: E402
from kite.ports import quiet_port  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import Result, clock, finish, parse, parser, time_ms  # noqa: E402
from harness.floors import cpu_forward_floor, model_shape  # noqa: E402
from serve_concurrency import wait_until_serving  # noqa: E402

UPCYCLE = "compression: {cluster_num: 4}\nsemantic_tagging: {labels: [], generated_examples_per_label: 0}\n"
QUESTIONS = [" The governing law of this agreement is", " The payment is due within", " Either party may terminate",
             " The supplier shall deliver"]


def env_for(args) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "KITE_FEATURES__YOCO_MIN_HIT_GAIN": "0",
            "KITE_FEATURES__UPCYCLE_YOCO_FUSION": "true", "KITE_SERVER__PREFIX_CACHE_GB": str(args.prefix_cache_gb)}


def start_plain(args, state_dir: Path, cfg: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = quiet_port()
    cmd = [str(ROOT / ".venv/bin/kite"), "serve", "--port", str(port), "--state-dir", str(state_dir),
           "--upcycle-config", str(cfg), "--log-level", "warning", "--mkdir"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env_for(args), cwd=ROOT)
    return proc, wait_until_serving(proc, f"http://127.0.0.1:{port}", log, 600)


def start_ray(args, n: int, state_dir: Path, cfg: Path):
    """`kite serve --replicas n` as the CLI runs it, in this process (the replicas are Ray's processes)."""
    from kite.config import load_config
    from kite.serve import ServeSettings
    from kite.serve.replicas import start
    from kite.serve.scale import ReplicaSpec, ScaleSettings
    from kite.upcycle import load_upcycle_config

    os.environ.update({k: v for k, v in env_for(args).items() if k.startswith("KITE_")})
    kcfg = load_config()
    settings = ServeSettings.from_config(kcfg)
    settings.state_dir = state_dir.resolve()
    settings.rules_path = settings.rules_path.resolve()
    ucfg, cfg_path = load_upcycle_config(cfg)
    spec = ReplicaSpec(kcfg.model.default, settings, str(cfg_path.resolve()), tagger=True)
    return start(spec, ScaleSettings.from_config(kcfg, replicas=n), port=quiet_port(), num_cpus=2, timeout_s=900)


def complete(url: str, sid: str, q: str, max_tokens: int) -> dict:
    t0 = clock()
    with httpx.Client(timeout=900) as c:
        r = c.post(url + "/v1/completions", json={"prompt": q, "max_tokens": max_tokens, "kite": {"state": sid}})
    r.raise_for_status()
    body = r.json()
    load = body["kite"].get("load") or {}
    return {"text": body["choices"][0]["text"], "ms": (clock() - t0) * 1e3,
            "hit": "cached" in (load.get("timings_ms") or {}), "loaded": bool(body["kite"].get("loaded")),
            "replica": r.headers.get("x-kite-replica", "plain")}


def burst(url: str, jobs: list[tuple[str, str]], clients: int, max_tokens: int) -> dict:
    t0 = clock()
    with ThreadPoolExecutor(clients) as pool:
        out = list(pool.map(lambda j: complete(url, j[0], j[1], max_tokens), jobs))
    wall = clock() - t0
    per = {}
    for o in out:
        per[o["replica"]] = per.get(o["replica"], 0) + 1
    return {"requests": len(out), "wall_s": round(wall, 2), "requests_per_s": round(len(out) / wall, 3),
            "hit_rate": round(sum(o["hit"] for o in out) / len(out), 3),
            "loaded_rate": round(sum(o["loaded"] for o in out) / len(out), 3),
            "busiest_replica_share": round(max(per.values()) / len(out), 3), "per_replica": per,
            "texts": [o["text"] for o in out]}


def sequential_ms(url: str, jobs: list[tuple[str, str]], max_tokens: int) -> float:
    times = [complete(url, sid, q, max_tokens)["ms"] for sid, q in jobs]
    return round(sum(times) / len(times), 1)


def routing_ms(url: str, n: int = 30) -> dict:
    """The endpoint's own cost, no model work: GET /v1/models through the endpoint (Ray's proxy, the
    ingress, the router, the replica's forward) against the same route at the replica's own URL."""
    direct = httpx.get(url + "/v1/replicas", timeout=30).json()["data"][0]["url"]
    out = {}
    for name, base in (("endpoint", url), ("replica_direct", direct)):
        with httpx.Client(base_url=base, timeout=30) as c:
            out[name] = round(time_ms(lambda: c.get("/v1/models").raise_for_status(), n, 1).median_ms, 2)
    out["overhead"] = round(out["endpoint"] - out["replica_direct"], 2)
    return out


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--replicas", default="1,2,4")
    ap.add_argument("--states", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=300, help="tokens per contract")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prefix-cache-gb", type=float, default=0.15, help="per replica")
    args = parse(ap, argv)

    tmp = Path(tempfile.mkdtemp(prefix="kite-replicas-bench-"))
    state_dir, cfg = tmp / "states", tmp / "upcycle.yaml"
    cfg.write_text(UPCYCLE)
    docs = [r["text"] for r in generate_contracts(args.states, args.tokens, seed=7)]
    rng = random.Random(0)
    weights = [1 / (i + 1) for i in range(args.states)]
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "note": "2 shared CPU cores: replicas compete for them (torch 1 thread each)"},
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "setups": {}}

    proc, url = start_plain(args, state_dir, cfg, tmp / "plain.log")
    try:
        sids = [httpx.post(url + "/v1/states", json={"document": d}, timeout=900).json()["id"] for d in docs]
        picks = rng.choices(range(args.states), weights=weights, k=args.requests)
        jobs = [(sids[i], QUESTIONS[k % len(QUESTIONS)]) for k, i in enumerate(picks)]
        seq = jobs[:8]
        result["setups"]["plain"] = {**burst(url, jobs, args.clients, args.max_tokens),
                                     "sequential_mean_ms": sequential_ms(url, seq, args.max_tokens)}
    finally:
        proc.terminate()
        proc.wait(30)
    want = result["setups"]["plain"]["texts"]
    print(json.dumps({k: v for k, v in result["setups"]["plain"].items() if k != "texts"}), file=sys.stderr,
          flush=True)

    from kite.serve.replicas import stop

    for n in [int(x) for x in args.replicas.split(",")]:
        cluster = start_ray(args, n, state_dir, cfg)
        try:
            time.sleep(2)
            seq_ms = sequential_ms(cluster.url, seq, args.max_tokens) if n == 1 else None
            hop = routing_ms(cluster.url) if n == 1 else None
            b = burst(cluster.url, jobs, args.clients, args.max_tokens)
            b["answers_match_plain"] = b["texts"] == want
            if seq_ms is not None:
                b["sequential_mean_ms"] = seq_ms
                b["routing_only_ms"] = hop
            result["setups"][f"ray_{n}"] = b
            print(json.dumps({f"ray_{n}": {k: v for k, v in b.items() if k != "texts"}}), file=sys.stderr,
                  flush=True)
        finally:
            stop(cluster)
    plain, one = result["setups"]["plain"], result["setups"].get("ray_1")
    if one:
        # end to end on this machine: the hops plus Ray's own processes competing for the 2 cores
        result["ray_overhead_ms_per_request"] = round(one["sequential_mean_ms"] - plain["sequential_mean_ms"], 1)
        result["ray_routing_only_ms_per_request"] = one["routing_only_ms"]["overhead"]
    for s in result["setups"].values():
        s.pop("texts", None)
    res = Result("serve_replicas", device="cpu")
    res.row("plain kite serve: requests/s", plain["requests_per_s"], "requests/s", hit_rate=plain["hit_rate"])
    for name, b in result["setups"].items():
        if name != "plain":
            res.row(f"{name.replace('_', ' ')} replicas: requests/s", b["requests_per_s"], "requests/s",
                    baseline="plain kite serve: requests/s", hit_rate=b["hit_rate"],
                    busiest_replica_share=b["busiest_replica_share"], answers_match_plain=b["answers_match_plain"])
    if one:
        text, step_ms = cpu_forward_floor(model_shape(None), 1, what="a one-row step")
        request = {"floor": f"{args.max_tokens} decode steps, each {text}", "floor_value": args.max_tokens * step_ms}
        loopback = "a loopback HTTP round trip, no model work: no hardware bound"
        res.row("plain kite serve: sequential request", plain["sequential_mean_ms"], "ms", **request)
        res.row("ray 1 replica: sequential request", one["sequential_mean_ms"], "ms",
                baseline="plain kite serve: sequential request", **request)
        res.row("routing only, replica's own URL: GET /v1/models", one["routing_only_ms"]["replica_direct"], "ms",
                no_floor=loopback)
        res.row("routing only, through the endpoint: GET /v1/models", one["routing_only_ms"]["endpoint"], "ms",
                baseline="routing only, replica's own URL: GET /v1/models", no_floor=loopback)
    res.raw.update(result)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
