"""`kite bench run --concurrency N`: the cases' answers from their states, N clients at once.

N clients each send their next request as soon as the last one was answered (a closed loop, as
users of a chat service do), until the cases run out. The requests are served twice, side by side
in one run: decoded together by the continuous batch's engine (``kite.runtime.BatchDecoder`` with
N rows, requests joining as rows free up, in arrival order: what `kite serve --max-batch N` runs)
and one at a time (one row: the others wait). For each: aggregate new tokens per second over the
whole run, and each request's time to first token from the moment its client sent it (the wait for
a row included), p50 and p95. Greedy answers must be the same both ways.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import TYPE_CHECKING

from kite.runtime.batch_decode import BatchDecoder

if TYPE_CHECKING:
    from kite.model import LoadedModel


def percentiles_ms(values_ms: list[float]) -> dict[str, float]:
    """p50 and p95 (nearest rank) of times in ms, rounded to 0.1 ms."""
    v = sorted(values_ms)
    return {"p50_ms": round(statistics.median(v), 1), "p95_ms": round(v[min(len(v) - 1, int(0.95 * len(v)))], 1)}


def closed_loop(lm: LoadedModel, requests: list[tuple[list[int], object]], clients: int, rows: int,
                max_new_tokens: int) -> dict:
    """Serve ``requests`` ((prompt ids, KVPrefix or None), in order) to ``clients`` clients with a
    batch of ``rows``; the figures and every answer's text."""
    decoder = BatchDecoder(lm, rows)
    todo = deque(range(len(requests)))
    waiting: deque[int] = deque()
    sent: dict[int, float] = {}
    admitted: dict[int, float] = {}
    index_of: dict[int, int] = {}
    results: dict[int, object] = {}
    peak = 0
    t0 = time.perf_counter()
    for _ in range(min(clients, len(requests))):
        i = todo.popleft()
        sent[i] = t0
        waiting.append(i)
    while waiting or len(decoder):
        while waiting:
            ids, prefix = requests[waiting[0]]
            if not decoder.fits(len(ids), prefix, max_new_tokens):
                break
            i = waiting.popleft()
            index_of[decoder.add(ids, prefix=prefix, max_new_tokens=max_new_tokens)] = i
            admitted[i] = time.perf_counter()
        peak = max(peak, len(decoder))
        for handle, res in decoder.step().items():
            i = index_of.pop(handle)
            results[i] = res
            if todo:   # this client sends its next request now
                j = todo.popleft()
                sent[j] = time.perf_counter()
                waiting.append(j)
    wall = time.perf_counter() - t0
    tokens = sum(r.new_tokens for r in results.values())
    ttft = percentiles_ms([(admitted[i] - sent[i]) * 1e3 + results[i].ttft_ms for i in results])
    return {"rows": rows, "peak_rows": peak, "wall_s": round(wall, 3), "new_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
            "ttft_p50_ms": ttft["p50_ms"], "ttft_p95_ms": ttft["p95_ms"],
            "texts": [results[i].text for i in range(len(requests))]}


def measure(lm: LoadedModel, requests: list[tuple[list[int], object]], clients: int, max_new_tokens: int) -> dict:
    """Batched (``clients`` rows) against one at a time, same clients, same requests."""
    batched = closed_loop(lm, requests, clients, clients, max_new_tokens)
    single = closed_loop(lm, requests, clients, 1, max_new_tokens)
    differing = [i for i, (a, b) in enumerate(zip(batched["texts"], single["texts"])) if a != b]
    return {"clients": clients, "requests": len(requests), "max_new_tokens": max_new_tokens,
            "batched": {k: v for k, v in batched.items() if k != "texts"},
            "one_at_a_time": {k: v for k, v in single.items() if k != "texts"},
            "throughput_ratio": round(batched["tokens_per_s"] / single["tokens_per_s"], 3)
            if single["tokens_per_s"] else None,
            "identical_answers": not differing, "differing": differing}
