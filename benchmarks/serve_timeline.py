"""Where a burst's time goes in `kite serve`: the serve_concurrency burst, one line per request.

Starts `kite serve --max-batch N` on the embedded model (as benchmarks/serve_concurrency.py does),
uploads the contract, and lets 8 clients each stream two completions; prints per request its client,
send time, first token and end (seconds from the burst's start), tokens, whether it named a state,
and the server's own `kite` timings (wait for the model, YOCO's signals, load, generate, gain, ms);
then the batch's steps from the server's /metrics (`kite_batch_step_seconds`): per row count, how many
steps and their mean wall time, and the time all steps took against the burst's wall.

    .venv/bin/python benchmarks/serve_timeline.py --max-batch 8

Rows: the burst's wall, the time its batch steps took (the wall the baseline: the share of the burst
the model worked) and each row count's mean step; every request's line under ``raw``. A step of n
rows has as its floor the larger of the weights read once at this CPU's measured memory bandwidth
and 2 x parameters x n FLOPs at its measured fp32 rate (harness.floors.cpu_forward_floor; the KV
left out: the server does not say what each step read); the burst's and all steps', every step's.
"""

from __future__ import annotations

import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_concurrency as sc  # noqa: E402
from harness import Result, clock, finish, parse, parser  # noqa: E402
from harness.floors import cpu_forward_floor, model_shape  # noqa: E402


def server_ms(kite: dict) -> dict:
    """The server's own timings of a completion (ms) from its `kite` object."""
    return {"wait": kite.get("wait_ms"), **(kite.get("timings_ms") or {}), "ttft_gen": kite["generation"]["ttft_ms"]}


def step_times(metrics: str) -> dict:
    """Per row count, the batch's steps since the server started (warm-up included): count, total and
    mean wall time, from the Prometheus text of `kite_batch_step_seconds`."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name != "kite_batch_step_seconds":
            continue
        for sample in family.samples:
            rows = out.setdefault(sample.labels["rows"], {})
            if sample.name.endswith("_count"):
                rows["count"] = int(sample.value)
            elif sample.name.endswith("_sum"):
                rows["total_s"] = round(sample.value, 3)
    for rows in out.values():
        rows["mean_ms"] = round(rows["total_s"] / rows["count"] * 1e3, 1) if rows.get("count") else None
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = parse(ap, argv)
    res = Result("serve_timeline", device="cpu")
    requests = []
    bodies, contract = sc.burst_bodies(args.clients, 2, args.max_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = sc.start_server(args.max_batch, Path(tmp) / "states", 2, Path(tmp) / "serve.log")
        try:
            httpx.post(url + "/v1/states", json={"document": contract["text"], "id": "contract"},
                       timeout=600).raise_for_status()
            sc.stream(url, bodies[0])   # warm-up
            t0 = clock()

            def client(i):
                rows = []
                for body in bodies[i::args.clients]:
                    sent = clock() - t0
                    r = sc.stream(url, body)
                    rows.append({"client": i, "sent_s": round(sent, 2), "first_token_s": round(sent + r["ttft_s"], 2),
                                 "end_s": round(clock() - t0, 2), "tokens": r["tokens"],
                                 "state": "kite" in body, "server_ms": server_ms(r["kite"])})
                return rows

            with ThreadPoolExecutor(args.clients) as pool:
                for rows in pool.map(client, range(args.clients)):
                    for row in rows:
                        print(json.dumps(row), file=sys.stderr)
                        requests.append(row)
            wall = clock() - t0
            steps = step_times(httpx.get(url + "/metrics", timeout=30).text)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    shape = model_shape(None)
    step_floor = {n: cpu_forward_floor(shape, int(n), what=f"a step of {n} rows") for n in steps}
    all_steps = {"no_floor": "the server reported no batch steps"} if not steps else {
        "floor": f"its {sum(st.get('count') or 0 for st in steps.values())} steps' floors (the largest: "
                 f"{step_floor[max(steps, key=int)][0]})",
        "floor_value": sum((st.get("count") or 0) * step_floor[n][1] for n, st in steps.items()) / 1e3}
    res.row("burst wall", wall, "s", requests=len(requests), **all_steps)
    res.row("batch steps, all", sum(s["total_s"] for s in steps.values()), "s", baseline="burst wall", **all_steps)
    for n, st in steps.items():
        if st.get("mean_ms") is not None:
            res.row(f"batch step of {n} rows, mean", st["mean_ms"], "ms", steps=st["count"], floor=step_floor[n][0],
                    floor_value=step_floor[n][1])
    res.raw.update(requests=requests, steps=steps, max_batch=args.max_batch, clients=args.clients)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
