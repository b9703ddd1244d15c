"""Host memory: the hot tier. States as bytes in one process, bounded, least recently used first out.
A tenant's part (:meth:`MemoryTier.tenant_part`) keys its states under the tenant's tag in the same
pool, so the bound is the process's, whoever the states belong to."""

from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict

from kite.errors import BadInput
from kite.store.tier import ObjectStat, Tier, TierURL, register_tier

DEFAULT_MAX = 2 * 10**9


class _Pool:
    """The bytes of a memory tier and its tenant parts: key -> (bytes, last use), least recent first."""

    def __init__(self):
        self.items: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()


@register_tier
class MemoryTier(Tier):
    """``mem://?max=2GB``: a put past ``max_bytes`` evicts the least recently used states first; a
    state larger than the whole tier is declined. Lost when the process ends."""

    scheme = "mem"

    def __init__(self, name: str = "mem", write: str = "through", max_bytes: int | None = DEFAULT_MAX):
        super().__init__(name, write, max_bytes)
        self._pool = _Pool()   # shared with the tier's tenant parts: one bound for the process
        self._ns = ""          # this part's key prefix: "" (no tenant) or "<tag>/"

    @classmethod
    def from_url(cls, name: str, url: TierURL, write: str, max_bytes: int | None) -> "MemoryTier":
        if url.netloc or url.path not in ("", "/"):
            raise BadInput(f"store URL {url.text!r}: mem:// takes no location, only ?max=SIZE")
        return cls(name, write, DEFAULT_MAX if max_bytes is None else max_bytes)

    def get(self, state_id: str) -> bytes | None:
        key, pool = self._ns + state_id, self._pool
        with pool.lock:
            hit = pool.items.get(key)
            if hit is None:
                return None
            pool.items[key] = (hit[0], time.time())
            pool.items.move_to_end(key)
            return hit[0]

    def put(self, state_id: str, data: bytes) -> bool:
        data = bytes(data)
        if self.max_bytes is not None and len(data) > self.max_bytes:
            return False
        key, pool = self._ns + state_id, self._pool
        with pool.lock:
            old = pool.items.pop(key, None)
            if old is not None:
                pool.bytes -= len(old[0])
            pool.items[key] = (data, time.time())
            pool.bytes += len(data)
            while self.max_bytes is not None and pool.bytes > self.max_bytes:
                _, (blob, _) = pool.items.popitem(last=False)
                pool.bytes -= len(blob)
                self.evictions += 1
        return True

    def delete(self, state_id: str) -> bool:
        pool = self._pool
        with pool.lock:
            old = pool.items.pop(self._ns + state_id, None)
            if old is None:
                return False
            pool.bytes -= len(old[0])
            return True

    def _mine(self) -> list[tuple[str, int]]:
        """(id, bytes) of this part's states (caller holds the lock)."""
        n = len(self._ns)
        return [(k[n:], len(v[0])) for k, v in self._pool.items.items()
                if k.startswith(self._ns) and "/" not in k[n:]]

    def ids(self) -> list[str]:
        with self._pool.lock:
            return [sid for sid, _ in self._mine()]

    def stat(self, state_id: str) -> ObjectStat | None:
        with self._pool.lock:
            hit = self._pool.items.get(self._ns + state_id)
        return None if hit is None else ObjectStat(state_id, len(hit[0]), hit[1])

    def usage(self) -> tuple[int, int]:
        with self._pool.lock:
            mine = self._mine()
        return len(mine), sum(n for _, n in mine)

    def tenant_part(self, tag: str) -> "MemoryTier":
        part = copy.copy(self)
        part._ns, part.tenant = f"{tag}/", tag
        return part

    def describe(self) -> str:
        return f"mem://?max={self.max_bytes}"
