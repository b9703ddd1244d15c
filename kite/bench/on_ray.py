"""`kite bench run --ray`: the cases spread over a Ray cluster's workers, one result as from one process.

The cases are split by contract record (every question of a record, so every case of a document, in
one shard, in the order a local run takes them: the fused pipeline's health records are per state,
so each document's decisions see the same history as locally). Each shard is one Ray task running
:func:`kite.bench.runner.run_bench` on its cases; the rows come back and are merged in the cases'
order, and the summary, thresholds and targets are computed from them as a local run computes them.
Timings differ from a local run (other processes share the machine); answers, F1, PPL and the
fused pipeline's decisions do not.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from kite.errors import BadInput


def shard_records(s, workers: int) -> tuple[list[str], list[str]]:
    """The cases' ids in run order, and one JSONL text per shard (records round-robin, each keeping
    only the questions the run takes, with their ids spelled out so case ids do not change)."""
    from kite.bench.cases import load_cases
    from kite.data.jsonl import read_cases

    cases = load_cases(s.cases, s.families, s.per_family)[: s.max_cases]
    wanted = {c.id for c in cases}
    shards: list[list[dict]] = [[] for _ in range(workers)]
    n = 0
    for rec in read_cases(s.cases):
        rec = {k: v for k, v in rec.items() if k != "_line"}
        kept = []
        for k, q in enumerate(rec.get("questions") or []):
            qid = q.get("id", f"q{k}")
            if f"{rec['id']}/{qid}" in wanted:
                kept.append({**q, "id": qid})
        if kept:
            shards[n % workers].append({**rec, "questions": kept})
            n += 1
    texts = ["".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs) for recs in shards if recs]
    return [c.id for c in cases], texts


def _run_shard(settings: dict, cases_text: str, threads: int | None) -> dict:
    """One shard, on a Ray worker: its cases in a file of its own, then run_bench."""
    import tempfile

    from kite.bench.runner import BenchSettings, run_bench

    if threads:
        import torch

        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="kite-bench-shard-") as tmp:
        cases = Path(tmp) / "cases.jsonl"
        cases.write_text(cases_text, encoding="utf-8")
        s = BenchSettings(**{**settings, "cases": str(cases), "output": str(Path(tmp) / "result.json"),
                             "families": None, "per_family": None, "max_cases": None})
        return run_bench(s)


def run_bench_ray(s, *, workers: int | None = None, address: str | None = None, threads: int | None = 1,
                  progress=None) -> dict:
    """`run_bench(s)` spread over Ray: `workers` tasks at once (default: the cluster's CPUs)."""
    import ray

    from kite.bench import report
    from kite.bench.runner import write_result
    from kite.bench.thresholds import device_class, evaluate, load_thresholds
    from kite.ray_session import connect

    if s.concurrency:
        raise BadInput("--concurrency measures one server's batching: not with --ray")
    thresholds, th_source = load_thresholds(s.thresholds, device_class(s.device))   # bad input fails before Ray starts
    started = connect(address)
    t0 = time.perf_counter()
    try:
        n = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        order, texts = shard_records(s, n)
        task = ray.remote(num_cpus=1)(_run_shard)
        settings = asdict(s)
        refs = [task.remote(settings, text, threads) for text in texts]
        if progress:
            progress("shards", 0, len(refs))
        parts, pending = [], list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            parts.append(ray.get(ready[0]))
            if progress:
                progress("shards", len(parts), len(refs))
    finally:
        if started:
            ray.shutdown()
    rows = {row["id"]: row for part in parts for row in part["cases"]}
    cases = [rows[i] for i in order if i in rows]
    names = parts[0]["methods"]
    summary = report.summarize(cases, names) if cases else {}
    figures = dict(summary.get("fused", {}))
    if cases:
        figures["memory_peak_gb"] = max(r["memory_peak_gb"] for r in cases)
    errors = [p["error"] for p in parts if p.get("error")]
    result = {**parts[0], "cases": cases, "cases_total": len(order), "summary": summary,
              "notes": sorted({n for p in parts for n in p["notes"]}),
              "config": {**parts[0]["config"], **asdict(s)},
              "thresholds": evaluate(thresholds, figures), "thresholds_source": th_source,
              "targets": report.targets(summary) if cases else [],
              "error": "; ".join(errors) or None, "complete": not errors and len(cases) == len(order),
              "wall_s": round(time.perf_counter() - t0, 1),
              "ray": {"workers": n, "shards": len(parts), "cases_per_shard": [len(p["cases"]) for p in parts],
                      "shard_wall_s": [p.get("wall_s") for p in parts]}}
    result["passed"] = bool(cases) and result["error"] is None and all(t["pass"] for t in result["thresholds"])
    write_result(s.output, result)
    return result
