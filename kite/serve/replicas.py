"""`kite serve --replicas N`: N copies of today's server on Ray Serve behind one endpoint.

Two deployments. **kite-replica** (N replicas, or autoscaled between bounds): each loads the model
and runs the very app `kite serve` runs (:func:`kite.serve.create_app`) on a loopback port of its
own; a call hands it one HTTP request and streams the answer back. All replicas share the state
folder (a state made through one is found by all; nothing is upcycled twice). **kite-ingress**
(one replica): the OpenAI-style endpoint. It reads each request's body for the state it names
(:func:`kite.serve.router.route_key`), calls the replicas with that key first, so that
:class:`kite.serve.ray_router.StateAwareRouter` can pick the replica holding it hot, and retries a
call whose replica died before answering (generation is greedy or seeded, so a retry gives the same
answer). It answers two routes itself: `GET /metrics` (every replica's metrics, each sample labelled
`replica="<id>"`, plus the router's own `kite_router_*`) and `GET /v1/replicas` (each replica's id,
loopback URL and whether it answers).
"""

# No `from __future__ import annotations` here: Ray Serve's ingress reads the routes' annotations
# (fastapi.Request) as objects.
import asyncio
import json
import os
import time
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from kite.errors import KiteError
from kite.serve.scale import ReplicaSpec, ScaleSettings

APP = "kite"
REPLICA = "kite-replica"
DIRECTORY = "kite-replica-directory"
HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "host"}
RETRIES = 5


class ReplicaDirectory:
    """A small Ray actor: each replica registers its loopback URL here, so the ingress can scrape
    every replica's /metrics (Ray Serve routes a call to one replica; this lists them all)."""

    def __init__(self):
        self.urls: dict[str, str] = {}

    def register(self, replica_id: str, url: str) -> None:
        self.urls[replica_id] = url

    def unregister(self, replica_id: str) -> None:
        self.urls.pop(replica_id, None)

    def all(self) -> dict[str, str]:
        return dict(self.urls)


