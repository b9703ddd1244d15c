"""`kite serve --replicas` over the shared store: two replicas on a local Ray cluster, each
with a folder of its own (as on two machines), a Redis + S3-compatible store between them (real
redis-server with its append-only file, moto's S3 server, on 127.0.0.1). A state made through one
replica answers on the other with no recompression; after every process restarts (Ray, the
replicas, Redis) the states are found again, fetched from the store, 0 recompressions; a replica
killed under load then loses no request, and the one that comes back finds the states in the store.
One cluster's life in one test: each start of Ray and two replicas costs ~20 s on a 2-core box."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.ray, pytest.mark.services]

from tests.test_ray_serve import DOCS, PROMPTS, Cluster, _complete, _metric, kill_a_replica_under_load  # noqa: E402


def _store_cluster(tiny_models, tmp_path, redis_service, s3_service, monkeypatch):
    """Two replicas started, each on a folder of its own, over a memory + Redis + S3 store; and the
    store's URL."""
    from dataclasses import replace

    bucket = s3_service.bucket()
    store = f"mem://?max=32MB,{redis_service.url},s3://{bucket}/states?endpoint_url={s3_service.endpoint}"
    cluster = Cluster(tiny_models["llama"], tmp_path, monkeypatch)
    cluster.spec = replace(cluster.spec, settings=replace(cluster.spec.settings, store_url=store), own_folders=True)
    return cluster.start(), store


def _replica_clients(cluster):
    reps = cluster.replicas()
    assert len(reps) == 2
    return [httpx.Client(base_url=r["url"], timeout=120) for r in reps]


def test_replicas_share_states_through_redis_and_s3_find_them_after_a_restart_and_survive_a_kill(
        tiny_models, tmp_path, redis_service, s3_service, monkeypatch):
    cluster, store = _store_cluster(tiny_models, tmp_path, redis_service, s3_service, monkeypatch)
    try:
        ca, cb = _replica_clients(cluster)
        made = ca.post("/v1/states", json={"document": DOCS[0]})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]                  # its content address
        assert len(sid) == 64
        # B never saw the document and has its own folder: it fetches the state from the store
        r = _complete(cb, sid, PROMPTS[0])
        assert r.status_code == 200 and r.json()["kite"]["loaded"] is True, r.text
        again = cb.post("/v1/states", json={"document": DOCS[0]})
        assert again.status_code == 200 and again.json()["id"] == sid and again.json()["created"] is False
        text_b = cb.get("/metrics").text
        assert _metric(text_b, "kite_upcycle_states_total") == 0
        assert _metric(text_b, "kite_store_hits_total") >= 1
        for c in (ca, cb):
            c.close()
        # through the endpoint, a second document, then every process stops
        second = cluster.client.post("/v1/states", json={"document": DOCS[1]}).json()["id"]
        want = _complete(cluster.client, sid, PROMPTS[1]).json()["choices"][0]["text"]
    finally:
        cluster.stop()
    redis_service.stop()                          # Redis with its append-only file
    redis_service.start()
    cluster.start()                               # Ray, Serve, new replicas with new, empty folders
    try:
        for doc, expected in ((DOCS[0], sid), (DOCS[1], second)):
            r = cluster.client.post("/v1/states", json={"document": doc})
            assert r.status_code == 200 and r.json()["id"] == expected and r.json()["created"] is False
        assert _complete(cluster.client, sid, PROMPTS[1]).json()["choices"][0]["text"] == want
        text = cluster.client.get("/metrics").text
        assert _metric(text, "kite_upcycle_states_total") == 0   # 0 recompressions after the restart
        assert _metric(text, "kite_store_hits_total") >= 2
        # the kill under 200 requests (tests/test_ray_serve.py) with the replicas on folders of their
        # own over the store: the replica that comes back finds the states in the store
        kill_a_replica_under_load(cluster, tiny_models, store_url=store)
    finally:
        cluster.stop()
