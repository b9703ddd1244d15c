"""The Python heap of a serving process: its start-up objects kept out of the collector's way, and
the collector's pauses counted.

Python's cyclic collector stops every thread while it runs, the batch's model thread too. A full
collection walks every tracked object: after a model, its tokenizer, torch, the web stack and the
captured steps are loaded that is millions of them, and one pause lands in the middle of whatever
step is running. :func:`freeze_startup_heap` moves what start-up made into the permanent generation
(``gc.freeze``, as vLLM does after its start-up), so a collection walks only what requests made
since. :class:`GcPauses` counts each generation's collections and the time they held the process,
read when ``/metrics`` is scraped (``kite_gc_pauses_total``, ``kite_gc_pause_seconds_total``,
``kite_gc_pause_max_seconds``)."""

from __future__ import annotations

import gc
import time


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then exempt every live object from later collections;
    the objects frozen (a process serves for its lifetime: none of them is expected to become
    cyclic garbage, and one that does only stays allocated)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """The collector's pauses of this process since :meth:`start`, by generation: collections, seconds
    in all and the longest. The callback only adds numbers (it runs inside a collection, in whatever
    thread triggered it: it takes no lock and calls nothing that could)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        g = min(int(info.get("generation", 0)), 2)
        dt = time.perf_counter() - self._t0
        self.count[g] += 1
        self.seconds[g] += dt
        if dt > self.longest[g]:
            self.longest[g] = dt

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    # -- a prometheus_client collector -------------------------------------------------------------
    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        count = CounterMetricFamily("kite_gc_pauses", "Python's cyclic collections, by generation (every thread "
                                    "waits while one runs).", labels=["generation"])
        seconds = CounterMetricFamily("kite_gc_pause_seconds", "Seconds the process spent in Python's cyclic "
                                      "collections, by generation.", labels=["generation"])
        longest = GaugeMetricFamily("kite_gc_pause_max_seconds", "The longest of those collections since start, "
                                    "by generation.", labels=["generation"])
        for g in range(3):
            count.add_metric([str(g)], self.count[g])
            seconds.add_metric([str(g)], self.seconds[g])
            longest.add_metric([str(g)], self.longest[g])
        return [count, seconds, longest]
