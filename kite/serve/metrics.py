"""Prometheus metrics of one server, in a registry of its own (two apps in one process, as in the
tests, never share or clash). Names are listed in docs/serving.md."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kite.serve.heap import GcPauses

# Decisions (signals + rules) and loads are fast; requests on a CPU are slow: separate buckets.
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_DECISION = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)  # the target is p99 <= 50 us
_SLOW = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TTFT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)  # GPU to loaded CPU
WATERMARK_FIELDS = ("gpu_mem", "gpu_mem_gb", "pcie_util", "nvlink_util", "cpu_queue", "spike")


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kite_requests", "HTTP requests by route and status.",
                                ["route", "method", "status"], registry=r)
        self.request_latency = Histogram("kite_request_latency_seconds", "HTTP request latency by route.",
                                         ["route"], buckets=_SLOW, registry=r)
        self.decision_latency = Histogram("kite_yoco_decision_latency_seconds",
                                          "The rules' decision (match + plan) per request naming a state.",
                                          buckets=_DECISION, registry=r)
        self.signals_latency = Histogram(
            "kite_yoco_signals_latency_seconds",
            "Signals (the model's entropy/label pass over the query, novelty, health) + decision.",
            buckets=_FAST, registry=r)
        self.ttft = Histogram(
            "kite_ttft_seconds",
            "Time to first token once the model holds the request: signals, decision, state load, prompt "
            "prefill, first step (the bench's ttft_ms; queueing for the model not included).",
            buckets=_TTFT, registry=r)
        self.load_latency = Histogram("kite_yoco_load_latency_seconds", "Partial read + rebuild of a state's KV.",
                                      buckets=_FAST, registry=r)
        self.loads = Counter("kite_yoco_loads", "Requests that loaded state.", registry=r)
        self.hits = Counter("kite_yoco_hits", "Loads whose measured gain was positive.", registry=r)
        self.skips = Counter("kite_yoco_skips", "Requests naming a state whose plan loaded nothing.", registry=r)
        self.hit_rate = Gauge("kite_yoco_hit_rate", "Among loads since start, the fraction with positive gain.",
                              registry=r)
        self.gain = Histogram("kite_yoco_gain", "Measured gain of loads (entropy reduction, fraction).",
                              buckets=(-0.5, -0.1, -0.05, -0.01, 0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0), registry=r)
        self.tokens = Counter("kite_generated_tokens", "Tokens by kind (prompt, completion, prefix).", ["kind"],
                              registry=r)
        self.upcycles = Counter("kite_upcycle_states", "Documents upcycled into states.", registry=r)
        self.upcycle_bytes = Counter("kite_upcycle_bytes", "Bytes of .upc written.", registry=r)
        self.upcycle_tokens = Counter("kite_upcycle_context_tokens", "Context tokens upcycled.", registry=r)
        self.regenerate_rate = Gauge("kite_upcycle_regenerate_rate",
                                     "MB of .upc produced per 1,000 context tokens (since start).", registry=r)
        self.compression_ratio = Gauge("kite_upcycle_compression_ratio",
                                       "Raw fp16 KV bytes / .upc bytes (since start).", registry=r)
        self.rule_reloads = Counter("kite_rules_reloads", "Rule reloads and switches by result.", ["result"],
                                    registry=r)
        self.rules_loaded_at = Gauge("kite_rules_loaded_at_seconds", "Unix time the active rule set compiled.",
                                     registry=r)
        self.watermark = {f: Gauge(f"kite_watermark_{f}", f"hardware_watermark.{f} (latest sample).", registry=r)
                          for f in WATERMARK_FIELDS}
        self.watermark_samples = Gauge("kite_watermark_samples", "Samples the watermark sampler has taken.",
                                       registry=r)
        self.batch_queue = Gauge("kite_batch_queue_length",
                                 "Requests waiting to join the continuous batch (after the last step).", registry=r)
        self.batch_size = Gauge("kite_batch_size", "Sequences decoding together in the last step.", registry=r)
        self.batch_steps = Counter("kite_batch_steps_total", "Steps of the continuous batch.", registry=r)
        self.batch_cancelled = Counter("kite_batch_cancelled_total",
                                       "Sequences dropped from the batch because their clients left.", registry=r)
        self.batch_rows = Histogram("kite_batch_rows", "Sequences in each step of the continuous batch.",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.batch_step_seconds = Histogram(
            "kite_batch_step_seconds", "Wall time of each step of the continuous batch (the model's forward for "
            "every row, prompts included), by the rows it ran and what it ran (prefill: newcomers' prompts only; "
            "decode: one token a row; mixed: both).", ["rows", "kind"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5), registry=r)
        self.gc = GcPauses()        # counted between the app's start-up and shutdown (its lifespan)
        r.register(self.gc)
        self._lock = threading.Lock()
        self._loads = self._hits = 0
        self._up_bytes = self._up_tokens = self._raw_bytes = 0

    def bind_sampler(self, sampler) -> None:
        """Watermark gauges read the sampler's latest reading at scrape time (never blocks)."""
        for name, gauge in self.watermark.items():
            gauge.set_function(lambda n=name: float(getattr(sampler.latest().watermark, n) or 0.0))
        self.watermark_samples.set_function(lambda: float(sampler.samples))

    def bind_store(self, store) -> None:
        """The tiered store's counts (kite.store.TieredStore) read at scrape time:
        kite_store_hits_total{tier}, kite_store_misses_total, kite_store_puts_total{tier},
        kite_store_errors_total{tier,op}, kite_store_evictions_total{tier}."""
        self.registry.register(_StoreCollector(store))

    def bind_quarantine(self, quarantines) -> None:
        """The quarantines' counts (kite.serve.quarantine.Quarantine; ``quarantines``: one, or a
        function giving the server's and each tenant's) read at scrape time and summed:
        kite_states_quarantined, kite_state_loads_refused_total{cause}."""
        self.registry.register(_QuarantineCollector(quarantines if callable(quarantines) else lambda: [quarantines]))

    def bind_rules(self, active) -> None:
        self.rules_loaded_at.set_function(lambda: float(active.current.loaded_at))

    def observe_step(self, queue_length: int, batch_size: int, cancelled: int = 0,
                     seconds: float | None = None, kind: str = "decode") -> None:
        """After a step of the batch (kite.serve.batcher): who waits, who decodes, how long the step took."""
        self.batch_queue.set(queue_length)
        self.batch_size.set(batch_size)
        self.batch_steps.inc()
        if cancelled:
            self.batch_cancelled.inc(cancelled)
        if batch_size:
            self.batch_rows.observe(batch_size)
            if seconds is not None:
                self.batch_step_seconds.labels(rows=str(batch_size), kind=kind).observe(seconds)

    def observe_answer(self, answer) -> None:
        g = answer.generation
        self.tokens.labels("prompt").inc(g.prompt_tokens)
        self.tokens.labels("completion").inc(g.new_tokens)
        if g.prefix_tokens:
            self.tokens.labels("prefix").inc(g.prefix_tokens)
        f = answer.fused
        before_ms = 0.0 if f is None else f.timings_ms.get("signals_and_decision", 0.0) + f.timings_ms.get("load", 0.0)
        self.ttft.observe((before_ms + g.ttft_ms) / 1e3)
        if f is None:
            return
        self.signals_latency.observe(f.timings_ms.get("signals_and_decision", 0.0) / 1e3)
        if "decide" in f.timings_ms:
            self.decision_latency.observe(f.timings_ms["decide"] / 1e3)
        if f.load is None:
            self.skips.inc()
            return
        self.load_latency.observe(f.timings_ms.get("load", 0.0) / 1e3)
        hit = f.gain is not None and f.gain > 0
        self.loads.inc()
        if f.gain is not None:
            self.gain.observe(f.gain)
        if hit:
            self.hits.inc()
        with self._lock:
            self._loads += 1
            self._hits += int(hit)
            self.hit_rate.set(self._hits / self._loads)

    def observe_upcycle(self, up) -> None:
        if not up.created:
            return
        s = up.summary
        self.upcycles.inc()
        self.upcycle_bytes.inc(s.bytes)
        self.upcycle_tokens.inc(s.tokens)
        with self._lock:
            self._up_bytes += s.bytes
            self._up_tokens += s.tokens
            self._raw_bytes += up.raw_kv_bytes
            if self._up_tokens:
                self.regenerate_rate.set((self._up_bytes / 1e6) / (self._up_tokens / 1000))
            if self._up_bytes and self._raw_bytes:
                self.compression_ratio.set(self._raw_bytes / self._up_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StoreCollector:
    """Reads the store's counters when /metrics is scraped (nothing to update on the request path)."""

    def __init__(self, store):
        self.store = store

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        snap = self.store.counters.snapshot()
        hits = CounterMetricFamily("kite_store_hits", "Reads of the state store answered by a tier (verified).",
                                   labels=["tier"])
        puts = CounterMetricFamily("kite_store_puts", "States written into a tier (puts and promotions).",
                                   labels=["tier"])
        evictions = CounterMetricFamily("kite_store_evictions", "States a tier dropped to keep its bound.",
                                        labels=["tier"])
        errors = CounterMetricFamily("kite_store_errors", "Store failures by tier and operation (get, put, promote, "
                                     "verify = a corrupt copy refused, delete, list, stat, evict).",
                                     labels=["tier", "op"])
        for tier in self.store.tiers:
            hits.add_metric([tier.name], snap["hits"].get(tier.name, 0))
            puts.add_metric([tier.name], snap["puts"].get(tier.name, 0))
            evictions.add_metric([tier.name], tier.evictions)
        for e in snap["errors"]:
            errors.add_metric([e["tier"], e["op"]], e["count"])
        misses = CounterMetricFamily("kite_store_misses", "Reads no tier answered with a good copy.",
                                     value=snap["misses"])
        return [hits, misses, puts, errors, evictions]


class _QuarantineCollector:
    """Reads the quarantine when /metrics is scraped: the states quarantined now, the loads refused."""

    def __init__(self, quarantines):
        self.quarantines = quarantines   # () -> the Quarantines to sum (the server's, each tenant's)

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from kite.serve.quarantine import REFUSED_CAUSES

        every = self.quarantines()
        held = GaugeMetricFamily("kite_states_quarantined", "States quarantined: a reader refused the file's "
                                 "bytes at a load; requests naming them are refused until the file changes.",
                                 value=sum(len(q.ids()) for q in every))
        refused = CounterMetricFamily("kite_state_loads_refused", "Loads of a state refused, by cause (unreadable "
                                      "= a reader refused the file and quarantined it, quarantined = refused "
                                      "without a read).", labels=["cause"])
        counts = [q.counts() for q in every]
        for cause in REFUSED_CAUSES:
            refused.add_metric([cause], sum(c.get(cause, 0) for c in counts))
        return [held, refused]
