"""The endpoint of `kite serve --replicas`: one Ray Serve deployment (a FastAPI app under
`serve.ingress`) with the same routes and API as `kite serve`.

Each request's body is read for the state it is about (:func:`kite.serve.router.route_key`); the
call to the replicas carries that key first, so :class:`kite.serve.ray_router.StateAwareRouter`
can pick the replica holding it hot. A call whose replica died before answering is retried
(greedy or seeded generation gives the same answer on any replica). Answered here: `GET /metrics`
(every replica's metrics labelled `replica="<id>"`, plus `kite_router_*`), `GET /v1/replicas`,
and admin changes (`POST /admin/...`), which go to every replica.
"""

# No `from __future__ import annotations` here: Ray Serve's ingress reads the routes' annotations
# (fastapi.Request) as objects.
import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from kite.serve.replica_directory import directory_urls, forget

HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "host"}   # not passed on
RETRIES = 5


def _retryable():
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return (ActorDiedError, ActorUnavailableError, RayActorError)


ingress_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)


@serve.deployment(name="kite-ingress", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(ingress_app)
class KiteIngress:
    """The endpoint. Ray Serve ships this class to its replica by value, without this module's
    globals: the methods reach the module's helpers through `from kite.serve import ingress as here`."""

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
        from prometheus_client import generate_latest

        from kite.serve import ingress as here

        urls = await here.directory_urls()
        scraped = await asyncio.gather(*(here._labelled_metrics(rid, url) for rid, url in sorted(urls.items())))
        parts = [generate_latest(self.registry).decode(),
                 f"# HELP kite_replicas Replicas whose metrics this scrape read.\n# TYPE kite_replicas gauge\n"
                 f"kite_replicas {sum(1 for t in scraped if t)}\n", *scraped]
        return Response("".join(parts), media_type="text/plain; version=0.0.4; charset=utf-8")

    @ingress_app.get("/v1/replicas")
    async def replicas(self):
        import httpx

        from kite.serve import ingress as here

        urls = await here.directory_urls()
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
        from kite.serve import ingress as here
        from kite.serve.router import route_key

        body = await request.body()
        if request.method == "POST" and path.startswith("admin/"):
            return await here._broadcast(request, path, body)
        parsed = None
        if body and request.method == "POST":
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None   # the replica answers a malformed body with its own 4xx
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

    urls = await directory_urls()
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
                await forget(rid)
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


async def _labelled_metrics(replica_id: str, url: str) -> str:
    """One replica's /metrics with `replica="<id>"` added to every sample ('' when it is gone)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=5) as client:
            text = (await client.get(f"{url}/metrics")).text
    except httpx.ConnectError:   # its server is gone: the replica died
        await forget(replica_id)
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
