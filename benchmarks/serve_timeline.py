"""Where a burst's time goes in `kite serve`: the serve_concurrency burst, one line per request.

Starts `kite serve --max-batch N` on the embedded model as benchmarks/serve_concurrency.py does (rows
reserved at start unless ``--no-reserve``), uploads the contract, warms up, and lets 8 clients each
stream two completions; prints per request its client, send time, first token and end (seconds from
the burst's start), tokens, whether it named a state, and the server's own `kite` timings (wait for
the model, YOCO's signals, load, generate, gain, ms). The batch's steps are read from the server's
/metrics (`kite_batch_step_seconds`) before and after the burst, so only the burst's count: per kind
(decode; a step that prefills newcomers, with or without decoding rows beside them) and row count,
how many steps and their mean wall time.

    .venv/bin/python benchmarks/serve_timeline.py --max-batch 8

Rows: the burst's wall; the time its decode steps took, and its prefilling steps, each with its share
of the wall (``share_of_wall``); the rest of the wall (what the batch's thread did between
steps -- YOCO's passes over the arrivals, loads, admission -- and any time it waited); each kind and
row count's mean step. A decode step of n rows has as its floor the larger of the weights read once
at this CPU's measured memory bandwidth and 2 x parameters x n FLOPs at its measured fp32 rate
(harness.floors.cpu_forward_floor; the KV left out: the server does not say what each step read).
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


def step_times(metrics: str) -> dict[tuple[str, int], dict]:
    """Per (kind, row count), the batch's steps since the server started: count and total wall time,
    from the Prometheus text of `kite_batch_step_seconds`."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, int], dict] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name != "kite_batch_step_seconds":
            continue
        for sample in family.samples:
            key = (sample.labels["kind"], int(sample.labels["rows"]))
            if sample.name.endswith("_count"):
                out.setdefault(key, {})["count"] = int(sample.value)
            elif sample.name.endswith("_sum"):
                out.setdefault(key, {})["total_s"] = sample.value
    return out


def steps_between(before: dict, after: dict) -> dict[tuple[str, int], dict]:
    """The steps of ``after`` that ``before`` did not count: per (kind, rows) count, total and mean."""
    out = {}
    for key, st in sorted(after.items()):
        prev = before.get(key, {})
        count = st.get("count", 0) - prev.get("count", 0)
        if count > 0:
            total = st.get("total_s", 0.0) - prev.get("total_s", 0.0)
            out[key] = {"count": count, "total_s": round(total, 3), "mean_ms": round(total / count * 1e3, 1)}
    return out


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-reserve", action="store_true",
                    help="start the server without --batch-reserve-tokens: the burst grows the batch's buffers")
    args = parse(ap, argv)
    res = Result("serve_timeline", device="cpu")
    requests = []
    bodies, contract = sc.burst_bodies(args.clients, 2, args.max_tokens)
    shape = model_shape(None)
    reserve = None if args.no_reserve else sc.reserve_tokens(shape.tokenizer, contract, bodies, args.max_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = sc.start_server(args.max_batch, Path(tmp) / "states", 2, Path(tmp) / "serve.log", reserve)
        try:
            httpx.post(url + "/v1/states", json={"document": contract["text"], "id": "contract"},
                       timeout=600).raise_for_status()
            sc.stream(url, bodies[0])   # warm-up
            before = step_times(httpx.get(url + "/metrics", timeout=30).text)
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
            steps = steps_between(before, step_times(httpx.get(url + "/metrics", timeout=30).text))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    decode = {rows: st for (kind, rows), st in steps.items() if kind == "decode"}
    floor = {rows: cpu_forward_floor(shape, rows, what=f"a step of {rows} row{'s' * (rows > 1)}") for rows in decode}
    decode_floor = {"no_floor": "the burst ran no decode steps"} if not decode else {
        "floor": f"its {sum(st['count'] for st in decode.values())} decode steps' floors (the largest: "
                 f"{floor[max(decode)][0]})",
        "floor_value": sum(st["count"] * floor[rows][1] for rows, st in decode.items()) / 1e3}
    res.row("burst wall", wall, "s", requests=len(requests), reserve_tokens=reserve)
    decode_s = sum(st["total_s"] for st in decode.values())
    prefill_s = sum(st["total_s"] for (kind, _), st in steps.items() if kind != "decode")
    rest_s = wall - decode_s - prefill_s
    res.row("decode steps", decode_s, "s", share_of_wall=round(decode_s / wall, 3), **decode_floor)
    res.row("steps that prefill newcomers", prefill_s, "s", share_of_wall=round(prefill_s / wall, 3))
    res.row("the rest: between steps (YOCO's passes, loads, admission) and idle", rest_s, "s",
            share_of_wall=round(rest_s / wall, 3))
    for (kind, rows), st in steps.items():
        extra = {"floor": floor[rows][0], "floor_value": floor[rows][1]} if kind == "decode" else {}
        res.row(f"{kind} step of {rows} row{'s' * (rows > 1)}, mean", st["mean_ms"], "ms", steps=st["count"], **extra)
    res.raw.update(requests=requests, steps={f"{kind}/{rows}": st for (kind, rows), st in steps.items()},
                   max_batch=args.max_batch, clients=args.clients, reserve_tokens=reserve)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