class KiteReplica:
    """One replica: the model and `kite serve`'s app on a loopback port of its own."""

    def __init__(self, spec: ReplicaSpec):
        import torch

        from kite.serve.app import create_app
        from kite.serve.server import BackgroundServer
        from kite.upcycle import UpcycleConfig, load_upcycle_config, open_pipeline

        torch.set_num_threads(spec.torch_threads)
        ucfg = (UpcycleConfig.model_validate(spec.upcycle_config) if isinstance(spec.upcycle_config, dict)
                else load_upcycle_config(spec.upcycle_config))
        pipe = open_pipeline(spec.model, ucfg, kept_fraction=spec.kept_fraction, tagger=spec.tagger)
        self.app = create_app(pipe, replace(spec.settings, host="127.0.0.1", port=0))
        self.srv = self.app.state.kite
        self.server = BackgroundServer(self.app)
        self.url = self.server.start(timeout=120)
        self.ongoing = 0
        self._client = None
        self.replica_id = _replica_id()
        self._directory().register.remote(self.replica_id, self.url)

    @staticmethod
    def _directory():
        import ray

        return ray.get_actor(DIRECTORY, namespace="serve")

    async def forward(self, key: str | None, method: str, path: str, query: str, headers: list, body: bytes):
        """Stream one HTTP request through this replica's app: first (status, headers), then the
        body's chunks. `key` is the route key (read by the router, not here)."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.url, timeout=None)
        self.ongoing += 1
        try:
            req = self._client.build_request(method, path + (f"?{query}" if query else ""), headers=headers,
                                             content=body)
            resp = await self._client.send(req, stream=True)
            try:
                yield resp.status_code, [*((k, v) for k, v in resp.headers.items() if k.lower() not in HOP),
                                         ("x-kite-replica", self.replica_id)]
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()
        finally:
            self.ongoing -= 1

    def record_routing_stats(self) -> dict:
        """What the router reads: the state ids held hot (the prefix cache) and the queue."""
        from kite.serve.router import hot_ids

        hot = hot_ids(self.srv.runner.prefixes.held_paths(), self.srv.store.root)
        return {"hot": sorted(hot), "queued": self.ongoing, "url": self.url}

    def info(self) -> dict:
        return {"replica": self.replica_id, "url": self.url, "fingerprint": self.srv.runner.lm.fingerprints.combined,
                "pid": os.getpid()}

    def __del__(self):
        try:
            self._directory().unregister.remote(self.replica_id)
            self.server.stop()
        except Exception:  # noqa: BLE001 - the cluster may be going down
            pass


def _replica_id() -> str:
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (a unit test)
        return f"pid-{os.getpid()}"


def _retryable():
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return (ActorDiedError, ActorUnavailableError, RayActorError)


ingress_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)


@serve.deployment(name="kite-ingress", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(ingress_app)
class KiteIngress:
    def __init__(self, handle):
        from prometheus_client import CollectorRegistry, Counter

        self.handle = handle
        self.fingerprint = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.routed = Counter("kite_router_requests", "Requests the ingress sent to a replica, by outcome.",
                              ["outcome"], registry=self.registry)
        self.retries = Counter("kite_router_retries", "Calls retried because their replica died or left.",
                               registry=self.registry)

    async def _fingerprint(self) -> str:
        if self.fingerprint is None:
            self.fingerprint = (await self.handle.info.remote())["fingerprint"]
        return self.fingerprint

    @ingress_app.get("/metrics")
    async def metrics(self):
        from kite.serve import replicas as here

        from prometheus_client import generate_latest

        urls = await here._directory_urls()
        scraped = await asyncio.gather(*(here._labelled_metrics(rid, url) for rid, url in sorted(urls.items())))
        parts = [generate_latest(self.registry).decode(),
                 f"# HELP kite_replicas Replicas whose metrics this scrape read.\n# TYPE kite_replicas gauge\n"
                 f"kite_replicas {sum(1 for t in scraped if t)}\n", *scraped]
        return Response("".join(parts), media_type="text/plain; version=0.0.4; charset=utf-8")

    @ingress_app.get("/v1/replicas")
    async def replicas(self):
        from kite.serve import replicas as here

        import httpx

        urls = await here._directory_urls()
        out = []
        async with httpx.AsyncClient(timeout=5) as client:
            for rid, url in sorted(urls.items()):
                try:
                    alive = (await client.get(f"{url}/healthz")).status_code == 200
                except httpx.HTTPError:
                    alive = False
                out.append({"id": rid, "url": url, "alive": alive})
        return {"object": "list", "data": out}

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT"])
    async def proxy(self, request: Request, path: str):
        from kite.serve import replicas as here

        body = await request.body()
        if request.method == "POST" and path.startswith("admin/"):
            return await here._broadcast(request, path, body)
        parsed = None
        if body and request.method == "POST":
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None   # the replica answers a malformed body with its own 4xx
        from kite.serve.router import route_key

        key = route_key(parsed, await self._fingerprint() if here._names_document(parsed) else None)
        if request.method == "DELETE" and path.startswith("v1/states/"):
            key = path.removeprefix("v1/states/")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in here.HOP]
        stream = isinstance(parsed, dict) and parsed.get("stream") is True
        last = None
        for attempt in range(here.RETRIES):
            try:
                gen = self.handle.options(stream=True).forward.remote(
                    key, request.method, "/" + path, request.url.query, headers, body)
                status, out_headers = await gen.__anext__()
                if stream:
                    self.routed.labels("streamed").inc()
                    return StreamingResponse(here._rest(gen), status_code=status, headers=dict(out_headers))
                chunks = [c async for c in gen]
                self.routed.labels("answered").inc()
                return Response(b"".join(chunks), status_code=status, headers=dict(out_headers))
            except here._retryable() as exc:
                last = exc
                self.retries.inc()
                await asyncio.sleep(0.2 * (attempt + 1))
        self.routed.labels("failed").inc()
        return JSONResponse({"error": {"message": f"no replica answered after {here.RETRIES} tries: "
                                       f"{type(last).__name__}", "code": 503}}, status_code=503)



async def _broadcast(request: Request, path: str, body: bytes):
    """An admin change (a rule reload or switch) goes to every replica, each directly at its loopback
    URL: the answer is the first replica's (the shape `kite serve` gives) with `replicas`, each
    replica's status, added; when replicas disagree, the worst status and its body."""
    import httpx

    urls = await _directory_urls()
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP]
    answers: dict[str, tuple[int, object]] = {}
    async with httpx.AsyncClient(timeout=60) as client:
        async def one(rid: str, url: str) -> None:
            try:
                r = await client.post(f"{url}/{path}", headers=headers, content=body)
                try:
                    answers[rid] = (r.status_code, r.json())
                except ValueError:
                    answers[rid] = (r.status_code, {"error": {"message": r.text[:200], "code": r.status_code}})
            except httpx.ConnectError:   # its server is gone: the replica died (Ray Serve replaces it)
                await _forget(rid)
            except httpx.HTTPError as exc:
                answers[rid] = (503, {"error": {"message": f"replica {rid} unreachable: {type(exc).__name__}",
                                                "code": 503}})

        await asyncio.gather(*(one(rid, url) for rid, url in sorted(urls.items())))
    if not answers:
        return JSONResponse({"error": {"message": "no replica registered", "code": 503}}, status_code=503)
    status, first = max(answers.values(), key=lambda a: a[0])
    out = {**first, "replicas": {rid: a[0] for rid, a in sorted(answers.items())}} if isinstance(first, dict) else first
    return JSONResponse(out, status_code=status)


