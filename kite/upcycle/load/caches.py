"""What a process remembers of the states it staged, keyed by file version (one identity:
:func:`kite.upcycle.format.file_version`).

* the blobs whose checksums were verified: a later staging of the unchanged file skips hashing them;
* per (version, clusters, layers, geometry) staged: the tables built, and the rebuild graphs and
  device row maps built on them, so that restaging an unchanged file skips building them again;
* the records written for other processes in the background (:func:`flush_records` waits for them).

A file written in place gets a new mtime/ctime and a replaced one a new inode, so either is verified
again. The gap is a change that leaves every field of the version as it was (a write within the same
coarse timestamp tick as the file's previous change, after it was staged or written, and no change
since, or bytes changed behind the file system's back, e.g. bit rot): such a file is not re-hashed
by a load, while ``StateFile.verify()`` / ``kite upcycle inspect --verify`` still check every blob.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kite.upcycle.format.versions import forget_record
from kite.upcycle.load.tables import LayerPlan, forget_tables


@dataclass
class PlanCache:
    """What one (version, clusters, layers, H, d) staging built, for the next staging of it."""

    layers: dict[int, tuple[LayerPlan, np.ndarray]] = field(default_factory=dict)   # plan + its table bytes
    graphs: dict = field(default_factory=dict)
    dest_dev: dict = field(default_factory=dict)


VERIFIED: dict[tuple, set[str]] = {}
PLANS: OrderedDict[tuple, PlanCache] = OrderedDict()
LOCK = threading.Lock()
PLAN_CACHE_SIZE = 32


def plan_entry(ckey: tuple) -> tuple[PlanCache, set[str] | None]:
    """The plan cache of a staging key (made when new; the oldest dropped past PLAN_CACHE_SIZE) and
    a snapshot of the blobs verified for its file version (None: none)."""
    with LOCK:
        verified = VERIFIED.get(ckey[0])
        entry = PLANS.get(ckey)
        if entry is None:
            entry = PLANS[ckey] = PlanCache()
            while len(PLANS) > PLAN_CACHE_SIZE:
                PLANS.popitem(last=False)
        PLANS.move_to_end(ckey)
        return entry, (set(verified) if verified is not None else None)


def forget_verified(path: str | os.PathLike[str] | None = None, *, persisted: bool = True) -> None:
    """Drop the record of verified blobs and the cached tables (of one file, or all).

    ``persisted=False`` keeps the cross-process records and kept tables: what a new process would find.
    """
    flush_records()
    with LOCK:
        if path is None:
            VERIFIED.clear()
            PLANS.clear()
        else:
            p = str(os.path.realpath(path))
            for k in [k for k in VERIFIED if k[0] == p]:
                del VERIFIED[k]
            for k in [k for k in PLANS if k[0][0] == p]:
                del PLANS[k]
    if persisted:
        forget_record(path)
        forget_tables(path)


_RECORDS: list[Future] = []


def record_in_background(fn, *args) -> None:
    """Run ``fn(*args)`` (a cross-process record) off the load's path; :func:`flush_records` waits."""
    _RECORDS[:] = [f for f in _RECORDS if not f.done()]
    _RECORDS.append(pool(1).submit(fn, *args))


def flush_records() -> None:
    """Wait for the cross-process records being written in the background."""
    while _RECORDS:
        _RECORDS.pop().result()


_POOLS: dict[int, ThreadPoolExecutor] = {}


def pool(n: int) -> ThreadPoolExecutor:
    """The process's pool of ``n`` staging threads."""
    if n not in _POOLS:
        _POOLS[n] = ThreadPoolExecutor(n, thread_name_prefix="kite-stage")
    return _POOLS[n]
