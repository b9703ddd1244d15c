"""`kite serve` on a GPU through HTTP: concurrent clients asking about long documents, with and without KITE.

    make build-runtime; python benchmarks/serve_gpu.py  # H200: Qwen2-7B geometry, 8 x 16K-token documents
    python benchmarks/serve_gpu.py --docs 64 --clients 1,8,32,64 --budget-s 480
    python benchmarks/serve_gpu.py --cpu-smoke          # the tiny geometry on the CPU: the script runs

Writes a random-weight Qwen2-7B HF folder (bf16; benchmarks/harness/models.py, the geometry of
gpu_speed.py) with a tokenizer written beside it (no hub download: a small byte-level BPE learnt
on generated contracts plus ``<tN>`` tokens up to the vocabulary; a document is T random ``<tN>``,
exactly T tokens) to a temporary folder. Then, for each mode, it
starts `kite serve` on it in a subprocess (127.0.0.1, a free port, /healthz polled until it answers,
stopped after) and lets C clients (asyncio + httpx, streamed /v1/completions, greedy; driven by
processes of up to 16 clients each, their connections opened before the clock starts:
harness/http_clients.py) each ask new questions (16 random tokens) about one of the documents, for
every C of --clients:

* ``none``: no KITE: the document is inside the prompt, so every request prefills it (raw KV, no
  --kv-budget-tokens); its server takes --none-max-batch rows at once (default --max-batch, within
  --batch-kv-gb), the other requests wait in its queue (counted).
* ``raw``: the documents uploaded once as states (POST /v1/states: the server upcycles them), each
  request names one (``kite.state``); `kite serve --fusion --resident raw`.
* ``lanes``: the same states, `--resident lanes` (coded again into nibble lanes at load); a GPU
  only, skipped with its reason on a CPU.

The state servers run a rule file of one rule (load every cluster: YOCO's decision is still made, its
plan is always the whole state) with features.yoco_min_hit_gain 0, and each request names its own
alias of its document's state (a symlink in the state folder): random weights measure gains near or
below 0, which the health store, keyed by state id, would soon answer by skipping the load; the
prefix cache keys on the file, so the aliases of a document share one hot entry. A request answered
without its state is counted. Their prefix cache holds
every document (--prefix-cache-gb), and every document is asked about once before the rounds, so a
round's loads come from the hot tier.

Rows per mode and C (x baseline: over ``none`` at the same C): completion tokens/s of all clients
over the round's wall time; TTFT p50 and p99 as the clients saw them (send to first text; ``none``'s p50
against its document's prefill at the GPU's bf16 rate, the least a request without KITE waits); the
decode step the server reports (kite_batch_step_seconds{kind="decode"} at the round's most frequent
row count: its mean; steps with newcomers' prefills are counted apart) against its byte floor (weights + each row's KV, or lanes and
own slots, read once at the GPU's HBM bandwidth) and the decode tokens/s it gives (rows / step; lanes'
against raw's largest batch, the round whose steps ran the most raw rows; lanes' completion tokens/s
against that round's too), beside the client's inter-token p50; GPU memory
(torch.cuda.max_memory_allocated in the server since it started, uploads included: /healthz's
watermark has no per-round peak; beside it the device's used memory through NVML, the most seen
during the round, when the server has pynvml); requests refused (an HTTP error or
an error event), cut at the deadline or never sent, and the longest queue the server's
kite_batch_queue_length showed. Every request's record (its token times, the response's ``kite`` object) is
attached beside the result file (``<result>.records.json.gz``; ``kite.bench.results.load_attached``).

Bounded: --budget-s for the whole run, the model's writing included (the modes run in the order raw,
lanes, none, each with an equal share of what is left when it starts, so what one leaves goes to the
next; a mode whose setup took its whole share gets an equal part, with the modes after it, of what
is left for its rounds; a round past its mode's deadline sends nothing more and cancels what is in flight), every
request a read timeout. Random weights say nothing about answers, only about speed.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import Result, bytes_ms, clock, finish, parse, parser  # noqa: E402
from harness.floors import bf16_text, flops_ms, hbm_text  # noqa: E402
from harness.http_clients import ClientProcesses, stream_one  # noqa: E402
from harness.models import random_words, write_random_qwen2  # noqa: E402

MODES = ("none", "raw", "lanes")
RUN_ORDER = ("raw", "lanes", "none")   # none, whose every request prefills its document, last: it gets what is left
QUESTION_WORDS = 16
CLIENTS_A_PROCESS = 16      # clients one client process drives (harness.http_clients)
RESERVE_QUESTION = 192      # slots a row reserves for its question (the chat template's tokens included)
RULES = """version: bench
rules:
  - name: whole_state
    condition: true
    action:
      load_all_clusters: true