def _names_document(body) -> bool:
    if not isinstance(body, dict):
        return False
    opts = body.get("kite") if isinstance(body.get("kite"), dict) else body
    return isinstance(opts.get("document"), str)


async def _rest(gen):
    async for chunk in gen:
        yield chunk


async def _directory_urls() -> dict[str, str]:
    import ray

    return await ray.get_actor(DIRECTORY, namespace="serve").all.remote()


async def _forget(replica_id: str) -> None:
    import ray

    await ray.get_actor(DIRECTORY, namespace="serve").unregister.remote(replica_id)


async def _labelled_metrics(replica_id: str, url: str) -> str:
    """One replica's /metrics with `replica="<id>"` added to every sample ('' when it is gone)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=5) as client:
            text = (await client.get(f"{url}/metrics")).text
    except httpx.ConnectError:   # its server is gone: the replica died
        await _forget(replica_id)
        return ""
    except httpx.HTTPError:
        return ""
    return relabel(text, "replica", replica_id)


def relabel(text: str, name: str, value: str) -> str:
    """Prometheus text with label `name="value"` added to every sample line (comments kept)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            out.append(line)
            continue
        metric, _, rest = line.partition(" ")
        if metric.endswith("}"):
            metric = f'{metric[:-1]},{name}="{value}"}}'
        else:
            metric = f'{metric}{{{name}="{value}"}}'
        out.append(f"{metric} {rest}")
    return "\n".join(out) + "\n"


# -- the cluster -----------------------------------------------------------------------------------

@dataclass(slots=True)
class Cluster:
    """A running deployment: its endpoint and how it was started."""

    url: str
    address: str | None
    started_ray: bool


def start(spec: ReplicaSpec, scale: ScaleSettings, *, host: str = "127.0.0.1", port: int = 8088,
          address: str | None = None, num_cpus: int | None = None, timeout_s: float = 300.0) -> Cluster:
    """Start (or join, with `address`) Ray, then Ray Serve on host:port, then the replicas and the
    ingress; returns when every replica has loaded its model."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kite.ray_session import connect
    from kite.serve.ray_router import StateAwareRouter

    started = connect(address, num_cpus)
    serve.start(http_options={"host": host, "port": port})
    remote_dir = ray.remote(num_cpus=0)(ReplicaDirectory)
    try:
        ray.get_actor(DIRECTORY, namespace="serve")
    except ValueError:
        remote_dir.options(name=DIRECTORY, namespace="serve", lifetime="detached").remote()
    router = RequestRouterConfig(request_router_class=StateAwareRouter,
                                 request_router_kwargs={"max_imbalance": scale.max_imbalance},
                                 request_routing_stats_period_s=scale.stats_period_s,
                                 request_routing_stats_timeout_s=max(5.0, scale.stats_period_s * 4))
    replica = serve.deployment(KiteReplica).options(
        # num_cpus 0: on a small machine the replicas share its cores (torch_threads each)
        name=REPLICA, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=scale.max_ongoing,
        request_router_config=router, health_check_period_s=2.0, health_check_timeout_s=30.0,
        **scale.deployment_options())
    t0 = time.monotonic()
    try:
        serve.run(KiteIngress.bind(replica.bind(spec)), name=APP, route_prefix="/", blocking=False)
    except RuntimeError as exc:   # a replica failed to start: Ray's message names the deployment
        raise KiteError(f"kite serve --replicas: {str(exc).splitlines()[0]} (the replicas' logs: "
                        "/tmp/ray/session_latest/logs/serve/)") from None
    url = f"http://{host}:{port}"
    _wait_ready(time.monotonic() - t0, timeout_s)
    return Cluster(url, address, started)


def _wait_ready(spent: float, timeout_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + max(1.0, timeout_s - spent)
    while True:
        status = serve.status().applications.get(APP)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise KiteError(f"kite serve --replicas: the deployment failed: {status.message or status.status}")
        if time.monotonic() > deadline:
            raise KiteError(f"kite serve --replicas: not ready after {timeout_s:.0f} s")
        time.sleep(0.25)


def stop(cluster: Cluster | None = None) -> None:
    """Delete the app and shut Serve down; shut Ray down when `start` started it."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        try:
            ray.kill(ray.get_actor(DIRECTORY, namespace="serve"))
        except Exception:  # noqa: BLE001 - gone already
            pass
        if cluster is None or cluster.started_ray:
            ray.shutdown()
