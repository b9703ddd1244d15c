"""Tenants of one server: API keys (``server.api_keys_file``, :func:`kite.serve.auth.authenticate`)
name them, and each tenant's requests see only the tenant's own states (docs/serving.md, "Tenants").

Without an API key file the server is open, as before: every request is of no tenant. With one,
every ``/v1/`` request carries ``Authorization: Bearer <key>`` (401 without a key, or with one the
file does not hold); the key's tenant (none for a key the file gives no tenant) decides what the
request sees:

- its own folder of states, ``<state_dir>/tenants/<tag>/`` (the tag: :func:`kite.tenants.tenant_tag`;
  no tenant: ``<state_dir>`` itself, as before), and its own part of the shared store
  (:meth:`kite.store.TieredStore.for_tenant`);
- content addresses and document ids made for it (the tag is salted in), so the same document
  uploaded by two tenants is two states, and a tenant asking for another's document computes an
  address of its own and misses as for any new document;
- its own health records (YOCO's measured gains, keyed by the tenant's tag and the state id), its
  own query novelty (how new a query is, against the tenant's recent queries only) and its own
  quarantine of states a reader refused (:mod:`kite.serve.quarantine`; ``/metrics`` counts every
  tenant's together, and ``DELETE /admin/states/{id}/quarantine?tenant=NAME`` lifts a tenant's).

Another tenant's state is not there for it: listing leaves it out, and naming it is answered as
for a state nobody made (404, the same message). The model's own embedded states
(``kite gguf embed``) are read-only and shipped with the model: every tenant sees them.
"""

from __future__ import annotations

import copy
import dataclasses
import threading

from fastapi import Request

from kite.serve.states import StateStore
from kite.tenants import tenant_tag

def scoped(request: Request):
    """The server's state (:class:`kite.serve.app.ServerState`) as the request's tenant sees it: its
    runner, folder, store part and health records (the app's own for no tenant)."""
    return tenant_view(request.app.state.kite, getattr(request.state, "tenant", None))


def tenant_view(root, tenant: str | None):
    """The server's state ``root`` as tenant ``tenant`` (a checked name) sees it; ``root`` itself for
    no tenant."""
    if tenant is None:
        return root
    from kite.serve.workers import model_limiter

    model_limiter(root)   # one limiter for every tenant's model work: made before any view copies it
    return root.tenants.view(root, tenant)


class Tenants:
    """Each tenant's view of the server, made on its first request and kept."""

    def __init__(self):
        self._views: dict[str, object] = {}
        self._lock = threading.Lock()

    def quarantines(self) -> list:
        """The quarantine (:class:`kite.serve.quarantine.Quarantine`) of each tenant's view made so far:
        a tenant's quarantined states are its own, counted together on /metrics."""
        with self._lock:
            return [view.store.quarantine for view in self._views.values()]

    def view(self, root, tenant: str):
        with self._lock:
            view = self._views.get(tenant)
            if view is None:
                store = TenantStateStore(root.store, tenant)
                health = None if root.health is None else TenantHealth(root.health, store.tenant_tag)
                runner = copy.copy(root.runner)   # the same model, batch and prefix cache
                runner.store, runner.health, runner.tenant = store, health, tenant
                if root.runner.novelty is not None:
                    from kite.yoco.novelty import NoveltyTracker

                    runner.novelty = NoveltyTracker()
                view = self._views[tenant] = dataclasses.replace(root, runner=runner, store=store, health=health)
            return view


class TenantStateStore(StateStore):
    """A tenant's folder of states, ``<state_dir>/tenants/<tag>/``, beside the server's; its part of
    the shared store; the model's embedded states as every tenant sees them; document ids salted
    with its tag; a quarantine of its own (:mod:`kite.serve.quarantine`), so a state a reader refused
    for one tenant is neither shown nor refused to another."""

    def __init__(self, root: StateStore, tenant: str):
        self.tenant_tag = tenant_tag(tenant)
        super().__init__(root.folder / "tenants" / self.tenant_tag, embedded=root.embedded,
                         embedded_in=root.embedded_in,
                         shared=None if root.shared is None else root.shared.for_tenant(tenant))

    def id_for(self, document: str, model_fingerprint: str) -> str:
        """A content id of the document, the model and this tenant."""
        return StateStore.id_for(document, f"{model_fingerprint}\0tenant:{self.tenant_tag}")


class TenantHealth:
    """A tenant's records in the server's health store: the same store, state ids under the tag."""

    def __init__(self, health, tag: str):
        self._health, self._tag = health, tag

    def _key(self, state_id: str) -> str:
        return f"tenant:{self._tag}:{state_id}"

    @property
    def prior_health(self) -> float:
        return self._health.prior_health

    def record(self, state_id: str, cluster: str, gain: float) -> float:
        return self._health.record(self._key(state_id), cluster, gain)

    def record_clusters(self, state_id: str, clusters, gain: float) -> dict[str, float]:
        return self._health.record_clusters(self._key(state_id), clusters, gain)

    def score(self, state_id: str, cluster: str) -> float:
        return self._health.score(self._key(state_id), cluster)

    def scores(self, state_id: str, clusters: list[str] | None = None) -> dict[str, float]:
        return self._health.scores(self._key(state_id), clusters)

    def records(self, state_id: str) -> list:
        return [dataclasses.replace(r, state_id=state_id) for r in self._health.records(self._key(state_id))]

    def reset(self, state_id: str) -> int:
        return self._health.reset(self._key(state_id))