"""


def log(msg: str, t0: float) -> None:
    print(f"[{clock() - t0:7.1f} s] {msg}", flush=True)


# -- the server ---------------------------------------------------------------------------------
class Server:
    """`kite serve` in a subprocess for one mode; :meth:`start` returns once /healthz answers."""

    def __init__(self, mode: str, model: Path, work: Path, max_batch: int, prefix_cache_gb: float,
                 lane_bits: str | None, threads: int | None, batch_kv_gb: float | None = None,
                 reserve_tokens: int | None = None):
        self.mode, self.work = mode, work
        self.home = work / f"home-{mode}"            # its own config, health store
        self.home.mkdir(parents=True, exist_ok=True)
        self.states = work / "states"                 # shared: the lanes server finds the raw server's uploads
        self.states.mkdir(exist_ok=True)
        self.rules = work / "rules.yaml"
        self.rules.write_text(RULES, encoding="utf-8")
        self.log_path = work / f"serve-{mode}.log"
        from kite.ports import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-c", "from kite.cli.main import main; main()", "serve", "--model", str(model),
                    "--host", "127.0.0.1", "--port", str(self.port), "--state-dir", str(self.states),
                    "--rules", str(self.rules), "--max-batch", str(max_batch), "--log-level", "warning", "--mkdir",
                    *(["--batch-kv-gb", f"{batch_kv_gb:g}"] if batch_kv_gb else []),
                    *(["--batch-reserve-tokens", str(reserve_tokens)] if reserve_tokens else []),
                    *(["--no-fusion"] if mode == "none" else ["--fusion", "--resident", mode]),
                    *(["--lane-bits", lane_bits] if mode == "lanes" and lane_bits else [])]
        self.env = {**os.environ, "KITE_HOME": str(self.home), "KITE_CACHE": str(work / "cache"),
                    "KITE_SERVER__PREFIX_CACHE_GB": f"{prefix_cache_gb:g}", "KITE_FEATURES__YOCO_MIN_HIT_GAIN": "0",
                    "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
                    "PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> None:
        with open(self.log_path, "w", encoding="utf-8") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        deadline = clock() + timeout_s
        try:
            while clock() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kite serve ({self.mode}) exited {self.proc.returncode}: {self.tail()}")
                try:
                    if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            raise RuntimeError(f"kite serve ({self.mode}) did not answer /healthz within {timeout_s:.0f} s: "
                               f"{self.tail()}")
        except BaseException:
            self.stop()
            raise

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def health(self) -> dict:
        return httpx.get(self.url + "/healthz", timeout=10).json()


def alias_states(folder: Path, per_client: list[list[dict]], state_ids: list[str]) -> None:
    """Give each request's state id (``<state>.<tag>``) as a symlink to its document's state in the
    server's state folder: the health store, keyed by state id, then holds no gain measured by an
    earlier request, while the prefix cache, keyed by the file (its real path and stat), serves every
    alias of a document from one hot entry."""
    for bodies in per_client:
        for b in bodies:
            alias = folder / f"{b['kite']['state']}.upc"
            if not alias.exists():
                alias.symlink_to(f"{state_ids[b['_doc']]}.upc")


# -- the clients --------------------------------------------------------------------------------
async def sample_server(url: str, out: dict, every_s: float = 0.5) -> None:
    """Until cancelled: the longest batch queue, the most device memory NVML saw, the server's torch
    peak, from /metrics and /healthz."""
    from kite.serve.scrape import parse_metrics

    async with httpx.AsyncClient(timeout=5) as c:
        while True:
            try:
                m = parse_metrics((await c.get(url + "/metrics")).text)
                q = m.value("kite_batch_queue_length")
                if q is not None:
                    out["max_queue"] = max(out.get("max_queue", 0), int(q))
                wm = (await c.get(url + "/healthz")).json().get("watermark") or {}
                out["memory_source"] = wm.get("source")
                used = (wm.get("watermark") or {}).get("gpu_mem_gb")
                if used is not None and str(wm.get("source", "")).startswith("nvml"):
                    out["max_device_used_gb"] = max(out.get("max_device_used_gb", 0.0), float(used))
                if wm.get("torch_peak_gb") is not None:
                    out["torch_peak_gb"] = float(wm["torch_peak_gb"])
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await asyncio.sleep(every_s)


async def run_round(url: str, per_client: list[list[dict]], deadline: float, read_timeout_s: float,
                    procs: int) -> tuple[list, dict, float]:
    """Every client sends its bodies one after another, the clients driven by ``procs`` processes
    (harness.http_clients: each warms its connections before the clock starts); (every record, by
    client and send order, what the sampler saw, wall s from the start signal to the last client's end).
    Past ``deadline`` nothing more is sent and what is in flight is cancelled."""
    seen: dict = {}
    loop = asyncio.get_running_loop()
    clients = ClientProcesses(url, per_client, deadline, read_timeout_s, procs)
    try:
        await loop.run_in_executor(None, clients.start)
        sampler = asyncio.create_task(sample_server(url, seen))
        try:
            t0 = clients.go()
            recs, end = await loop.run_in_executor(None, clients.results)
        finally:
            sampler.cancel()
            try:
                await sampler
            except asyncio.CancelledError:
                pass
    finally:
        clients.stop()
    return recs, seen, max(0.0, end - t0)


def client_processes(clients: int) -> int:
    """Processes that drive ``clients`` clients: one per CLIENTS_A_PROCESS, at most half the cores."""
    return max(1, min(max(1, (os.cpu_count() or 2) // 2), math.ceil(clients / CLIENTS_A_PROCESS)))


# -- figures ------------------------------------------------------------------------------------
def quantile(v: list[float], q: float) -> float:
    s = sorted(v)
    at = q * (len(s) - 1)
    lo = int(at)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


def step_histogram(before, after) -> dict[str, dict]:
    """kite_batch_step_seconds between two scrapes, by its ``rows`` and ``kind`` labels:
    {"<rows> <kind>": {rows, kind, steps, mean_ms}} (kind: prefill, decode or mixed)."""
    out = {}
    for labels, count in after.samples.get("kite_batch_step_seconds_count", {}).items():
        got = dict(labels)
        prev = before.samples.get("kite_batch_step_seconds_count", {}).get(labels, 0.0)
        s = after.samples["kite_batch_step_seconds_sum"].get(labels, 0.0) - \
            before.samples.get("kite_batch_step_seconds_sum", {}).get(labels, 0.0)
        if count - prev > 0:
            out[f"{got.get('rows')} {got.get('kind', 'decode')}"] = {
                "rows": int(got.get("rows")), "kind": got.get("kind", "decode"), "steps": int(count - prev),
                "mean_ms": round(s / (count - prev) * 1e3, 3)}
    return out


def gc_pauses(before, after) -> dict[str, dict]:
    """Python's cyclic collections in the server between two scrapes (every thread waits while one
    runs), by generation: {"<generation>": {count, total_ms}}, the generations that ran."""
    def grew(name: str, g: str) -> float:
        return (after.value(name, generation=g) or 0.0) - (before.value(name, generation=g) or 0.0)

    return {g: {"count": int(grew("kite_gc_pauses_total", g)),
                "total_ms": round(grew("kite_gc_pause_seconds_total", g) * 1e3, 2)}
            for g in ("0", "1", "2") if grew("kite_gc_pauses_total", g) > 0}


SERVER_PHASES = {"signals_and_decision": "kite_yoco_signals_latency_seconds", "load": "kite_yoco_load_latency_seconds",
                 "ttft_in_server": "kite_ttft_seconds"}


def phase_means(before, after) -> dict[str, float | None]:
    """The mean ms of each of a request's phases the server times (SERVER_PHASES) between two scrapes."""
    out = {}
    for phase, name in SERVER_PHASES.items():
        n = sum(after.samples.get(f"{name}_count", {}).values()) - sum(before.samples.get(f"{name}_count", {}).values())
        s = sum(after.samples.get(f"{name}_sum", {}).values()) - sum(before.samples.get(f"{name}_sum", {}).values())
        out[phase] = round(s / n * 1e3, 3) if n > 0 else None
    return out


