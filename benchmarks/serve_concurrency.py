"""`kite serve` under concurrent clients: continuous batching against one-at-a-time serving.

Starts `kite serve` twice on the embedded model (this CPU), `--max-batch N` and `--max-batch 1`,
uploads one generated contract as a state, then lets ``--clients`` clients each send
``--requests`` streamed greedy completions (alternately about the contract's state and plain
prompts of ~100 tokens), all at once, twice: the first burst after the server starts (the state is
loaded for the first time), then the same burst again (the server as it stays). Both servers
allocate their rows' KV at start for the longest request (``--batch-reserve-tokens``, as
serve_gpu.py does); ``--no-reserve`` leaves the buffers to grow during the first burst. Per server
and burst: aggregate completion tokens/s (all tokens over the wall time of the whole burst), each
request's time to first token as its client saw it (p50, p95), and every answer's text, which must
be the same on both servers and in both bursts.

    .venv/bin/python benchmarks/serve_concurrency.py

Rows: per burst, tokens/s and TTFT p50 / p95 of the batched server, the one-at-a-time server's the
baseline, and the burst's wall. Floors (this CPU's measured limits, harness.floors.cpu_forward_floor):
a TTFT's is the forward of the shortest prompt (its first token cannot come sooner); the burst's, its
decode steps': one at a time, a one-row step per completion token; batched, the completion tokens
over the batch's rows in steps of that many rows. Exit 1 when the answers differ.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kite.bench.concurrency import percentiles_ms  # noqa: E402
from kite.data.contracts import generate_contracts  # noqa: E402
from kite.ports import free_port  # noqa: E402
from harness import Result, clock, finish, parse, parser  # noqa: E402
from harness.floors import cpu_forward_floor, model_shape  # noqa: E402

RESERVE_MARGIN = 64   # slots past the longest request's own (a chat template's tokens, the tokenizer's count)

PROMPTS = [
    "The following is a short report about the shipping industry and the way ports handle containers. ",
    "Write a detailed description of a small mountain village, its people, their work and their food. ",
    "Explain how a bank decides whether to lend money to a small company and what it looks at. ",
    "Describe the history of the printing press and how it changed the way people shared knowledge. ",
]


def start_server(max_batch: int, state_dir: Path, threads: int, log: Path,
                 reserve_tokens: int | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "KITE_LOG_LEVEL": "warning"}
    cmd = [str(ROOT / ".venv/bin/kite"), "serve", "--port", str(port), "--max-batch", str(max_batch),
           "--state-dir", str(state_dir), "--fusion", "--log-level", "warning", "--mkdir",
           *(["--batch-reserve-tokens", str(reserve_tokens)] if reserve_tokens else [])]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    return proc, wait_until_serving(proc, f"http://127.0.0.1:{port}", log, 300)


def wait_until_serving(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> str:
    """`url` once the `kite serve` process answers /healthz; RuntimeError (with its log's tail)
    when it exits or does not answer within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kite serve exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("kite serve did not start")


def stream(url: str, body: dict) -> dict:
    """One streamed completion: its text, time to first token, tokens, total time, and the `kite`
    object of its last event (the server's own timings)."""
    t0 = clock()
    ttft = None
    text, usage, kite = [], None, None
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"])
            piece = ev["choices"][0]["text"]
            if piece and ttft is None:
                ttft = clock() - t0
            text.append(piece)
            usage, kite = ev.get("usage", usage), ev.get("kite", kite)
    return {"text": "".join(text), "ttft_s": ttft if ttft is not None else clock() - t0,
            "tokens": usage["completion_tokens"], "total_s": clock() - t0, "kite": kite}


def burst(url: str, bodies: list[dict], clients: int) -> dict:
    t0 = clock()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        # each client sends its requests one after another
        per_client = [bodies[i::clients] for i in range(clients)]
        futures = [pool.submit(lambda bs: [stream(url, b) for b in bs], bs) for bs in per_client]
        results = [f.result() for f in futures]
    wall = clock() - t0
    flat = [None] * len(bodies)
    for i, rs in enumerate(results):
        for j, r in enumerate(rs):
            flat[i + j * clients] = r
    tokens = sum(r["tokens"] for r in flat)
    ttft = percentiles_ms([r["ttft_s"] * 1e3 for r in flat])
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_ms": ttft["p50_ms"], "ttft_p95_ms": ttft["p95_ms"],
            "texts": [r["text"] for r in flat]}


