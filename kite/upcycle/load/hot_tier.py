"""The hot tier: staged states kept in pinned host memory, least recently used out first.

A state staged for a load (its chosen blobs, one region per layer, see :mod:`.staging`) stays here
keyed by the file's version, the chosen clusters, the sinks and the layers; a later load of the same
choice skips reading the file entirely.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kite.upcycle.load.tables import LayerPlan, round_up


@dataclass
class HotState:
    """A state's chosen blobs in (pinned) host memory, one region per layer, ready to copy."""

    key: tuple
    buffer: torch.Tensor                      # uint8 [nbytes]
    H: int
    d: int
    rows: int                                 # decoded rows per layer (every token of the chosen parts)
    dest: torch.Tensor                        # int64 [rows]: cache row of each decoded row (-1: not kept)
    positions: torch.Tensor                   # int64 [T_out]: the kept tokens' positions, ascending
    layers: list[LayerPlan | None]
    bytes_read: int = 0
    futures: list[Future | None] = field(default_factory=list)
    graphs: dict = field(default_factory=dict)   # rebuild graphs per (buffers) on a GPU
    dest_dev: dict = field(default_factory=dict)  # device -> (host dest, device copy)
    cached_tables: bool = False                # True when the tables came from the plan cache
    # a state coded on bases across layers: the staged groups ({first layer: (start, stop)}), the
    # layers asked (a group's others are not rebuilt) and the regenerator whose columns it gathers
    groups: dict | None = None
    wanted: list[int] | None = None
    regenerator: object = None

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def wait(self, layer: int) -> LayerPlan | None:
        """The layer's plan once its blobs are staged (re-raises a read error)."""
        if self.futures and self.futures[layer] is not None:
            self.layers[layer] = self.futures[layer].result()
            self.futures[layer] = None
        return self.layers[layer]

    def wait_all(self) -> HotState:
        for layer in range(len(self.layers)):
            self.wait(layer)
        return self


class HotTier:
    """Pinned host memory for hot states: an LRU of staged states within ``capacity_bytes``.

    Buffers of evicted states are kept (up to ``spare`` of them) and reused for the next staging,
    so a miss does not pay for pinning new memory.
    """

    def __init__(self, capacity_bytes: int = 8 << 30, spare: int = 2, pin: bool | None = None):
        self.capacity = int(capacity_bytes)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._states: OrderedDict[tuple, HotState] = OrderedDict()
        self._spare: list[torch.Tensor] = []
        self._n_spare = spare
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def held_bytes(self) -> int:
        return sum(s.nbytes for s in self._states.values())

    def get(self, key: tuple) -> HotState | None:
        with self._lock:
            hot = self._states.get(key)
            if hot is not None:
                self._states.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            return hot

    def put(self, hot: HotState) -> None:
        with self._lock:
            self._states[hot.key] = hot
            self._states.move_to_end(hot.key)
            while len(self._states) > 1 and self.held_bytes > self.capacity:
                _, old = self._states.popitem(last=False)
                self._keep_spare(old.buffer)

    def drop(self, key: tuple) -> None:
        with self._lock:
            old = self._states.pop(key, None)
            if old is not None:
                self._keep_spare(old.buffer)

    def clear(self) -> None:
        with self._lock:
            for old in self._states.values():
                self._keep_spare(old.buffer)
            self._states.clear()

    def _keep_spare(self, buf: torch.Tensor) -> None:
        self._spare.append(buf)
        self._spare.sort(key=lambda b: b.numel())
        while len(self._spare) > self._n_spare:
            self._spare.pop(0)

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of at least nbytes (a spare one when big enough, else newly pinned)."""
        with self._lock:
            for i, b in enumerate(self._spare):
                if b.numel() >= nbytes:
                    return self._spare.pop(i)[:nbytes]
        return torch.empty(round_up(nbytes, 2 << 20), dtype=torch.uint8, pin_memory=self.pin)[:nbytes]


_DEFAULT: HotTier | None = None


def default_tier() -> HotTier:
    """The process's hot tier (``KITE_HOT_TIER_GB``, default 8 GB of pinned host memory)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = HotTier(int(float(os.environ.get("KITE_HOT_TIER_GB", "8")) * (1 << 30)))
    return _DEFAULT