def server_ttft_ms(rec: dict) -> float | None:
    """A request's TTFT inside the server, from the route's arrival stamp to its first token: its wait
    (arrival to joining the batch, less its own signals and load), its signals and load, and the
    generation's TTFT from joining (the response's `kite` object); None without one."""
    k = rec.get("kite") or {}
    g = k.get("generation") or {}
    if k.get("wait_ms") is None or g.get("ttft_ms") is None:
        return None
    t = k.get("timings_ms") or {}
    return k["wait_ms"] + t.get("signals_and_decision", 0.0) + t.get("load", 0.0) + g["ttft_ms"]


def summarize(recs: list[dict], seen: dict, wall_s: float, steps: dict) -> dict:
    ok = [r for r in recs if r["status"] == "ok"]
    ttft = [r["ttft_s"] * 1e3 for r in ok if r.get("ttft_s") is not None]
    inside = [(r["ttft_s"] * 1e3, server_ttft_ms(r)) for r in ok if r.get("ttft_s") is not None]
    inside = [(client, server) for client, server in inside if server is not None]
    gaps = [(b - a) * 1e3 for r in ok for a, b in zip(r["times_s"], r["times_s"][1:])]
    waits = [r["kite"]["wait_ms"] for r in ok if r.get("kite") and r["kite"].get("wait_ms") is not None]
    counts: dict[str, int] = {}
    for r in recs:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    # the decode steps (one token a row) at the round's most frequent row count: newcomers' prefills apart
    decode = [v for v in steps.values() if v["kind"] == "decode"]
    busiest = max(decode, key=lambda v: (v["steps"], v["rows"]), default=None)
    resident = [r["kite"]["load"].get("resident_bytes") for r in ok
                if r.get("kite") and r["kite"].get("load") and r["kite"]["load"].get("resident_bytes")]
    forms = sorted({r["kite"]["load"].get("resident") for r in ok
                    if r.get("kite") and r["kite"].get("load") and r["kite"]["load"].get("resident")})
    s = {"requests": len(recs), "by_status": counts, "ok": len(ok), "wall_s": round(wall_s, 3),
         "completion_tokens": sum(r["tokens"] for r in ok),
         "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall_s, 2) if ok and wall_s > 0 else None,
         "ttft_p50_ms": round(quantile(ttft, 0.5), 2) if ttft else None,
         "ttft_p99_ms": round(quantile(ttft, 0.99), 2) if ttft else None,
         # the same TTFT split: inside the server (arrival to first token) and outside it (the HTTP
         # request's way in, the first text's way out, the client)
         "ttft_in_server_p50_ms": round(quantile([s for _, s in inside], 0.5), 2) if inside else None,
         "ttft_outside_server_p50_ms": round(quantile([c - s for c, s in inside], 0.5), 2) if inside else None,
         "inter_token_p50_ms": round(quantile(gaps, 0.5), 3) if gaps else None,
         "wait_p50_ms": round(quantile(waits, 0.5), 2) if waits else None,
         "wait_max_ms": round(max(waits), 2) if waits else None,
         "steps_by_rows": steps,
         "step_rows": busiest["rows"] if busiest else None, "step_mean_ms": busiest["mean_ms"] if busiest else None,
         "without_state": sum(1 for r in ok if r.get("kite") and r["kite"].get("state") and not r["kite"].get("loaded")),
         "loads_from_prefix_cache": sum(1 for r in ok if r.get("kite") and r["kite"].get("load")
                                        and "cached" in (r["kite"]["load"].get("timings_ms") or {})),
         "resident_forms": forms, "resident_bytes": int(statistics.median(resident)) if resident else None,
         "max_queue": seen.get("max_queue"), "torch_peak_gb": seen.get("torch_peak_gb"),
         "max_device_used_gb": seen.get("max_device_used_gb"), "memory_source": seen.get("memory_source")}
    return s


