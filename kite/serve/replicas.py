"""`kite serve --replicas N`: N copies of today's server on Ray Serve behind one endpoint.

Two deployments. **kite-replica** (N replicas, or autoscaled between bounds): each loads the model
and runs the very app `kite serve` runs (:func:`kite.serve.create_app`) on a loopback port of its
own; a call hands it one HTTP request and streams the answer back. All replicas share the state
folder (a state made through one is found by all; nothing is upcycled twice). **kite-ingress**
(one replica, :mod:`kite.serve.ingress`): the OpenAI-style endpoint, with the state-aware router
(:mod:`kite.serve.ray_router`) choosing the replica of each call. Replicas register their URLs in
:mod:`kite.serve.replica_directory`. docs/scale-out.md.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from kite.errors import KiteError
from kite.serve.ingress import HOP, KiteIngress
from kite.serve.replica_directory import DIRECTORY, ReplicaDirectory, directory
from kite.serve.scale import ReplicaSpec, ScaleSettings

APP = "kite"
REPLICA = "kite-replica"


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
        self.replica_id = _replica_id()
        settings = replace(spec.settings, host="127.0.0.1", port=0)
        if spec.own_folders:
            settings.state_dir = settings.state_dir / "replicas" / self.replica_id
        self.app = create_app(pipe, settings)
        self.srv = self.app.state.kite
        self.server = BackgroundServer(self.app)
        self.url = self.server.start(timeout=120)
        self.ongoing = 0
        self._client = None
        directory().register.remote(self.replica_id, self.url)

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
        """What the router reads: the state ids held hot (the prefix cache, the store's memory tier)
        and the queue."""
        from kite.serve.router import hot_states

        return {"hot": sorted(hot_states(self.srv)), "queued": self.ongoing, "url": self.url}

    def info(self) -> dict:
        return {"replica": self.replica_id, "url": self.url, "fingerprint": self.srv.runner.lm.fingerprints.combined,
                "pid": os.getpid()}

    def __del__(self):
        try:
            directory().unregister.remote(self.replica_id)
            self.server.stop()
        except Exception:  # noqa: BLE001 - the cluster may be going down
            pass


def _replica_id() -> str:
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (a unit test)
        return f"pid-{os.getpid()}"


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
    from kite.serve.server import bind_socket

    bind_socket(host, port).close()     # a busy port fails here, before Ray starts, in KITE's words
    started = connect(address, num_cpus)
    try:
        serve.start(http_options={"host": host, "port": port})
    except Exception as exc:  # noqa: BLE001 - Ray wraps the proxy's failure in its task error
        if "Failed to bind" not in str(exc):
            raise
        if started:
            ray.shutdown()
        raise KiteError(f"kite serve --replicas: Ray Serve's proxy could not listen on {host}:{port}: the port "
                        "was taken while Ray started; choose another with --port or server.port") from None
    try:
        directory()
    except ValueError:
        ray.remote(num_cpus=0)(ReplicaDirectory).options(name=DIRECTORY, namespace="serve",
                                                         lifetime="detached").remote()
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
            ray.kill(directory())
        except Exception:  # noqa: BLE001 - gone already
            pass
        if cluster is None or cluster.started_ray:
            ray.shutdown()
