"""The state-aware policy of :mod:`kite.serve.router` as a Ray Serve request router.

Ray Serve calls :meth:`StateAwareRouter.choose_replicas` for every call the ingress makes to the
replicas' deployment; the call's first argument is the request's state id (the route key). A
replica's hot set is what it last reported (`record_routing_stats`, every
``request_routing_stats_period_s``) plus the keys this router sent it since (a state sent to a
replica is hot there once it has been answered); its queue is Ray's own count of the requests
sent to it and not yet finished (the router's queue-length cache), else what it reported.
"""

from __future__ import annotations

import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kite.serve.router import DEFAULT_MAX_IMBALANCE, ReplicaView, rank

RECENT_S = 5.0   # a key sent to a replica counts as hot there this long (or until the replica reports)


def key_of(pending: PendingRequest | None) -> str | None:
    if pending is None or not pending.args:
        return None
    key = pending.args[0]
    return key if isinstance(key, str) else None


class StateAwareRouter(RequestRouter):
    """Routes a call to the replica holding its state hot, else the least loaded; ties by rendezvous."""

    def initialize_state(self, max_imbalance: int = DEFAULT_MAX_IMBALANCE, **kwargs) -> None:
        self.max_imbalance = int(max_imbalance)
        self._sent: dict[str, dict[str, float]] = {}   # replica id -> {key: monotonic time sent}

    def _view(self, r: RunningReplica, now: float) -> ReplicaView:
        rid = r.replica_id.unique_id
        stats = r.routing_stats or {}
        reported = stats.get("hot") or ()
        sent = self._sent.get(rid, {})
        fresh = {k for k, t in sent.items() if now - t < RECENT_S}
        queued = self._replica_queue_len_cache.get(r.replica_id)
        if queued is None:
            queued = int(stats.get("queued", 0))
        return ReplicaView(rid, frozenset(reported) | fresh, int(queued))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        now = time.monotonic()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        tiebreak = pending_request.metadata.request_id if pending_request is not None else ""
        order = rank(key_of(pending_request), [self._view(r, now) for r in candidate_replicas],
                     tiebreak=tiebreak, max_imbalance=self.max_imbalance)
        return [[by_id[i]] for i in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key = key_of(pending_request)
        if key is None:
            return
        now = time.monotonic()
        sent = self._sent.setdefault(replica_id.unique_id, {})
        sent[key] = now
        if len(sent) > 256:   # bounded: drop what has expired
            for k in [k for k, t in sent.items() if now - t >= RECENT_S]:
                del sent[k]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._sent.pop(replica_id.unique_id, None)
        super().on_replica_actor_died(replica_id)
