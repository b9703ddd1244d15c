"""Host memory: the hot tier. States as bytes in one process, bounded, least recently used first out."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from kite.errors import BadInput
from kite.store.tier import ObjectStat, Tier, TierURL, register_tier

DEFAULT_MAX = 2 * 10**9


@register_tier
class MemoryTier(Tier):
    """``mem://?max=2GB``: a put past ``max_bytes`` evicts the least recently used states first; a
    state larger than the whole tier is declined. Lost when the process ends."""

    scheme = "mem"

    def __init__(self, name: str = "mem", write: str = "through", max_bytes: int | None = DEFAULT_MAX):
        super().__init__(name, write, max_bytes)
        self._items: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, name: str, url: TierURL, write: str, max_bytes: int | None) -> "MemoryTier":
        if url.netloc or url.path not in ("", "/"):
            raise BadInput(f"store URL {url.text!r}: mem:// takes no location, only ?max=SIZE")
        return cls(name, write, DEFAULT_MAX if max_bytes is None else max_bytes)

    def get(self, state_id: str) -> bytes | None:
        with self._lock:
            hit = self._items.get(state_id)
            if hit is None:
                return None
            self._items[state_id] = (hit[0], time.time())
            self._items.move_to_end(state_id)
            return hit[0]

    def put(self, state_id: str, data: bytes) -> bool:
        data = bytes(data)
        if self.max_bytes is not None and len(data) > self.max_bytes:
            return False
        with self._lock:
            old = self._items.pop(state_id, None)
            if old is not None:
                self._bytes -= len(old[0])
            self._items[state_id] = (data, time.time())
            self._bytes += len(data)
            while self.max_bytes is not None and self._bytes > self.max_bytes:
                _, (blob, _) = self._items.popitem(last=False)
                self._bytes -= len(blob)
                self.evictions += 1
        return True

    def delete(self, state_id: str) -> bool:
        with self._lock:
            old = self._items.pop(state_id, None)
            if old is None:
                return False
            self._bytes -= len(old[0])
            return True

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def stat(self, state_id: str) -> ObjectStat | None:
        with self._lock:
            hit = self._items.get(state_id)
        return None if hit is None else ObjectStat(state_id, len(hit[0]), hit[1])

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._items), self._bytes

    def describe(self) -> str:
        return f"mem://?max={self.max_bytes}"
