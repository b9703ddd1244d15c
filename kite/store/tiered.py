"""The tiered state store: tiers from the fastest (host memory) to the most shared (Redis, S3),
read top-down, hits promoted upward, writes through or back per tier, every object verified.

Reads: each tier in order; a tier that fails (TierError) is counted and skipped; an object that
does not verify (truncated, a bad checksum, an address that is not its name) is counted, deleted
from that tier and looked for further down; the first good copy is returned and written into the
tiers above it (a repair for the ones that held a bad copy). Nothing that fails verification is
ever returned. No good copy anywhere: a miss (the caller prefills and compresses).

Writes: a state is verified before any tier sees it. Write-through tiers are written before
``put`` returns; write-back tiers get it from a background thread. A tier that fails is counted,
and named in the :class:`PutReport` (write-back failures in ``failures`` and at ``flush``); a put
that no tier took raises StoreError. A tier's failed put is also recorded in the store's journal of
missed writes (:mod:`kite.store.journal`); after a later put reaches that tier, the states it missed
are copied into it from the tiers that hold them (:meth:`TieredStore.retry_missed`).

Tenants: :meth:`TieredStore.for_tenant` is the store of one tenant, every tier's tenant part
(:meth:`kite.store.Tier.tenant_part`); it takes and returns only states whose address was made for
that tenant, so a state of another tenant (or of none) is neither listed, found nor stored there.
It shares the store's journal: a tenant part's missed writes are kept under that part's key
(:func:`kite.store.journal.journal_key`), so a retry or a sync copies them within the tenant's part.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kite.atomic import write_bytes
from kite.errors import KiteError
from kite.store.counters import StoreCounters
from kite.store.journal import MissedWrites, journal_key
from kite.store.tier import Tier, TierError
from kite.store.verify import CorruptState, StateInfo, WrongTenant, read_state_file, verify_state
from kite.tenants import tenant_tag

_FAILURES_KEPT = 100


class StoreError(KiteError):
    """The store could not do what was asked (no tier took a put)."""


@dataclass
class PutReport:
    """Where a put went: tier -> "stored", "declined (...)" (a tier's bound), "queued" (write-back),
    or "failed: why"."""

    id: str
    bytes: int
    tiers: dict[str, str] = field(default_factory=dict)
    already: list[str] = field(default_factory=list)   # tiers that held it before

    @property
    def failed(self) -> dict[str, str]:
        return {t: s for t, s in self.tiers.items() if s.startswith("failed")}

    def to_dict(self) -> dict:
        return {"id": self.id, "bytes": self.bytes, "tiers": self.tiers, "already": self.already,
                "failed": sorted(self.failed)}


class TieredStore:
    """Tiers in order, fastest first. ``counters``: what was counted (shared with /metrics);
    ``journal``: where missed writes are kept (default: in this process only). ``tenant``: the tag
    of the tenant this store holds the states of (None: no tenant; see :meth:`for_tenant`)."""

    def __init__(self, tiers: list[Tier], counters: StoreCounters | None = None,
                 journal: MissedWrites | None = None, *, tenant: str | None = None):
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names repeat: {names}")
        self.tiers = list(tiers)
        self.counters = counters or StoreCounters()
        self.journal = journal if journal is not None else MissedWrites(None)
        self.failures: list[dict] = []   # recent write failures, write-back ones included
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._lock = threading.Lock()
        self.tenant = tenant
        self.tenant_name: str | None = None   # the name the tag was made from (set by for_tenant)
        self._parts: dict[str, TieredStore] = {}   # tag -> the store of that tenant (for_tenant)
        self._root: TieredStore | None = None

    def for_tenant(self, name: str | None) -> "TieredStore":
        """The store of tenant `name` (None: this store without a tenant): the same tiers' tenant parts,
        the same counters and journal, made once per tenant. BadInput for an empty or malformed name."""
        root = self._root or self
        tag = tenant_tag(name)
        if tag is None:
            return root
        with root._lock:
            part = root._parts.get(tag)
            if part is None:
                part = TieredStore([t.tenant_part(tag) for t in root.tiers], root.counters, root.journal,
                                   tenant=tag)
                part._root, part.tenant_name = root, name
                root._parts[tag] = part
        return part

    def _check(self, data: bytes, state_id: str | None, where: str) -> StateInfo:
        """verify_state, and the state's address made for this store's tenant (CorruptState when read
        back from a tier, WrongTenant when given to put)."""
        info = verify_state(data, state_id, where)
        if state_id is None:
            self.check_tenant_of(info, where)
        elif info.tenant != self.tenant:
            raise CorruptState(f"{where}: holds a state made for "
                               + ("no tenant" if info.tenant is None else "another tenant"))
        return info

    def check_tenant_of(self, info: StateInfo, where: str = "state") -> None:
        """WrongTenant (one line, exit 2) unless the verified state `info` was made for this store's
        tenant: states are filed per tenant, so another's (or an untenanted one) is not put here."""
        if info.tenant != self.tenant:
            whose = "no tenant" if info.tenant is None else "another tenant"
            mine = "no tenant" if self.tenant is None else f"tenant {self.tenant_name}"
            raise WrongTenant(f"{where}: state {info.id[:16]}... was made for {whose}, not for {mine}: "
                              f"compress the document again for this tenant (--tenant)")

    # ------------------------------------------------------------------ reads

    def get(self, state_id: str) -> bytes | None:
        """The verified bytes of the state, or None (a miss in every tier)."""
        found = self._find(state_id)
        return None if found is None else found[0]

    def _find(self, state_id: str) -> tuple[bytes, StateInfo, Tier] | None:
        for i, tier in enumerate(self.tiers):
            try:
                data = tier.get(state_id)
            except TierError:
                self.counters.error(tier.name, "get")
                continue
            if data is None:
                continue
            try:
                info = self._check(data, state_id, f"{tier.name} {state_id[:16]}")
            except CorruptState:
                self.counters.error(tier.name, "verify")
                self._drop(tier, state_id)
                continue
            self.counters.hit(tier.name)
            for upper in self.tiers[:i]:
                self._write(upper, state_id, data, "promote")
            return data, info, tier
        self.counters.miss()
        return None

    def _drop(self, tier: Tier, state_id: str) -> None:
        try:
            tier.delete(state_id)
        except TierError:
            self.counters.error(tier.name, "delete")

    def get_file(self, state_id: str, dest: str | Path) -> StateInfo | None:
        """Write the verified state to `dest` (atomically); its info, or None on a miss."""
        found = self.fetch_file(state_id, dest)
        return None if found is None else found[0]

    def fetch_file(self, state_id: str, dest: str | Path) -> tuple[StateInfo, str] | None:
        """:meth:`get_file`, also naming the tier that answered; None on a miss."""
        found = self._find(state_id)
        if found is None:
            return None
        write_bytes(dest, found[0])
        return found[1], found[2].name

    def where(self, state_id: str) -> list[str]:
        """The tiers holding an object of that id (by their index; not read or verified)."""
        out = []
        for tier in self.tiers:
            try:
                st = tier.stat(state_id)
            except TierError:
                self.counters.error(tier.name, "stat")
                continue
            if st is not None and st.held:
                out.append(tier.name)
        return out

    def contains(self, state_id: str) -> bool:
        return bool(self.where(state_id))

    # ------------------------------------------------------------------ writes

    def put(self, data: bytes) -> PutReport:
        """Verify the state, then store it under its address in every tier (see the module doc)."""
        info = self._check(data, None, "state")
        report = PutReport(info.id, len(data), already=self.where(info.id))
        for tier in self.tiers:
            if tier.write == "back":
                self._enqueue(tier, info.id, data)
                report.tiers[tier.name] = "queued"
            else:
                report.tiers[tier.name] = self._write(tier, info.id, data, "put")
        if report.tiers and all(s.startswith("failed") for s in report.tiers.values()):
            raise StoreError(f"no store tier took state {info.id[:16]}...: "
                             + "; ".join(f"{t} {s}" for t, s in report.tiers.items()))
        return report

    def put_file(self, path: str | Path) -> PutReport:
        data, _ = read_state_file(path)
        return self.put(data)

    def _write(self, tier: Tier, state_id: str, data: bytes, op: str) -> str:
        if op == "promote" and tier.write == "back":
            self._enqueue(tier, state_id, data, op)
            return "queued"
        try:
            stored = tier.put(state_id, data)
        except TierError as exc:
            self.counters.error(tier.name, op)
            self._remember(tier.name, op, state_id, exc.why)
            if op == "put":
                self.journal.add(journal_key(tier), state_id, exc.why)
            return f"failed: {exc.why}"
        self.counters.put(tier.name, stored)
        if op == "put":
            self.retry_missed(tier, besides=state_id)
        return "stored" if stored else "declined (past the tier's size bound)"

    def _remember(self, tier: str, op: str, state_id: str, why: str) -> None:
        with self._lock:
            self.failures.append({"tier": tier, "op": op, "id": state_id, "why": why, "at": time.time()})
            del self.failures[:-_FAILURES_KEPT]

    def _enqueue(self, tier: Tier, state_id: str, data: bytes, op: str = "put") -> None:
        with self._lock:
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._drain, name="kite-store-write-back", daemon=True)
                self._writer.start()
        self._queue.put((tier, state_id, data, op))

    def _drain(self) -> None:
        while True:
            tier, state_id, data, op = self._queue.get()
            try:
                if tier is not None:
                    try:
                        stored = tier.put(state_id, data)
                        self.counters.put(tier.name, stored)
                    except TierError as exc:
                        self.counters.error(tier.name, op)
                        self._remember(tier.name, op, state_id, exc.why)
                        if op == "put":
                            self.journal.add(journal_key(tier), state_id, exc.why)
                    else:
                        if op == "put":
                            self.retry_missed(tier, besides=state_id)
            finally:
                self._queue.task_done()

    def good_copy(self, state_id: str, besides: Tier | None = None,
                  unsure: list | None = None) -> tuple[bytes, Tier] | None:
        """The first copy of the state that verifies, from the tiers but ``besides`` (no promotion);
        None when none holds one. A bad copy is counted and left for a read to repair. ``unsure``:
        the names of tiers that failed to answer are appended to it (None may then mean "not
        known")."""
        for tier in self.tiers:
            if tier is besides:
                continue
            try:
                data = tier.get(state_id)
            except TierError:
                self.counters.error(tier.name, "get")
                if unsure is not None:
                    unsure.append(tier.name)
                continue
            if data is None:
                continue
            try:
                self._check(data, state_id, f"{tier.name} {state_id[:16]}")
            except CorruptState:
                self.counters.error(tier.name, "verify")
                continue
            return data, tier
        return None

    def retry_missed(self, tier: Tier, besides: str | None = None) -> dict[str, str]:
        """Copy into ``tier`` the states its journal says it missed (it took a put just now, so it is
        back), from the tiers that hold them; id -> "stored", "declined (...)", "failed: why" or
        "no copy" (no other tier holds a good one: the entry is dropped, unless a tier did not
        answer). ``besides``: an id the caller has just stored there."""
        url = journal_key(tier)
        out: dict[str, str] = {}
        for missed in self.journal.pending(url):
            sid = missed.id
            if sid == besides:
                self.journal.done(url, sid)
                continue
            unsure: list[str] = []
            found = self.good_copy(sid, besides=tier, unsure=unsure)
            if found is None:
                if not unsure:   # no tier holds it now (deleted, evicted): nothing to copy
                    self.journal.done(url, sid)
                out[sid] = "no copy" + (f" (tiers {', '.join(unsure)} did not answer)" if unsure else "")
                continue
            try:
                stored = tier.put(sid, found[0])
            except TierError as exc:
                self.counters.error(tier.name, "put")
                self.journal.add(url, sid, exc.why)
                out[sid] = f"failed: {exc.why}"
                break   # down again: the rest waits for the next put or sync
            self.counters.put(tier.name, stored)
            self.journal.done(url, sid)
            out[sid] = "stored" if stored else "declined (past the tier's size bound)"
        return out

    def flush(self) -> list[dict]:
        """Wait for the write-back queue to empty; the write failures recorded so far."""
        if self._writer is not None:
            self._queue.join()
        with self._lock:
            parts = list(self._parts.values())
        late = [f for part in parts for f in part.flush()]
        with self._lock:
            return list(self.failures) + late

    # ------------------------------------------------------------------ management

    def delete(self, state_id: str) -> dict[str, bool]:
        out = {}
        for tier in self.tiers:
            try:
                out[tier.name] = tier.delete(state_id)
            except TierError:
                self.counters.error(tier.name, "delete")
                out[tier.name] = False
        return out

    def ids(self) -> dict[str, list[str]]:
        """Every id any tier holds -> the tiers holding it (a tier that fails to list is counted)."""
        out: dict[str, list[str]] = {}
        for tier in self.tiers:
            try:
                held = tier.ids()
            except TierError:
                self.counters.error(tier.name, "list")
                continue
            for sid in held:
                out.setdefault(sid, []).append(tier.name)
        return dict(sorted(out.items()))

    def gc(self) -> dict[str, list[str]]:
        """Evict every bounded tier to its bound; the ids each dropped."""
        out = {}
        for tier in self.tiers:
            try:
                out[tier.name] = tier.evict()
            except TierError:
                self.counters.error(tier.name, "evict")
                out[tier.name] = []
        return out

    def stats(self) -> dict:
        """Per tier: URL, write policy, bound, objects and bytes held, hits, puts, errors, evictions,
        writes it missed still in the journal;
        and the store's misses. A tier that cannot be reached says so (its usage is null)."""
        snap = self.counters.snapshot()
        tiers = []
        for tier in self.tiers:
            try:
                count, used = tier.usage()
                reach = None
            except TierError as exc:
                self.counters.error(tier.name, "stat")
                count, used, reach = None, None, exc.why
            tiers.append({"name": tier.name, "url": tier.describe(), "write": tier.write,
                          "max_bytes": tier.max_bytes, "objects": count, "bytes": used, "error": reach,
                          "hits": snap["hits"].get(tier.name, 0), "puts": snap["puts"].get(tier.name, 0),
                          "declined": snap["skipped"].get(tier.name, 0), "evictions": tier.evictions,
                          "missed": len(self.journal.pending(journal_key(tier))),
                          "errors": {e["op"]: e["count"] for e in snap["errors"] if e["tier"] == tier.name}})
        return {"tiers": tiers, "misses": snap["misses"], "recent_failures": self.failures[-10:]}

    def close(self) -> None:
        """Finish queued write-backs (the tenants' too), then close the tiers (a tenant's store closes
        nothing: its tiers share their connections with the store it came from)."""
        self.flush()
        if self._root is not None:
            return
        for tier in self.tiers:
            tier.close()
