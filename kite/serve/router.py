"""Which replica answers a request: the state-aware routing policy, free of Ray (tested alone).

A request that names a state (`kite.state`, or `kite.document`, whose content id the ingress
computes) goes to a replica that holds that state hot (its prefix cache), unless that replica's
queue is longer than the least loaded one's by more than ``max_imbalance`` requests. Otherwise,
and for requests without a state, the least loaded replica (fewest requests queued or running)
answers. Ties are broken by rendezvous hashing: the highest ``sha256(key, replica id)`` wins, so a
cold state has a stable home (the next request about it finds it hot there) and states spread
evenly over replicas; a request without a state hashes its request id instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_MAX_IMBALANCE = 4   # queued requests a state's holder may exceed the least loaded by


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router knows of one replica: its id, the state ids it holds hot, its queue."""

    id: str
    hot: frozenset[str] = field(default_factory=frozenset)
    queued: int = 0


def rendezvous(key: str, replica_id: str) -> int:
    """The tie-break score of `replica_id` for `key` (highest wins): the same on every process."""
    return int.from_bytes(hashlib.sha256(f"{key}\0{replica_id}".encode()).digest()[:8], "big")


def rank(key: str | None, replicas: Sequence[ReplicaView], *, tiebreak: str = "",
         max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> list[str]:
    """Replica ids, most preferred first (the first is where the request goes when it can take it).

    ``key``: the request's state id (None: no state). ``tiebreak``: what a request without a state
    hashes (its request id). Holders of ``key`` whose queue is within ``max_imbalance`` of the
    least loaded replica come first (fewest queued, then rendezvous); then everyone else by
    load, then rendezvous."""
    if not replicas:
        return []
    h = key if key is not None else tiebreak
    least = min(r.queued for r in replicas)

    def order(r: ReplicaView) -> tuple:
        return (r.queued, -rendezvous(h, r.id))

    holders = [r for r in replicas if key is not None and key in r.hot and r.queued - least <= max_imbalance]
    rest = [r for r in replicas if r not in holders]
    return [r.id for r in sorted(holders, key=order)] + [r.id for r in sorted(rest, key=order)]


def route_key(body: dict | None, fingerprint: str | None) -> str | None:
    """The state a request body (a completion, chat or state upload) is about: `kite.state`, or the
    content id of `kite.document` / an upload's `document` (``fingerprint``: the served model's,
    as `GET /v1/models` gives it); None when the body names none."""
    if not isinstance(body, dict):
        return None
    opts = body.get("kite") if isinstance(body.get("kite"), dict) else body
    state = opts.get("state") if opts is not body else body.get("id")
    if isinstance(state, str) and state:
        return state
    doc = opts.get("document")
    if isinstance(doc, str) and doc and fingerprint:
        from kite.serve.states import StateStore

        return StateStore.id_for(doc, fingerprint)
    return None


def hot_ids(paths: Iterable[str], folder_root) -> frozenset[str]:
    """State ids of the `.upc` files among ``paths`` that lie directly in ``folder_root``."""
    from pathlib import Path

    out = set()
    for p in paths:
        p = Path(p)
        if p.suffix == ".upc" and p.parent == folder_root:
            out.add(p.stem)
    return frozenset(out)


def hot_states(srv) -> frozenset[str]:
    """The state ids a server (its `kite.serve.app.ServerState`) holds hot, what a replica reports
    to the router: those whose loaded KV its prefix cache keeps, and those in its shared store's
    memory tier (bytes in host memory, no fetch needed)."""
    from kite.store import MemoryTier

    hot = set(hot_ids(srv.runner.prefixes.held_paths(), srv.store.root))
    shared = getattr(srv.store, "shared", None)
    for tier in getattr(shared, "tiers", ()):
        if isinstance(tier, MemoryTier):
            hot.update(tier.ids())
    return frozenset(hot)

