"""Loaded states kept for the next request about the same document: the server's prefix cache.

A state is loaded for a request with the clusters, layers and precision YOCO chose. The next
request about the same state that gets the same choice reads the same KV: it is kept here
(least recently used out first, within ``max_bytes``), keyed by the file's version (so a state
replaced on disk is loaded again), the load's arguments and the form it is held in. A hit costs no
read and no decode; its report says so (``timings_ms["cached"]``).

Loads are held in the server's resident form (``server.resident``: a kite.upcycle.ResidentForm
from the registry, kite.upcycle.RESIDENT_FORMS). A load that form refuses (BadInput: e.g. a head
size the lanes cannot take) is held raw instead, its report's warnings say why, and the refusal is
remembered so that the next load of it does not try again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import replace

from kite.errors import BadInput

REFUSED_KEPT = 4096   # loads remembered as not holdable in the server's form (not tried again while remembered)


class PrefixCache:
    def __init__(self, max_bytes: int, resident: str = "raw", lane_bits: str = "4"):
        """``resident``: the name of a registered resident form, built with the settings it takes
        (``lane_bits`` for lanes); BadInput for an unknown name or a bad setting."""
        from kite.upcycle import resident_form

        self.max_bytes = max_bytes
        self.form = resident_form(resident, lane_bits=lane_bits)
        self.raw = self.form if self.form.name == "raw" else resident_form("raw")
        self._entries: OrderedDict = OrderedDict()
        self._refused: OrderedDict = OrderedDict()   # (version, args) -> why the form does not hold it
        self._bytes = 0
        self.hits = self.misses = 0

    @property
    def resident(self) -> str:
        return self.form.name

    def load(self, state, lm, **kwargs):
        """``self.form.load(state, lm, **kwargs)`` (``kite.upcycle.load_prefix``'s arguments; held raw
        where the form refuses it), or what an earlier call with the same file version and arguments
        returned (not to be modified: rows copy it)."""
        t0 = time.perf_counter()
        args = (state.version, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items())))
        why = self._refused.get(args)
        form = self.form if why is None else self.raw
        key = (args[0], form.name, args[1])
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
        size = prefix.nbytes()
        key = (args[0], report.resident, args[1])
        if size <= self.max_bytes:
            self._entries[key] = (prefix, report)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (old, _) = self._entries.popitem(last=False)
                self._bytes -= old.nbytes()
        return prefix, report

    def _load(self, state, lm, args, form, why: str | None, kwargs):
        if form is not self.raw:
            try:
                return form.load(state, lm, **kwargs)
            except BadInput as exc:
                why = str(exc).replace(str(state.path), state.path.name)   # the server's folders stay its own
                self._refused[args] = why
                while len(self._refused) > REFUSED_KEPT:
                    self._refused.popitem(last=False)
        prefix, report = self.raw.load(state, lm, **kwargs)
        if why is not None:
            report.warnings.append(f"server.resident is {self.form.name}, but this load is held raw: {why}")
        return prefix, report

    @property
    def nbytes(self) -> int:
        return self._bytes

    def held_paths(self) -> set[str]:
        """The real paths of the state files whose loads are held here (what a replica reports hot)."""
        return {key[0][0] for key in list(self._entries)}
