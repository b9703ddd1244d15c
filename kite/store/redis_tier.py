"""Redis: a shared tier for the index of states and the smaller states themselves (redis-py).

Keys under a prefix (``kite`` by default): ``<prefix>:state:<id>`` the state's bytes,
``<prefix>:index`` a hash id -> JSON (bytes, held), ``<prefix>:used`` a sorted set id -> last use
(s). A state larger than ``max_value`` (default 32 MB) is not stored, only indexed with
``held: false``, so every replica still learns it exists (and fetches it from a lower tier). With
Redis' own persistence (appendonly) the tier survives a restart; ``rebuild_index`` rebuilds the
index from the stored states' headers if it was lost.
"""

from __future__ import annotations

import copy
import json
import time

from kite.errors import BadInput
from kite.store.tier import ObjectStat, Tier, TierError, TierURL, parse_size, register_tier

DEFAULT_MAX_VALUE = 32 * 10**6


@register_tier
class RedisTier(Tier):
    """``redis://host:port/db?max_value=32MB&prefix=kite&max=4GB`` (``rediss://`` for TLS)."""

    scheme = "redis"
    params = ("max_value", "prefix", "timeout")

    def __init__(self, url: str, name: str = "redis", write: str = "through", max_bytes: int | None = None,
                 max_value: int = DEFAULT_MAX_VALUE, prefix: str = "kite", timeout_s: float = 2.0):
        super().__init__(name, write, max_bytes)
        try:
            import redis
        except ImportError:
            raise BadInput("redis:// store tiers need the redis package: pip install 'kite[store]'") from None
        self._errors = redis.exceptions.RedisError
        self._url = url
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.max_value, self.prefix = max_value, prefix
        self._index, self._used = f"{prefix}:index", f"{prefix}:used"

    @classmethod
    def from_url(cls, name: str, url: TierURL, write: str, max_bytes: int | None) -> "RedisTier":
        p = url.params
        max_value = parse_size(p["max_value"], "max_value") if "max_value" in p else DEFAULT_MAX_VALUE
        try:
            timeout = float(p.get("timeout", "2"))
        except ValueError:
            raise BadInput(f"store URL {url.text!r}: timeout={p['timeout']!r} is not a number of seconds") from None
        if not url.netloc:
            raise BadInput(f"store URL {url.text!r}: redis:// needs host:port")
        return cls(f"{url.scheme}://{url.netloc}{url.path}", name, write, max_bytes, max_value,
                   p.get("prefix", "kite"), timeout)

    def _key(self, state_id: str) -> str:
        return f"{self.prefix}:state:{state_id}"

    def _call(self, op: str, fn):
        try:
            return fn()
        except self._errors as exc:
            raise TierError(self.name, op, f"{type(exc).__name__}: {str(exc)[:160]}") from None

    def get(self, state_id: str) -> bytes | None:
        data = self._call("get", lambda: self.client.get(self._key(state_id)))
        if data is not None:
            self._call("get", lambda: self.client.zadd(self._used, {state_id: time.time()}))
        return data

    def put(self, state_id: str, data: bytes) -> bool:
        held = len(data) <= self.max_value
        entry = json.dumps({"bytes": len(data), "held": held})

        def write():
            pipe = self.client.pipeline(transaction=True)
            if held:
                pipe.set(self._key(state_id), bytes(data))
                pipe.zadd(self._used, {state_id: time.time()})
            pipe.hset(self._index, state_id, entry)
            pipe.execute()

        self._call("put", write)
        if held and self.max_bytes is not None:
            self.evict()
        return held

    def delete(self, state_id: str) -> bool:
        def drop():
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self._key(state_id))
            pipe.zrem(self._used, state_id)
            pipe.hdel(self._index, state_id)
            return pipe.execute()

        removed, _, unindexed = self._call("delete", drop)
        return bool(removed or unindexed)

    def _entries(self) -> dict[str, dict]:
        raw = self._call("list", lambda: self.client.hgetall(self._index))
        out = {}
        for key, value in raw.items():
            try:
                out[key.decode()] = json.loads(value)
            except ValueError:
                continue
        return out

    def ids(self) -> list[str]:
        return sorted(i for i, e in self._entries().items() if e.get("held"))

    def indexed(self) -> dict[str, dict]:
        """Every id the index knows, held here or not, with its entry."""
        return self._entries()

    def stat(self, state_id: str) -> ObjectStat | None:
        raw = self._call("stat", lambda: self.client.hget(self._index, state_id))
        if raw is None:
            return None
        entry = json.loads(raw)
        used = self._call("stat", lambda: self.client.zscore(self._used, state_id))
        return ObjectStat(state_id, int(entry.get("bytes", 0)), used, bool(entry.get("held")))

    def usage(self) -> tuple[int, int]:
        held = [e for e in self._entries().values() if e.get("held")]
        return len(held), sum(int(e.get("bytes", 0)) for e in held)

    def evict(self) -> list[str]:
        if self.max_bytes is None:
            return []
        entries = self._entries()
        total = sum(int(e.get("bytes", 0)) for e in entries.values() if e.get("held"))
        order = self._call("evict", lambda: self.client.zrange(self._used, 0, -1))
        dropped = []
        for raw in order:
            if total <= self.max_bytes:
                break
            sid = raw.decode()
            size = int(entries.get(sid, {}).get("bytes", 0))
            self.delete(sid)
            total -= size
            dropped.append(sid)
            self.evictions += 1
        return dropped

    def rebuild_index(self) -> int:
        """Index every stored state again from its own header (after the index was lost); the count."""
        from kite.upcycle import check_address, format as upc_format

        n = 0
        for key in self._call("list", lambda: list(self.client.scan_iter(match=f"{self.prefix}:state:*"))):
            sid = key.decode().rsplit(":", 1)[-1]
            data = self._call("get", lambda k=key: self.client.get(k))
            if data is None:
                continue
            try:
                meta, version = upc_format.check_state_bytes(data, f"redis {sid}")
                ok = check_address(meta, version) == sid
            except BadInput:
                ok = False
            if ok:
                self._call("put", lambda: self.client.hset(self._index, sid, json.dumps({"bytes": len(data),
                                                                                        "held": True})))
                n += 1
        return n

    def tenant_part(self, tag: str) -> "RedisTier":
        """The tenant's keys under ``<prefix>:tenant:<tag>`` (its own index, recency and bound), on the
        same connection."""
        part = copy.copy(self)
        part.prefix, part.tenant = f"{self.prefix}:tenant:{tag}", tag
        part._index, part._used = f"{part.prefix}:index", f"{part.prefix}:used"
        return part

    def describe(self) -> str:
        host = self._url.split("@")[-1]   # no password
        return f"redis://{host.split('://')[-1]}?max_value={self.max_value}&prefix={self.prefix}"

    def close(self) -> None:
        try:
            self.client.close()
        except self._errors:
            pass