def burst_bodies(clients: int, requests: int, max_tokens: int) -> tuple[list[dict], dict]:
    """The burst's request bodies (alternately about the contract's state and a plain prompt) and the
    contract."""
    contract = generate_contracts(1, tokens=900, seed=7)[0]
    bodies = []
    for i in range(clients * requests):
        if i % 2:
            q = contract["questions"][1 + i % 8]
            bodies.append({"prompt": f" Question: {q['question']}\nAnswer: {q['prompt']}", "max_tokens": max_tokens,
                           "kite": {"state": "contract"}})
        else:
            bodies.append({"prompt": PROMPTS[i % len(PROMPTS)] * 2, "max_tokens": max_tokens})
    return bodies, contract


def reserve_tokens(tokenizer, contract: dict, bodies: list[dict], max_tokens: int) -> int:
    """Slots every row's KV is allocated for at start (``--batch-reserve-tokens``): the longest request's
    (the state, the longest prompt, its answer), as a server set up for its traffic runs (serve_gpu.py
    reserves the same way)."""
    return (len(tokenizer(contract["text"], add_special_tokens=False)["input_ids"])
            + max(len(tokenizer(b["prompt"])["input_ids"]) for b in bodies) + max_tokens + RESERVE_MARGIN)


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2, help="per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-reserve", action="store_true",
                    help="start the servers without --batch-reserve-tokens: the first burst grows the batch's buffers")
    args = parse(ap, argv)
    bodies, contract = burst_bodies(args.clients, args.requests, args.max_tokens)
    shape = model_shape(None)
    reserve = None if args.no_reserve else reserve_tokens(shape.tokenizer, contract, bodies, args.max_tokens)
    runs: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for max_batch in (args.clients, 1):
            proc, url = start_server(max_batch, Path(tmp) / f"states{max_batch}", args.threads,
                                     Path(tmp) / f"serve{max_batch}.log", reserve)
            try:
                r = httpx.post(url + "/v1/states", json={"document": contract["text"], "id": "contract"}, timeout=600)
                r.raise_for_status()
                stream(url, bodies[0])   # warm-up
                # the first burst after start loads the state for the first time (and, with
                # --no-reserve, grows the batch's buffers); the second meets the server as it stays
                runs[max_batch] = [burst(url, bodies, args.clients) for _ in range(2)]
                for run in runs[max_batch]:
                    run["state_tokens"] = r.json()["tokens"]
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    texts = [run["texts"] for runs_ in runs.values() for run in runs_]
    same = all(t == texts[0] for t in texts)
    result = {
        "platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
        "model": "smollm2-135m (embedded)", "clients": args.clients, "requests": len(bodies),
        "max_tokens": args.max_tokens, "reserve_tokens": reserve,
        "identical_answers": same,
        "differing": sorted({i for t in texts for i, (a, b) in enumerate(zip(t, texts[0])) if a != b})}
    for n, burst_name in enumerate(("first", "second")):
        batched, single = runs[args.clients][n], runs[1][n]
        result[burst_name] = {"batched": {k: v for k, v in batched.items() if k != "texts"},
                              "one_at_a_time": {k: v for k, v in single.items() if k != "texts"},
                              "throughput_ratio": round(batched["tokens_per_s"] / single["tokens_per_s"], 2)}
    res = Result("serve_concurrency", device="cpu")
    shortest = min(len(shape.tokenizer(b["prompt"])["input_ids"]) for b in bodies)
    ttft_floor = cpu_forward_floor(shape, shortest, what=f"the shortest prompt's forward ({shortest} tokens)")
    for n, burst_name in enumerate(("", ", second burst")):
        for label, r in ((f"one at a time{burst_name}", runs[1][n]), (f"max batch {args.clients}{burst_name}",
                                                                     runs[args.clients][n])):
            alone = r is runs[1][n]
            base = f"one at a time{burst_name}"
            rows = 1 if alone else args.clients
            steps = -(-r["tokens"] // rows)
            step_text, step_ms = cpu_forward_floor(shape, rows, what=f"a step of {rows} row{'s' * (rows > 1)}")
            res.row(f"{label}: completion tokens/s", r["tokens_per_s"], "tokens/s",
                    baseline=None if alone else f"{base}: completion tokens/s", wall_s=r["wall_s"])
            res.row(f"{label}: burst wall", r["wall_s"], "s", baseline=None if alone else f"{base}: burst wall",
                    floor=f"{steps} decode steps ({r['tokens']} tokens / {rows} rows), each {step_text}",
                    floor_value=steps * step_ms / 1e3)
            for q in ("p50", "p95"):
                res.row(f"{label}: TTFT {q}", r[f"ttft_{q}_ms"], "ms",
                        baseline=None if alone else f"{base}: TTFT {q}", floor=ttft_floor[0],
                        floor_value=ttft_floor[1])
    res.raw.update(result)
    finish(res, args)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
