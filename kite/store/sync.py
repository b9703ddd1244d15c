"""`kite store sync`: copy into each tier the states it misses from the tiers that hold them, e.g.
after Redis or S3 was down while states were put (docs/store.md, "Missed writes and sync").

Every tier is listed; a state some tier holds and a target tier does not is read from a tier that
holds it, verified (its bytes and address, as every read), and put into the target. The journal's
entries of missed writes (:mod:`kite.store.journal`) are retried on the way and dropped once the
tier holds the state. Running it again copies nothing: it is idempotent. A ``mem://`` tier is never
a target (it lives as long as this process); a tier that cannot be listed is reported unreachable,
not written; a state a Redis tier indexes without holding (past its value limit) is not missed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kite.errors import BadInput
from kite.store.journal import journal_key
from kite.store.tier import TierError
from kite.store.tiered import TieredStore

Progress = Callable[[str, int, int], None]


@dataclass
class SyncReport:
    """Per target tier: what it held before, what was copied into it, declined by its bound, failed
    (why), or had no good copy anywhere; ``unreachable``: tiers that could not be listed (why)."""

    tiers: dict[str, dict] = field(default_factory=dict)
    copied: list[dict] = field(default_factory=list)       # {"id", "from", "to"}
    failed: list[dict] = field(default_factory=list)       # {"id", "to", "why"}
    declined: list[dict] = field(default_factory=list)     # {"id", "to"}
    no_copy: list[dict] = field(default_factory=list)      # {"id", "to", "unanswered": tiers that failed to answer}
    unreachable: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"tiers": self.tiers, "copied": self.copied, "failed": self.failed, "declined": self.declined,
                "no_copy": self.no_copy, "unreachable": self.unreachable}


def sync_store(store: TieredStore, to: list[str] | None = None, progress: Progress | None = None) -> SyncReport:
    """Copy into each target tier (``to``: names; default every tier but ``mem``) the states another
    tier holds and it does not. See the module doc."""
    names = [t.name for t in store.tiers]
    if to is not None:
        unknown = [n for n in to if n not in names]
        if unknown:
            raise BadInput(f"--to {unknown[0]}: no such tier in this store (its tiers: {', '.join(names)})")
    targets = [t for t in store.tiers if (t.name in to if to is not None else t.scheme != "mem")]
    report = SyncReport()
    held: dict[str, set[str]] = {}
    for tier in store.tiers:
        try:
            held[tier.name] = set(tier.ids())
        except TierError as exc:
            store.counters.error(tier.name, "list")
            report.unreachable[tier.name] = exc.why
    everything = set().union(*held.values()) if held else set()
    work: list[tuple] = []
    for tier in targets:
        if tier.name not in held:
            continue
        url = journal_key(tier)
        for missed in store.journal.pending(url):
            if missed.id in held[tier.name] or missed.id not in everything:
                store.journal.done(url, missed.id)   # it got there another way, or no tier holds it now
        missing = sorted(everything - held[tier.name])
        indexed_only = set()
        for sid in missing:
            try:
                st = tier.stat(sid)
            except TierError:
                st = None
            if st is not None and not st.held:
                indexed_only.add(sid)
        todo = [sid for sid in missing if sid not in indexed_only]
        report.tiers[tier.name] = {"url": tier.describe(), "held_before": len(held[tier.name]), "missing": len(todo),
                                   "copied": 0, "failed": 0, "declined": 0, "no_copy": 0}
        work.extend((tier, sid) for sid in todo)
    total = len(work)
    if progress:
        progress("sync", 0, total)
    down: set[str] = set()
    for done, (tier, sid) in enumerate(work, 1):
        row = report.tiers[tier.name]
        url = journal_key(tier)
        if tier.name in down:
            report.failed.append({"id": sid, "to": tier.name, "why": "not tried: the tier failed earlier in this sync"})
            row["failed"] += 1
        else:
            _copy(store, tier, sid, url, report, row, down)
        if progress:
            progress("sync", done, total)
    return report


def _copy(store: TieredStore, tier, sid: str, url: str, report: SyncReport, row: dict, down: set[str]) -> None:
    unsure: list[str] = []
    found = store.good_copy(sid, besides=tier, unsure=unsure)
    if found is None:
        report.no_copy.append({"id": sid, "to": tier.name, "unanswered": unsure})
        row["no_copy"] += 1
        return
    data, source = found
    try:
        stored = tier.put(sid, data)
    except TierError as exc:
        store.counters.error(tier.name, "put")
        store.journal.add(url, sid, exc.why)
        report.failed.append({"id": sid, "to": tier.name, "why": exc.why})
        row["failed"] += 1
        down.add(tier.name)
        return
    store.counters.put(tier.name, stored)
    store.journal.done(url, sid)
    if stored:
        report.copied.append({"id": sid, "from": source.name, "to": tier.name})
        row["copied"] += 1
    else:
        report.declined.append({"id": sid, "to": tier.name})
        row["declined"] += 1
