"""Missed writes: states a tier failed to take (it was down), kept so that they reach it once it is
back. A put (through or back) that fails in a tier records (tier, id) here; the store retries a
tier's entries after a later put reaches that tier, and `kite store sync` retries them all
(docs/store.md, "Missed writes and sync").

The journal is a small SQLite file beside the store's first ``file://`` tier (``.kite-missed.sqlite``
in its folder: the copy a retry reads lives there), else ``$KITE_HOME/store-missed.sqlite``. A
tier is named by its name in the store and its URL without secrets (:func:`journal_key`), so another
process of the same store drains what this one recorded; a tenant's part of a tier is named with
the tenant's tag, in the journal of the store it is part of. Reads never create the file.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

JOURNAL_NAME = ".kite-missed.sqlite"

_SCHEMA = ("CREATE TABLE IF NOT EXISTS missed (tier TEXT NOT NULL, id TEXT NOT NULL, why TEXT NOT NULL, "
           "first_at REAL NOT NULL, last_at REAL NOT NULL, attempts INTEGER NOT NULL, PRIMARY KEY (tier, id))")


@dataclass(frozen=True, slots=True)
class Missed:
    """One write a tier missed: the tier's URL, the state's id, why (the last failure), when it was
    first and last tried, and how many times."""

    tier: str
    id: str
    why: str
    first_at: float
    last_at: float
    attempts: int

    def to_dict(self) -> dict:
        return {"tier": self.tier, "id": self.id, "why": self.why, "first_at": self.first_at,
                "last_at": self.last_at, "attempts": self.attempts}


class MissedWrites:
    """The journal at ``path`` (None: kept in this process only)."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path is not None else None
        self._mem: dict[tuple[str, str], Missed] = {}
        self._lock = threading.Lock()

    def _connect(self, create: bool) -> sqlite3.Connection | None:
        if self.path is None or (not create and not self.path.exists()):
            return None
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=10.0)
        db.execute(_SCHEMA)
        return db

    def add(self, tier: str, state_id: str, why: str) -> None:
        """Record (or count again) a write of ``state_id`` that ``tier`` missed."""
        now = time.time()
        with self._lock:
            if self.path is None:
                old = self._mem.get((tier, state_id))
                self._mem[(tier, state_id)] = Missed(tier, state_id, why, old.first_at if old else now, now,
                                                     (old.attempts if old else 0) + 1)
                return
            try:
                db = self._connect(create=True)
            except (OSError, sqlite3.Error):
                return   # nowhere to record it: `kite store sync` still finds the gap by listing
            with db:
                db.execute("INSERT INTO missed VALUES (?, ?, ?, ?, ?, 1) ON CONFLICT (tier, id) DO UPDATE SET "
                           "why = excluded.why, last_at = excluded.last_at, attempts = attempts + 1",
                           (tier, state_id, why, now, now))
            db.close()

    def pending(self, tier: str | None = None) -> list[Missed]:
        """The writes still missed (of one tier when given), oldest first."""
        with self._lock:
            if self.path is None:
                rows = [m for m in self._mem.values() if tier is None or m.tier == tier]
                return sorted(rows, key=lambda m: (m.first_at, m.tier, m.id))
            try:
                db = self._connect(create=False)
            except (OSError, sqlite3.Error):
                return []
            if db is None:
                return []
            with db:
                q = "SELECT tier, id, why, first_at, last_at, attempts FROM missed"
                rows = db.execute(q + " WHERE tier = ? ORDER BY first_at, id", (tier,)).fetchall() if tier \
                    else db.execute(q + " ORDER BY first_at, tier, id").fetchall()
            db.close()
            return [Missed(*r) for r in rows]

    def done(self, tier: str, state_id: str) -> None:
        """The tier holds the state now: forget the entry."""
        with self._lock:
            if self.path is None:
                self._mem.pop((tier, state_id), None)
                return
            try:
                db = self._connect(create=False)
            except (OSError, sqlite3.Error):
                return
            if db is None:
                return
            with db:
                db.execute("DELETE FROM missed WHERE tier = ? AND id = ?", (tier, state_id))
            db.close()


def journal_key(tier) -> str:
    """How the journal names a tier: its name in the store and its URL without secrets, and for a
    tenant's part of a tier (:meth:`kite.store.Tier.tenant_part`) the tenant's tag, so its entries are
    retried and synced within that part only."""
    tenant = getattr(tier, "tenant", None)
    return f"{tier.name} {tier.describe()}" + (f" tenant={tenant}" if tenant else "")


def journal_for(tiers) -> MissedWrites:
    """The journal of a store of these tiers: beside its first file:// tier's folder, else in KITE_HOME."""
    for tier in tiers:
        folder = getattr(tier, "folder", None)
        if folder is not None:
            return MissedWrites(Path(folder) / JOURNAL_NAME)
    from kite.paths import kite_home

    return MissedWrites(kite_home() / "store-missed.sqlite")
