"""Loaded states kept for the next request about the same document: the server's prefix cache.

A state is loaded for a request with the clusters, layers and precision YOCO chose. The next
request about the same state that gets the same choice reads the same KV: it is kept here
(least recently used out first, within ``max_bytes``), keyed by the file's version (so a state
replaced on disk is loaded again) and the load's arguments. A hit costs no read and no decode;
its report says so (``timings_ms["cached"]``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import replace


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def load(self, state, lm, **kwargs):
        """`kite.upcycle.load_prefix(state, lm, **kwargs)`, or what an earlier call with the same
        file version and arguments returned (not to be modified: rows copy it)."""
        from kite.upcycle import load_prefix

        t0 = time.perf_counter()
        key = (state.version, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items())))
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            prefix, report = hit
            ms = round((time.perf_counter() - t0) * 1e3, 3)
            return prefix, replace(report, bytes_read=0, load_ms=ms, timings_ms={"cached": ms},
                                   warnings=list(report.warnings))
        self.misses += 1
        prefix, report = load_prefix(state, lm, **kwargs)
        size = prefix.nbytes()
        if size <= self.max_bytes:
            self._entries[key] = (prefix, report)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (old, _) = self._entries.popitem(last=False)
                self._bytes -= old.nbytes()
        return prefix, report

    @property
    def nbytes(self) -> int:
        return self._bytes

    def held_paths(self) -> set[str]:
        """The real paths of the state files whose loads are held here (what a replica reports hot)."""
        return {key[0][0] for key in list(self._entries)}