def step_floor_bytes(mode: str, s: dict, info: dict, tokens: int, new: int) -> float | None:
    """Bytes a step of ``s['step_rows']`` rows reads at least: the weights once, and each row's KV
    (its state's as held: raw KV of the document, or the lanes, plus the row's own slots)."""
    rows = s.get("step_rows")
    if not rows:
        return None
    own = QUESTION_WORDS + new / 2
    per_row = info["kv_bytes_per_token"] * (tokens + own)
    if mode == "lanes":
        if not s.get("resident_bytes"):
            return None
        per_row = s["resident_bytes"] + info["kv_bytes_per_token"] * own
    return info["weights_read_bytes"] + rows * per_row


# -- the run ------------------------------------------------------------------------------------
def bodies_for(mode: str, clients: int, per_client: int, docs: list[str], state_ids: list[str] | None,
               vocab: int, new: int, seed: int, tag: str | None = None) -> list[list[dict]]:
    """Each client's requests: a new question (QUESTION_WORDS random tokens, the same for every mode
    at a given round and place) about one document, the documents in turn; with ``tag``, each
    request names its own alias of its document's state (:func:`alias_states`)."""
    rng = random.Random(seed)
    out = []
    for c in range(clients):
        mine = []
        for j in range(per_client):
            d = (c + j * clients) % len(docs)
            q = random_words(QUESTION_WORDS, vocab, rng)
            body = {"max_tokens": new, "temperature": 0, "_doc": d}
            if mode == "none":
                body["prompt"] = docs[d] + q
            else:
                body.update(prompt=q, kite={"state": f"{state_ids[d]}.{tag}-{c}-{j}" if tag else state_ids[d]})
            mine.append(body)
        out.append(mine)
    return out


