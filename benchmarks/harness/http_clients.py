"""Many streaming clients of a server for a serving benchmark, driven by several processes.

One Python event loop driving a hundred streamed completions through httpx is itself the bottleneck:
a first burst of that many requests on fresh connections takes it a large part of a second just to
send, and the clients' share of a round's TTFT grows with their number. So a round's clients are split over
processes (this file run as a script: it imports httpx, not torch), each with its own event loop and
its own connections, opened and used twice (GET /healthz) before the round's clock starts; they all
start on one signal, and every request is timed from its own send.

The parent (:class:`ClientProcesses`) writes each process one JSON line (the server's URL, its
clients and their bodies, the deadline on the host clock — time.perf_counter, CLOCK_MONOTONIC on
Linux, one clock for every process — and the read timeout), reads ``ready`` back, writes ``go``,
and reads one JSON line of records and the time the process's last client finished.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

clock = time.perf_counter


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed completion: status, send-to-first-text and the time of every text event (s from
    the send), completion tokens, the last event's `kite` object, or the error."""
    t0 = clock()
    rec: dict = {"status": "ok", "ttft_s": None, "times_s": [], "tokens": 0, "kite": None, "error": None}
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode("utf-8", "replace")
            rec.update(status=f"http {r.status_code}", error=text[:300])
            return rec
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                rec.update(status="error event", error=str(ev["error"])[:300])
                continue
            if ev.get("choices") and ev["choices"][0].get("text"):
                now = clock() - t0
                rec["times_s"].append(round(now, 5))
                if rec["ttft_s"] is None:
                    rec["ttft_s"] = now
            if "usage" in ev:
                rec["tokens"] = ev["usage"].get("completion_tokens", 0)
            if "kite" in ev:
                rec["kite"] = ev["kite"]
    rec["total_s"] = clock() - t0
    return rec


async def one_client(client: httpx.AsyncClient, url: str, ci: int, bodies: list[dict], deadline: float) -> list[dict]:
    """Client ``ci`` sends its bodies one after another (keys starting with ``_`` are not sent); past
    ``deadline`` nothing more is sent and what is in flight is cancelled."""
    recs = []
    for bi, body in enumerate(bodies):
        left = deadline - clock()
        base = {"client": ci, "nth": bi, "doc": body.get("_doc")}
        send = {k: v for k, v in body.items() if not k.startswith("_")}
        if left <= 0:
            recs.append({**base, "status": "not sent"})
            continue
        try:
            rec = await asyncio.wait_for(stream_one(client, url, send), timeout=left)
        except asyncio.TimeoutError:
            rec = {"status": "cut at deadline"}
        except httpx.HTTPError as exc:
            rec = {"status": "transport error", "error": f"{type(exc).__name__}: {exc}"[:300]}
        recs.append({**base, **rec})
    return recs


async def _drive(job: dict) -> dict:
    url, clients = job["url"], job["clients"]
    n = len(clients)
    limits = httpx.Limits(max_connections=n + 2, max_keepalive_connections=n + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(job["read_timeout_s"], connect=30.0), limits=limits) as client:
        for _ in range(2):      # open every client's connection, then use each once more, before the clock
            await asyncio.gather(*(client.get(url + "/healthz") for _ in range(n)))
        print("ready", flush=True)
        go = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        if go.strip() != "go":
            return {"records": [], "end": clock()}
        out = await asyncio.gather(*(one_client(client, url, ci, bodies, job["deadline"]) for ci, bodies in clients))
    return {"records": [r for rs in out for r in rs], "end": clock()}


class ClientProcesses:
    """``per_client`` (each client's bodies) driven by ``procs`` processes against ``url``: :meth:`start`
    (they connect and warm up), :meth:`go` (the round's clock starts: its value), :meth:`results`
    (every record, by client and send order, and the clock when the last client finished)."""

    def __init__(self, url: str, per_client: list[list[dict]], deadline: float, read_timeout_s: float, procs: int):
        self.jobs = [{"url": url, "deadline": deadline, "read_timeout_s": read_timeout_s,
                      "clients": [[ci, bodies] for ci, bodies in enumerate(per_client) if ci % procs == p]}
                     for p in range(max(1, min(procs, len(per_client))))]
        self.procs: list[subprocess.Popen] = []

    def start(self, timeout_s: float = 120.0) -> None:
        for job in self.jobs:
            p = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            p.stdin.write(json.dumps(job) + "\n")
            p.stdin.flush()
            self.procs.append(p)
        for p in self.procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                self.stop()
                raise RuntimeError(f"a client process did not start: {line.strip()[:300]!r}")

    def go(self) -> float:
        t0 = clock()
        for p in self.procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        return t0

    def results(self) -> tuple[list[dict], float]:
        recs, end = [], 0.0
        for p in self.procs:
            line = p.stdout.readline()
            p.wait(timeout=30)
            if not line:
                raise RuntimeError(f"a client process ended without its records (exit {p.returncode})")
            got = json.loads(line)
            recs.extend(got["records"])
            end = max(end, got["end"])
        recs.sort(key=lambda r: (r["client"], r["nth"]))
        return recs, end

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(_drive(json.loads(sys.stdin.readline())))), flush=True)
