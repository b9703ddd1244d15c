"""What the store did, counted per tier: hits, misses, puts, errors by operation, evictions. The
server exposes them in /metrics (kite_store_hits_total{tier}, kite_store_errors_total{tier,op}, ...)."""

from __future__ import annotations

import threading
from collections import Counter


class StoreCounters:
    """Thread-safe counts. ``errors`` by (tier, op): op is get, put, promote, verify (a corrupt or
    mismatched object was found and refused), delete, list, stat, evict, open (a tier that failed
    to open or a file its index left out)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.hits: Counter[str] = Counter()
        self.puts: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()     # puts a tier declined by its own bound
        self.errors: Counter[tuple[str, str]] = Counter()
        self.misses = 0

    def hit(self, tier: str) -> None:
        with self._lock:
            self.hits[tier] += 1

    def miss(self) -> None:
        with self._lock:
            self.misses += 1

    def put(self, tier: str, stored: bool) -> None:
        with self._lock:
            (self.puts if stored else self.skipped)[tier] += 1

    def error(self, tier: str, op: str) -> None:
        with self._lock:
            self.errors[(tier, op)] += 1

    def snapshot(self) -> dict:
        """Plain JSON: hits/puts/skipped by tier, errors as a list of {tier, op, count}, misses."""
        with self._lock:
            return {"hits": dict(self.hits), "misses": self.misses, "puts": dict(self.puts),
                    "skipped": dict(self.skipped),
                    "errors": [{"tier": t, "op": o, "count": n} for (t, o), n in sorted(self.errors.items())]}