def upload(url: str, docs: list[str], timeout_s: float, t0: float) -> tuple[list[str], list[dict]]:
    ids, info = [], []
    for i, text in enumerate(docs):
        r = httpx.post(url + "/v1/states", json={"document": text, "name": f"doc{i}"}, timeout=timeout_s)
        if r.status_code not in (200, 201):
            raise RuntimeError(f"upload of document {i}: HTTP {r.status_code}: {r.text[:300]}")
        j = r.json()
        ids.append(j["id"])
        info.append({"id": j["id"], "tokens": j.get("tokens"), "bytes": j.get("bytes"), "created": j.get("created"),
                     "timings_ms": j.get("timings_ms")})
        log(f"  document {i}: state {j['id']} ({j.get('tokens')} tokens, {j.get('bytes')} bytes, "
            f"{'upcycled' if j.get('created') else 'already stored'})", t0)
    return ids, info


def warm(url: str, bodies: list[dict], timeout_s: float) -> list[dict]:
    """Ask each body once (a few at a time), unmeasured: kernels compiled, states in the hot tier."""
    async def go():
        async with httpx.AsyncClient(timeout=timeout_s) as c:
            sem = asyncio.Semaphore(8)

            async def one(b):
                async with sem:
                    return await stream_one(c, url, {k: v for k, v in b.items() if not k.startswith("_")})
            return await asyncio.gather(*(one(b) for b in bodies))
    return asyncio.run(go())


def run_mode(mode: str, args, model: Path, work: Path, docs: list[str], info: dict, deadline: float,
             t0: float, out: dict, run_deadline: float | None = None, later: int = 0) -> None:
    """Start the mode's server, upload or find the states, warm it, run every round until ``deadline``.
    A mode whose server's start, uploads and warm-up took its whole share still runs its rounds: until
    an equal part, with the ``later`` modes after it, of what is left before ``run_deadline``."""
    def within(deadline: float) -> float:
        if run_deadline is None or clock() < deadline:
            return deadline
        extended = clock() + max(0.0, run_deadline - clock()) / (later + 1)
        log(f"{mode}: its setup took its share of --budget-s; its rounds get {max(0.0, extended - clock()):.0f} s", t0)
        return extended

    from kite.serve.scrape import parse_metrics

    max_batch = min(args.max_batch, args.none_max_batch) if mode == "none" else args.max_batch
    # a row's slots: the whole prompt (none), the state and the question (raw), the question alone (lanes:
    # the state is held beside the slots); reserved at start unless --no-reserve
    own = RESERVE_QUESTION + args.max_new_tokens
    reserve = None if args.no_reserve else (own if mode == "lanes" else args.tokens + own)
    srv = Server(mode, model, work, max_batch, args.prefix_cache_gb, args.lane_bits, args.threads, args.batch_kv_gb,
                 reserve)
    out["max_batch"] = max_batch
    out["command"] = " ".join(srv.cmd[3:])
    log(f"{mode}: starting kite serve (max batch {max_batch})", t0)
    srv.start(max(30.0, min(args.start_timeout_s, deadline - clock())))
    try:
        out["start_s"] = round(clock() - t0, 1)
        log(f"{mode}: serving on {srv.url}", t0)
        state_ids = None
        deadline = within(deadline)
        if clock() >= deadline:
            raise RuntimeError("its server started after this mode's share of --budget-s had passed")
        if mode != "none":
            state_ids, out["states"] = upload(srv.url, docs, args.read_timeout_s, t0)
        warm_bodies = bodies_for(mode, 1, len(docs) if mode != "none" else 1, docs, state_ids, info["vocab_size"],
                                 2, seed=10_000)[0]
        w = warm(srv.url, warm_bodies, args.read_timeout_s)
        out["warm"] = {"requests": len(w), "by_status": {s: sum(1 for r in w if r["status"] == s)
                                                        for s in {r["status"] for r in w}}}
        log(f"{mode}: warmed with {len(w)} requests ({out['warm']['by_status']})", t0)
        deadline = within(deadline)
        out["rounds"] = {}
        for ci, clients in enumerate(args.clients):
            if clock() >= deadline:
                log(f"{mode}: {clients} clients skipped: past this mode's share of --budget-s", t0)
                out["rounds"][str(clients)] = {"skipped": "past this mode's share of --budget-s"}
                continue
            per_client = max(1, math.ceil(args.requests / clients))
            bodies = bodies_for(mode, clients, per_client, docs, state_ids, info["vocab_size"], args.max_new_tokens,
                                seed=1000 + ci, tag=f"{mode}-{clients}")
            if state_ids:
                alias_states(srv.states, bodies, state_ids)
            before = parse_metrics(httpx.get(srv.url + "/metrics", timeout=10).text)
            recs, seen, wall_s = asyncio.run(run_round(srv.url, bodies, deadline, args.read_timeout_s,
                                                       client_processes(clients)))
            after = parse_metrics(httpx.get(srv.url + "/metrics", timeout=10).text)
            flat = recs
            s = summarize(flat, seen, wall_s, step_histogram(before, after))
            s["server_phase_mean_ms"] = phase_means(before, after)
            s["gc_pauses"] = gc_pauses(before, after)
            s["records"] = flat
            out["rounds"][str(clients)] = s
            log(f"{mode}: {clients} clients x {per_client}: {s['ok']}/{s['requests']} ok {s['by_status']}, "
                f"{s['tokens_per_s']} tok/s, TTFT p50 {s['ttft_p50_ms']} ms p99 {s['ttft_p99_ms']} ms "
                f"(p50 in the server {s['ttft_in_server_p50_ms']} ms, outside {s['ttft_outside_server_p50_ms']} ms), "
                f"step {s['step_mean_ms']} ms at {s['step_rows']} rows, {wall_s:.1f} s, collections {s['gc_pauses']}", t0)
            bad = [r for r in flat if r["status"] not in ("ok", "not sent", "cut at deadline")]
            if bad:
                log(f"{mode}: first failure: {bad[0]['status']}: {bad[0].get('error')}", t0)
    finally:
        srv.stop()
        if srv.proc is not None and srv.proc.returncode not in (0, -15, None):
            log(f"{mode}: server log tail: {srv.tail(1500)}", t0)
        log(f"{mode}: server stopped", t0)


