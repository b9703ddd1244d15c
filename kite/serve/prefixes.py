"""Loaded states kept for the next request about the same document: the server's prefix cache.

A state is loaded for a request with the clusters, layers and precision YOCO chose. The next
request about the same state that gets the same choice reads the same KV: it is kept here
(least recently used out first, within ``max_bytes``), keyed by the file's version (so a state
replaced on disk is loaded again), the load's arguments and the form it is held in. A hit costs no
read and no decode; its report says so (``timings_ms["cached"]``).

``resident="coded"`` (``server.resident``): a load the coded form covers (every layer, the state's
own precision, a PCA-coded state without a regenerator) is kept in that form
(:func:`kite.upcycle.load_resident`), and the batch's attention reads it from its codes; any other
load is rebuilt as raw KV (``load_prefix``) and its report's warnings say why.

``resident="lanes"``: every load is rebuilt (``load_prefix``) and coded again into nibble lanes of
``lane_bits`` bits an element (:func:`kite.upcycle.load.lanes.load_lanes`), which the batch's
attention reads from their codes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import replace

from kite.errors import BadInput

RESIDENT_FORMS = ("raw", "coded", "lanes")
REFUSED_KEPT = 4096   # loads remembered as not holdable coded (not tried again while remembered)


def prefix_bytes(prefix) -> int:
    """Bytes a loaded prefix holds: KVPrefix.nbytes() (a method) or CodedPrefix.nbytes (a property)."""
    n = prefix.nbytes
    return int(n() if callable(n) else n)


class PrefixCache:
    def __init__(self, max_bytes: int, resident: str = "raw", lane_bits: str = "4"):
        from kite.config import parse_lane_bits

        if resident not in RESIDENT_FORMS:
            raise BadInput(f"server.resident {resident!r}: expected one of {', '.join(RESIDENT_FORMS)}")
        self.max_bytes = max_bytes
        self.resident = resident
        self.lane_bits = parse_lane_bits(lane_bits)
        self._entries: OrderedDict = OrderedDict()
        self._refused: OrderedDict = OrderedDict()   # (version, args) -> why the coded form does not hold it
        self._bytes = 0
        self.hits = self.misses = 0

    def load(self, state, lm, **kwargs):
        """`kite.upcycle.load_prefix(state, lm, **kwargs)` (with ``resident="coded"``, in coded form
        where it can be: `kite.upcycle.load_resident`), or what an earlier call with the same file
        version and arguments returned (not to be modified: rows copy it)."""
        t0 = time.perf_counter()
        args = (state.version, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items())))
        why = self._refused.get(args) if self.resident != "raw" else None
        form = self.resident if why is None else "raw"
        key = (args[0], form, args[1])
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            prefix, report = hit
            ms = round((time.perf_counter() - t0) * 1e3, 3)
            return prefix, replace(report, bytes_read=0, load_ms=ms, timings_ms={"cached": ms},
                                   warnings=list(report.warnings))
        self.misses += 1
        prefix, report = self._load(state, lm, args, form, why, kwargs)
        size = prefix_bytes(prefix)
        key = (args[0], report.resident, args[1])
        if size <= self.max_bytes:
            self._entries[key] = (prefix, report)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (old, _) = self._entries.popitem(last=False)
                self._bytes -= prefix_bytes(old)
        return prefix, report

    def _load(self, state, lm, args, form: str, why: str | None, kwargs):
        from kite.upcycle import load_lanes, load_prefix, load_resident

        if form != "raw":
            try:
                if form == "lanes":
                    return load_lanes(state, lm, lane_bits=self.lane_bits, **kwargs)
                return load_resident(state, lm, **kwargs)
            except BadInput as exc:
                why = str(exc).replace(str(state.path), state.path.name)   # the server's folders stay its own
                self._refused[args] = why
                while len(self._refused) > REFUSED_KEPT:
                    self._refused.popitem(last=False)
        prefix, report = load_prefix(state, lm, **kwargs)
        if why is not None:
            report.warnings.append(f"server.resident is {self.resident}, but this load is held raw: {why}")
        return prefix, report

    @property
    def nbytes(self) -> int:
        return self._bytes

    def held_paths(self) -> set[str]:
        """The real paths of the state files whose loads are held here (what a replica reports hot)."""
        return {key[0][0] for key in list(self._entries)}
