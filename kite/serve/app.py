"""The app factory: one model, its state store, rules, health store, sampler and metrics, behind
the routes. `create_app` takes a loaded model, so tests inject a tiny one."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from fastapi import FastAPI

from kite.serve.metrics import ServerMetrics
from kite.serve.runner import ModelRunner
from kite.serve.settings import ServeSettings
from kite.serve.states import StateStore


@dataclass(slots=True)
class ServerState:
    """Everything a request may touch, at `app.state.kite`."""

    settings: ServeSettings
    runner: ModelRunner
    store: StateStore
    rules: object  # kite.yoco.rules.ActiveRules
    metrics: ServerMetrics
    health: object | None
    sampler: object | None
    model_limiter: object | None = None  # anyio.CapacityLimiter, made in the loop (workers.py)
    tenants: object | None = None   # kite.serve.tenants.Tenants: each API key tenant's view, made on first use


def create_app(pipeline, settings: ServeSettings, *, rules=None, health=None, sampler=None,
               start_sampler: bool = True, embedded: dict | None = None) -> FastAPI:
    """An ASGI app serving ``pipeline`` (a :class:`kite.upcycle.Pipeline`: the model, its tagger and
    the compression settings uploads are upcycled with). ``rules``: the compiled
    :class:`kite.yoco.rules.RuleSet` of ``settings.rules_path`` (compiled before the model loaded,
    so a bad file failed early); None compiles that file now. Either way the set is checked against
    the model's layers here (RuleSetError), before the server binds. The watermark sampler runs
    from startup to shutdown. ``embedded``: the states of the model's GGUF file as
    :func:`embedded_states` gives them (read before the model loaded); None reads them now."""
    from kite.yoco.health import HealthStore
    from kite.yoco.novelty import NoveltyTracker
    from kite.yoco.rules import ActiveRules
    from kite.yoco.watermark import WatermarkSampler, default_backend

    n_layers = pipeline.lm.geometry.n_layers
    rules = (ActiveRules.from_file(settings.rules_path, n_layers=n_layers) if rules is None
             else ActiveRules(rules, n_layers=n_layers))
    shared = None
    if settings.store_url:
        from kite.store import open_store

        shared = open_store(settings.store_url, default_write=settings.store_write)
    store = StateStore(settings.state_dir, **(embedded if embedded is not None else
                                              embedded_states(pipeline.lm.source)), shared=shared)
    health = health if health is not None else HealthStore()
    if sampler is None and start_sampler:
        sampler = WatermarkSampler(default_backend(), interval_ms=settings.sampler_interval_ms,
                                   spike_threshold_gb=settings.spike_threshold_gb)
    metrics = ServerMetrics()
    runner = ModelRunner(pipeline, settings, rules, store, health=health, novelty=NoveltyTracker(), sampler=sampler,
                         on_step=metrics.observe_step)
    metrics.bind_rules(rules)
    from kite.serve.tenants import Tenants

    tenants = Tenants()
    metrics.bind_quarantine(lambda: [store.quarantine, *tenants.quarantines()])
    if shared is not None:
        metrics.bind_store(shared)
    if sampler is not None:
        metrics.bind_sampler(sampler)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if sampler is not None and start_sampler:
            sampler.start()
        metrics.gc.start()
        try:
            yield
        finally:
            metrics.gc.stop()
            runner.close()
            if sampler is not None and start_sampler:
                sampler.stop()
            if shared is not None:
                shared.close()   # queued write-backs finish first

    from kite.serve import routes_admin, routes_openai, routes_ops, routes_states
    from kite.serve.errors import install_handlers
    from kite.serve.instrument import RequestMetrics
    from kite.serve.limits import BodyLimit

    app = FastAPI(title="KITE", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.state.kite = ServerState(settings, runner, store, rules, metrics, health, sampler, tenants=tenants)
    for module in (routes_openai, routes_states, routes_admin, routes_ops):
        app.include_router(module.router)
    app.include_router(routes_admin.states_router)
    install_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=metrics)  # outermost: counts 413s too
    return app


def embedded_states(source) -> dict:
    """The states embedded in the model's GGUF file (`kite gguf embed`) as StateStore's arguments
    (`kite.model.sources.ModelSource`): none for a model from a folder or the embedded default's file."""
    if getattr(source, "kind", None) != "gguf":
        return {}
    from kite.store import cached_states

    return {"embedded": cached_states(source.path), "embedded_in": source.path.name}
