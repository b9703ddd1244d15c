"""One tier of the state store: the interface every tier implements, and the registry of tiers by
URL scheme (``mem``, ``file``, ``redis``, ``s3``).

A tier holds whole states as bytes under their content address. It does not verify them: the
:class:`kite.store.TieredStore` above verifies every object it reads, from every tier, the same way.
A tier's failure (a server down, an S3 error, a full disk) is a :class:`TierError`; a tier that
declines an object by its own bound (a state larger than the whole tier, or than Redis' value
limit) returns False from ``put``: that is policy, not a failure.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from kite.errors import BadInput, KiteError

WRITE_POLICIES = ("through", "back")


class MissingStore(BadInput):
    """A store opened for reading names a place that does not exist (a file:// tier's folder)."""


class TierError(KiteError):
    """A tier failed an operation (its backend is down, refused, or the disk is full)."""

    def __init__(self, tier: str, op: str, why: str):
        super().__init__(f"store tier {tier}: {op} failed: {why}")
        self.tier, self.op, self.why = tier, op, why


@dataclass(frozen=True, slots=True)
class ObjectStat:
    """What a tier knows of one object without reading it: its size in bytes and, where the tier
    keeps one, the time of its last use (s since the epoch)."""

    id: str
    bytes: int
    used: float | None = None
    held: bool = True   # False: only an index entry (Redis, a state past its value limit)


class Tier(ABC):
    """Whole states by content address. ``name``: the tier's label in counters and metrics;
    ``write``: ``through`` (a put waits for this tier) or ``back`` (queued, written by a background
    thread); ``max_bytes``: the bound ``evict`` keeps (None: unbounded)."""

    scheme: ClassVar[str]
    # URL query parameters this tier takes besides `max` and `write`
    params: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str, write: str = "through", max_bytes: int | None = None):
        if write not in WRITE_POLICIES:
            raise BadInput(f"store tier {name}: write={write!r}, expected one of {', '.join(WRITE_POLICIES)}")
        self.name, self.write, self.max_bytes = name, write, max_bytes
        self._evicted = [0]   # shared with the tier's tenant parts: one count for the operator
        self.tenant: str | None = None   # the tag of the tenant this part holds (tenant_part); None: none
        # whether a place this tier misses (a tenant's folder of a file:// tier) is made when the tier
        # opens (True) or only when a state is written there (False: a store opened to read,
        # ``open_store(create=False)``); its tenant parts take it on
        self.create = True

    @property
    def evictions(self) -> int:
        """Objects dropped to keep within max_bytes, by this tier and its tenant parts (read by the
        store's stats and /metrics)."""
        return self._evicted[0]

    @evictions.setter
    def evictions(self, n: int) -> None:
        self._evicted[0] = n

    @abstractmethod
    def get(self, state_id: str) -> bytes | None:
        """The object's bytes, or None when this tier does not hold it. TierError on failure."""

    @abstractmethod
    def put(self, state_id: str, data: bytes) -> bool:
        """Store the object (replacing one of the same id). False: declined by the tier's bound."""

    @abstractmethod
    def delete(self, state_id: str) -> bool:
        """Remove the object; False when it was not there."""

    @abstractmethod
    def ids(self) -> list[str]:
        """The ids this tier holds."""

    @abstractmethod
    def stat(self, state_id: str) -> ObjectStat | None:
        """Size (and last use) of one object without reading it; None when not held."""

    @abstractmethod
    def tenant_part(self, tag: str) -> "Tier":
        """This tier's part for the tenant of ``tag`` (:func:`kite.tenants.tenant_tag`): the same
        backend (connection, folder, bucket) with the tenant's states under keys of their own, which
        this tier's own ``get``, ``ids`` and ``stat`` never reach, nor another tenant's part
        (docs/store.md, "Tenants"). The part's ``tenant`` is ``tag``; it keeps this tier's ``create``."""

    def usage(self) -> tuple[int, int]:
        """(objects, bytes) held now."""
        stats = [s for s in (self.stat(i) for i in self.ids()) if s is not None and s.held]
        return len(stats), sum(s.bytes for s in stats)

    def evict(self) -> list[str]:
        """Drop least recently used objects until the tier is within ``max_bytes``; the ids dropped."""
        if self.max_bytes is None:
            return []
        stats = [s for s in (self.stat(i) for i in self.ids()) if s is not None and s.held]
        total = sum(s.bytes for s in stats)
        dropped = []
        for s in sorted(stats, key=lambda s: (s.used or 0.0, s.id)):
            if total <= self.max_bytes:
                break
            if self.delete(s.id):
                total -= s.bytes
                dropped.append(s.id)
                self.evictions += 1
        return dropped

    @classmethod
    def absent(cls, url: "TierURL") -> str | None:
        """Why the place a URL names for this tier does not exist (a missing folder), in words; None
        where it does or the tier cannot tell without connecting. A store opened not to create its
        places (``open_store(create=False)``: the read commands) refuses such a tier."""
        return None

    def describe(self) -> str:
        """The tier as a URL-like line (no secrets)."""
        return f"{self.scheme}://"

    def close(self) -> None:
        """Release connections (a no-op where there are none)."""

    @classmethod
    @abstractmethod
    def from_url(cls, name: str, url: "TierURL", write: str, max_bytes: int | None) -> "Tier":
        """The tier a store URL describes (BadInput for a bad one)."""


_REGISTRY: dict[str, type[Tier]] = {}


def register_tier(cls: type[Tier]) -> type[Tier]:
    """Class decorator: make a Tier available under its ``scheme`` in store URLs."""
    _REGISTRY[cls.scheme] = cls
    return cls


# other spellings of a registered scheme
_ALIASES = {"rediss": "redis"}


def tier_class(scheme: str) -> type[Tier]:
    cls = _REGISTRY.get(_ALIASES.get(scheme, scheme))
    if cls is None:
        raise BadInput(f"store URL scheme {scheme!r}: expected one of {', '.join(sorted(_REGISTRY))}")
    return cls


def tier_schemes() -> list[str]:
    return sorted(_REGISTRY)


@dataclass(frozen=True, slots=True)
class TierURL:
    """One tier's URL taken apart: scheme, the location (netloc + path, as the tier reads it),
    the raw netloc and path, and the query parameters."""

    text: str
    scheme: str
    netloc: str
    path: str
    params: dict[str, str]


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, what: str) -> int:
    """Bytes of a size written `2GB`, `500MB`, `1.5GiB` or a plain number of bytes (BadInput otherwise)."""
    m = _SIZE.match(text or "")
    if not m:
        raise BadInput(f"{what}={text!r}: expected a size such as 2GB, 512MB, 1GiB or a number of bytes")
    n = float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()]
    if n < 1:
        raise BadInput(f"{what}={text!r}: a size is at least 1 byte")
    return int(n)