def prefill_floor(info: dict, tokens: int) -> dict:
    """A document's prefill at the GPU's dense bf16 rate: 2 x parameters x tokens, plus causal
    attention's 2 x layers x tokens^2 x hidden (QK^T and PV over half the square)."""
    flops = 2 * info["params"] * tokens + 2 * info["layers"] * tokens ** 2 * info["hidden"]
    return {"floor": f"the document's prefill: {flops:.3g} FLOPs {bf16_text()}", "floor_value": flops_ms(flops)}


def raw_largest_batch(runs: dict, clients: list[int]) -> int | None:
    """The client count of raw's round whose decode steps ran the most rows (raw's largest batch:
    lanes' decode rate is measured against it)."""
    rounds = [(s["step_rows"], c) for c in clients
              if (s := runs.get("raw", {}).get("rounds", {}).get(str(c))) and "skipped" not in s and s.get("step_rows")]
    return max(rounds)[1] if rounds else None


def add_rows(res: Result, modes: list[str], runs: dict, args, info: dict, on_gpu: bool) -> None:
    top = raw_largest_batch(runs, args.clients)
    for mode in sorted(modes, key=lambda m: m != "none"):    # the baselines' rows first
        for clients in args.clients:
            s = runs.get(mode, {}).get("rounds", {}).get(str(clients))
            if not s or "skipped" in s:
                continue
            base = runs.get("none", {}).get("rounds", {}).get(str(clients)) if mode != "none" else None
            tag = f"{mode}, {clients} clients"
            extra = {"mode": mode, "clients": clients}

            def rel(metric: str, unit: str, name: str, value, **more):
                if value is None:
                    return
                b = base and base.get(metric)
                res.row(f"{tag}: {name}", value, unit, **extra, **more,
                        **({"baseline": f"none, {clients} clients: {name}"} if b else {}))

            rel("tokens_per_s", "tokens/s", "completion tokens/s", s["tokens_per_s"])
            # without KITE a request waits at least its document's prefill: the baseline's own floor
            rel("ttft_p50_ms", "ms", "TTFT p50", s["ttft_p50_ms"],
                **(prefill_floor(info, args.tokens) if mode == "none" and on_gpu else {}))
            rel("ttft_p99_ms", "ms", "TTFT p99", s["ttft_p99_ms"])
            if s["step_mean_ms"] is not None:
                fb = step_floor_bytes(mode, s, info, args.tokens, args.max_new_tokens)
                held = "lanes and own slots" if mode == "lanes" else "KV"
                floor = {"floor": f"weights + {s['step_rows']} rows' {held} read once {hbm_text()}",
                         "floor_value": bytes_ms(fb)} if on_gpu and fb else {}
                res.row(f"{tag}: decode step, server mean", s["step_mean_ms"], "ms", rows=s["step_rows"], **floor, **extra)
                # the rows' tokens a second while they decode (rows / step): lanes against raw's largest batch
                against = ({"baseline": f"raw, {top} clients: decode tokens/s, server"}
                           if mode == "lanes" and top is not None else {})
                res.row(f"{tag}: decode tokens/s, server", round(s["step_rows"] * 1e3 / s["step_mean_ms"], 1),
                        "tokens/s", rows=s["step_rows"], **against, **extra)
            if mode == "lanes" and top is not None:
                res.row(f"{tag}: completion tokens/s against raw's largest batch", s["tokens_per_s"], "tokens/s",
                        baseline=f"raw, {top} clients: completion tokens/s", **extra)
            if s["inter_token_p50_ms"] is not None:
                res.row(f"{tag}: inter-token p50, client", s["inter_token_p50_ms"], "ms", **extra)
            if s["torch_peak_gb"] is not None and on_gpu:
                res.row(f"{tag}: GPU memory, torch peak in the server since it started", s["torch_peak_gb"], "GB",
                        device_used_gb=s["max_device_used_gb"], source=s["memory_source"], **extra)
            res.row(f"{tag}: requests refused", sum(n for k, n in s["by_status"].items()
                                                   if k not in ("ok", "not sent", "cut at deadline")),
                    "requests", of=s["requests"], by_status=s["by_status"], **extra)
            res.row(f"{tag}: requests not finished by the deadline", s["by_status"].get("not sent", 0)
                    + s["by_status"].get("cut at deadline", 0), "requests", of=s["requests"], **extra)
            if s["max_queue"] is not None:
                res.row(f"{tag}: longest queue for the batch", s["max_queue"], "requests",
                        wait_p50_ms=s["wait_p50_ms"], wait_max_ms=s["wait_max_ms"], **extra)
            if mode != "none":
                res.row(f"{tag}: answered without the state", s["without_state"], "requests", of=s["ok"],
                        loads_from_prefix_cache=s["loads_from_prefix_cache"], resident_forms=s["resident_forms"],
                        **extra)


