"""Where the replicas of `kite serve --replicas` are: a small detached Ray actor each replica
registers its loopback URL with, so the ingress can reach every replica (its /metrics, an admin
reload), while Ray Serve routes each call to one."""

from __future__ import annotations

DIRECTORY = "kite-replica-directory"


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


def directory():
    """The directory actor's handle (it lives in Ray Serve's namespace)."""
    import ray

    return ray.get_actor(DIRECTORY, namespace="serve")


async def directory_urls() -> dict[str, str]:
    """{replica id: loopback URL} of every registered replica."""
    return await directory().all.remote()


async def forget(replica_id: str) -> None:
    """Drop a replica whose server is gone (it died; Ray Serve replaces it under a new id)."""
    await directory().unregister.remote(replica_id)