def client_list(text: str) -> list[int] | None:
    """The client counts of ``--clients``; None when it is not a list of integers >= 1."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        return None
    return out if out and min(out) >= 1 else None


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, help="tokens a document (default 16384; --cpu-smoke 256)")
    ap.add_argument("--docs", type=int, help="documents (default 8; the seed's claim is about 64; --cpu-smoke 2)")
    ap.add_argument("--clients", help="concurrent clients, comma-separated (default 1,8,32,64; --cpu-smoke 1,4)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)} (default all)")
    ap.add_argument("--requests", type=int, help="at least this many requests a round: each client sends "
                    "ceil(N / clients) one after another (default 8; --cpu-smoke 4)")
    ap.add_argument("--max-new-tokens", type=int, help="tokens each answer (default 64; --cpu-smoke 8)")
    ap.add_argument("--max-batch", type=int, help="the servers' --max-batch (default: the largest of --clients)")
    ap.add_argument("--none-max-batch", type=int, help="--max-batch of the `none` server, at most --max-batch "
                    "(default --max-batch)")
    ap.add_argument("--prefix-cache-gb", type=float, help="the state servers' server.prefix_cache_gb (default: "
                    "every document's raw KV, at most 40)")
    ap.add_argument("--lane-bits", help="--lane-bits of the lanes server (default: the server's, 4)")
    ap.add_argument("--batch-kv-gb", type=float, help="the servers' --batch-kv-gb (default: unbounded)")
    ap.add_argument("--no-reserve", action="store_true", help="start the servers without --batch-reserve-tokens "
                    "(the batch's buffers grow, and its graphs are captured, on demand)")
    ap.add_argument("--budget-s", type=float, help="seconds the whole run may take, the model's writing "
                    "included (default 450; --cpu-smoke 900)")
    ap.add_argument("--read-timeout-s", type=float, default=300.0, help="a request's read timeout (default 300)")
    ap.add_argument("--start-timeout-s", type=float, default=300.0, help="wait this long for a server (default 300)")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the servers (default: unset; --cpu-smoke 2)")
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny geometry on the CPU, few tokens, "
                    "clients 1 and 4: checks the script runs")
    args = parse(ap, argv)
    smoke = args.cpu_smoke
    if smoke:
        args.device = "cpu"
    pick = (lambda gpu, cpu, v: v if v is not None else (cpu if smoke else gpu))
    args.tokens = pick(16384, 256, args.tokens)
    args.docs = pick(8, 2, args.docs)
    clients = client_list(pick("1,8,32,64", "1,4", args.clients))
    if clients is None:
        ap.error(f"--clients {args.clients!r}: a comma-separated list of integers, each at least 1")
    args.clients = clients
    args.requests = pick(8, 4, args.requests)
    args.max_new_tokens = pick(64, 8, args.max_new_tokens)
    args.max_batch = pick(max(args.clients), max(args.clients), args.max_batch)
    args.none_max_batch = args.max_batch if args.none_max_batch is None else args.none_max_batch
    args.budget_s = pick(450.0, 900.0, args.budget_s)
    args.threads = pick(None, 2, args.threads)
    for flag in ("tokens", "docs", "requests", "max_new_tokens", "max_batch", "none_max_batch"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    asked = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not asked or any(m not in MODES for m in asked):
        ap.error(f"--modes {args.modes!r}: a comma-separated list of {', '.join(MODES)}")
    modes = [m for m in RUN_ORDER if m in asked]
    on_gpu = str(args.device).startswith("cuda")
    if "lanes" in modes and not on_gpu:
        print("lanes: skipped: states resident in lanes are read by the GPU kernel; this run is on the CPU",
              flush=True)
        modes.remove("lanes")
    # a `timeout` around the run stops it with SIGTERM: unwind, so each server is stopped (its finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = clock()
    deadline = t0 + args.budget_s
    print(f"modes {', '.join(modes)}; clients {args.clients}; {args.docs} documents of {args.tokens} tokens; "
          f"{args.max_new_tokens} new tokens; at least {args.requests} requests a round; budget {args.budget_s:g} s",
          flush=True)
    from kite.kernels.locate import runtime_status

    runtime = runtime_status()     # uploads compress on its CUDA kernels: 3-13 s a 16K-token state without them on an H200, ~150 ms with
    print(f"native runtime: {runtime}", flush=True)
    res = Result("serve_gpu", device=args.device)
    runs: dict = {}
    with tempfile.TemporaryDirectory(prefix="kite-serve-gpu-") as tmp:
        work = Path(tmp)
        log(f"writing a random-weight Qwen2 {'(tiny) ' if smoke else '7B '}folder", t0)
        info = write_random_qwen2(work / "model", args.device, small=smoke, seed=args.seed)
        log(f"model written: {info['params'] / 1e9:.2f} B parameters, "
            f"{sum(p.stat().st_size for p in (work / 'model').iterdir()) / 1e9:.2f} GB", t0)
        if args.prefix_cache_gb is None:
            args.prefix_cache_gb = round(min(40.0, 1.1 * args.docs * args.tokens * info["kv_bytes_per_token"] / 2**30
                                             + 0.5), 2)
        rng = random.Random(args.seed)
        docs = [random_words(args.tokens, info["vocab_size"], rng) for _ in range(args.docs)]
        for i, mode in enumerate(modes):
            share = max(0.0, deadline - clock()) / (len(modes) - i)
            runs[mode] = {}
            try:
                run_mode(mode, args, work / "model", work, docs, info, clock() + share, t0, runs[mode],
                         run_deadline=deadline, later=len(modes) - i - 1)
            except (RuntimeError, httpx.HTTPError) as exc:
                runs[mode]["failed"] = f"{type(exc).__name__}: {exc}"[:2000]
                log(f"{mode}: failed: {runs[mode]['failed']}", t0)
    add_rows(res, modes, runs, args, info, on_gpu)
    res.attach("records", {mode: {c: r.pop("records") for c, r in run.get("rounds", {}).items() if "records" in r}
                           for mode, run in runs.items()})
    res.raw.update({"runtime": runtime, "settings": {k: v for k, v in vars(args).items() if k not in ("stdout", "out")},
                    "modes": modes, "model": info, "runs": runs, "total_s": round(clock() - t0, 1)})
    log("done", t0)
    finish(res, args)
    return 0 if res.rows and not any("failed" in r for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
