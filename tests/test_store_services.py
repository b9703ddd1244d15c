"""The store's shared tiers against real servers: Debian's redis-server (appendonly) and moto's S3
server, both started on free 127.0.0.1 ports by tests/services.py and stopped after. Faults are
real: Redis stopped, a bucket that is gone, an object cut short in Redis; and a restart of Redis
and of the process finds every state again without recompressing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import CORPUS

pytestmark = pytest.mark.services
DOCS = [CORPUS, CORPUS.replace(". ", ".\n\n", 4)]


@pytest.fixture(scope="module")
def states(tiny_models, tmp_path_factory):
    """Two addressed states of the tiny Llama: [(address, bytes)]."""
    from kite.model import load_model
    from kite.upcycle import open_pipeline

    pipe = open_pipeline(lm=load_model(str(tiny_models["llama"]), device="cpu"), tagger=False, ratio=4, clusters=2)
    folder = tmp_path_factory.mktemp("states")
    out = []
    for i, doc in enumerate(DOCS):
        r = pipe.compress(doc, folder / f"{i}.upc")
        out.append((r.address, (folder / f"{i}.upc").read_bytes()))
    return out


def _open(url):
    from kite.store import open_store

    return open_store(url)


def test_redis_tier_holds_small_states_and_indexes_big_ones(redis_service, states):
    (a, small), (b, big) = sorted(states, key=lambda s: len(s[1]))
    limit = (len(small) + len(big)) // 2
    store = _open(f"{redis_service.url}?max_value={limit}&prefix=t")
    report_small, report_big = store.put(small), store.put(big)
    assert report_small.tiers == {"redis": "stored"}
    assert report_big.tiers["redis"].startswith("declined")
    tier = store.tiers[0]
    assert tier.ids() == [a]
    assert tier.stat(b).held is False and tier.stat(b).bytes == len(big)   # indexed, not held
    assert store.get(a) == small and store.get(b) is None
    # the index rebuilt from the stored states' own headers
    tier.client.delete("t:index")
    assert tier.rebuild_index() == 1 and tier.ids() == [a]


def test_redis_tier_keeps_its_bound_least_recently_used_out(redis_service, states):
    (a, first), (b, second) = states
    store = _open(f"{redis_service.url}?max={max(len(first), len(second)) + 10}")
    store.put(first)
    store.put(second)                                   # past the bound: the older one goes
    assert store.tiers[0].ids() == [b] and store.stats()["tiers"][0]["evictions"] == 1
    assert store.get(a) is None and store.get(b) == second


def test_s3_tier_round_trip(s3_service, aws_env, states):
    bucket = s3_service.bucket()
    store = _open(f"s3://{bucket}/states?endpoint_url={s3_service.endpoint}")
    for _, data in states:
        assert store.put(data).tiers == {"s3": "stored"}
    assert sorted(store.tiers[0].ids()) == sorted(a for a, _ in states)
    a, data = states[0]
    assert store.get(a) == data
    assert store.stats()["tiers"][0]["objects"] == 2
    assert store.delete(a) == {"s3": True} and store.get(a) is None


def test_redis_down_falls_back_to_s3_and_is_counted(redis_service, s3_service, aws_env, states):
    bucket = s3_service.bucket()
    url = f"{redis_service.url}?timeout=0.5,s3://{bucket}/p?endpoint_url={s3_service.endpoint}"
    a, data = states[0]
    assert _open(url).put(data).tiers == {"redis": "stored", "s3": "stored"}
    redis_service.stop()
    store = _open(url)
    assert store.get(a) == data                                   # answered by S3
    snap = store.counters.snapshot()
    assert snap["hits"] == {"s3": 1}
    assert {(e["tier"], e["op"]) for e in snap["errors"]} >= {("redis", "get"), ("redis", "promote")}
    report = store.put(states[1][1])                              # a put while Redis is down says so
    assert report.tiers["redis"].startswith("failed") and report.tiers["s3"] == "stored"
    assert store.stats()["tiers"][0]["error"]                     # stats names the unreachable tier


def test_s3_errors_fall_back_to_disk_and_a_put_that_fails_is_reported(s3_service, aws_env, states, tmp_path):
    a, data = states[0]
    url = f"file://{tmp_path}/disk,s3://no-such-bucket/p?endpoint_url={s3_service.endpoint}"
    store = _open(url)
    report = store.put(data)
    assert report.tiers["file"] == "stored" and report.tiers["s3"].startswith("failed: NoSuchBucket")
    assert store.counters.errors[("s3", "put")] == 1
    # a read the disk cannot answer reaches S3, which errors: a miss, counted, never an exception
    lonely = _open(f"s3://no-such-bucket/p?endpoint_url={s3_service.endpoint}")
    assert lonely.get("a" * 64) is None
    assert lonely.counters.misses == 1


def test_a_truncated_object_in_redis_is_refused_and_refetched_from_s3(redis_service, s3_service, aws_env, states):
    bucket = s3_service.bucket()
    store = _open(f"{redis_service.url},s3://{bucket}?endpoint_url={s3_service.endpoint}")
    a, data = states[0]
    store.put(data)
    redis = store.tiers[0]
    redis.client.set(f"kite:state:{a}", data[: len(data) - 7])   # torn
    assert store.get(a) == data
    assert store.counters.errors[("redis", "verify")] == 1
    assert redis.client.get(f"kite:state:{a}") == data           # repaired by the promotion


def _compress(model: Path, doc: Path, out: Path, store: str) -> dict:
    """`kite upcycle compress --store` in a fresh process; its --json."""
    cmd = [sys.executable, "-m", "kite.cli.main", "upcycle", "compress", "--model", str(model), "-i", str(doc),
           "-o", str(out), "--ratio", "4", "--clusters", "2", "--store", store, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout[done.stdout.index("{"):])


def test_restart_of_redis_and_of_the_process_finds_every_state_without_recompressing(
        redis_service, tiny_models, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    disk, redis = f"file://{tmp_path}/disk", redis_service.url
    first = _compress(tiny_models["llama"], doc, tmp_path / "1.upc", f"mem://,{disk},{redis}")
    assert first["store"]["recompressed"] is True
    assert first["store"]["put"]["tiers"] == {"mem": "stored", "file": "stored", "redis": "stored"}
    redis_service.stop()                 # a clean stop: appendonly keeps the data
    redis_service.start()                # same port, same folder
    from_redis = _compress(tiny_models["llama"], doc, tmp_path / "2.upc", f"mem://,{redis}")
    from_disk = _compress(tiny_models["llama"], doc, tmp_path / "3.upc", f"mem://,{disk}")
    for got, tier in ((from_redis, "redis"), (from_disk, "file")):
        assert got["store"] == {"address": first["address"], "recompressed": False, "found_in": tier, "put": None}
    assert (tmp_path / "2.upc").read_bytes() == (tmp_path / "1.upc").read_bytes() == (tmp_path / "3.upc").read_bytes()


def test_a_server_after_a_redis_restart_finds_the_state_another_server_made(redis_service, tiny_models, tmp_path):
    from kite.model import load_model
    from tests.test_store_serve import _metric, _server
    from tests.test_serve import DOC

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    a, _, ca = _server(lm, tmp_path / "a", f"mem://,{redis_service.url}")
    try:
        made = ca.post("/v1/states", json={"document": DOC})
        assert made.status_code == 201, made.text
    finally:
        ca.close()
        a.stop()
    redis_service.stop()
    redis_service.start()
    b, _, cb = _server(lm, tmp_path / "b", f"mem://,{redis_service.url}")
    try:
        again = cb.post("/v1/states", json={"document": DOC})
        assert again.status_code == 200 and again.json()["id"] == made.json()["id"]
        r = cb.post("/v1/completions", json={"prompt": " Who?", "max_tokens": 1, "kite": {"state": made.json()["id"]}})
        assert r.status_code == 200, r.text
        metrics = cb.get("/metrics").text
        assert _metric(metrics, "kite_upcycle_states_total") == 0          # 0 recompressions
        assert _metric(metrics, "kite_store_hits_total", tier="redis") == 1
    finally:
        cb.close()
        b.stop()


def test_a_put_missed_while_redis_was_down_reaches_it_at_the_next_put(redis_service, states, tmp_path):
    from kite.store.journal import JOURNAL_NAME

    (a, first), (b, second) = states
    url = f"file://{tmp_path}/disk,{redis_service.url}?timeout=0.5"
    redis_service.stop()
    report = _open(url).put(first)                     # Redis down: the disk has it, Redis missed it
    assert report.tiers["file"] == "stored" and report.tiers["redis"].startswith("failed")
    assert (tmp_path / "disk" / JOURNAL_NAME).is_file()
    redis_service.start()                              # back (same port and data folder)
    store = _open(url)                                 # another process of the same store
    [missed] = store.journal.pending()
    assert (missed.id, missed.attempts) == (a, 1) and missed.tier.startswith("redis redis://")
    assert store.put(second).tiers == {"file": "stored", "redis": "stored"}
    assert sorted(store.tiers[1].ids()) == sorted([a, b])   # the missed one came along
    assert store.tiers[1].get(a) == first
    assert store.journal.pending() == []


def test_sync_copies_what_a_tier_missed_and_is_idempotent(redis_service, states, tmp_path):
    from typer.testing import CliRunner

    from kite.cli.main import app
    from tests.conftest import parse_json

    runner = CliRunner()
    url = f"file://{tmp_path}/disk,{redis_service.url}?timeout=0.5"
    redis_service.stop()
    files = []
    for i, (_, data) in enumerate(states):
        files.append(tmp_path / f"{i}.upc")
        files[-1].write_bytes(data)
    put = runner.invoke(app, ["store", "put", *map(str, files), "--store", url, "--mkdir"])
    assert put.exit_code == 1 and "redis failed" in put.output
    down = runner.invoke(app, ["store", "sync", "--store", url, "--json"])
    assert down.exit_code == 1 and down.output.strip().endswith("tier(s) unreachable: redis; run kite store sync "
                                                                "again once it is back")
    doc = json.JSONDecoder().raw_decode(down.output[down.output.index("{"):])[0]
    assert doc["unreachable"].keys() == {"redis"} and doc["copied"] == []
    redis_service.start()
    first = runner.invoke(app, ["store", "sync", "--store", url, "--json"])
    assert first.exit_code == 0, first.output
    doc = parse_json(first.output)
    assert sorted(c["id"] for c in doc["copied"]) == sorted(a for a, _ in states)
    assert {(c["from"], c["to"]) for c in doc["copied"]} == {("file", "redis")}
    assert doc["tiers"]["redis"]["missing"] == 2 and doc["tiers"]["file"]["missing"] == 0
    again = parse_json(runner.invoke(app, ["store", "sync", "--store", url, "--json"]).output)
    assert again["copied"] == [] and again["tiers"]["redis"]["missing"] == 0
    listed = parse_json(runner.invoke(app, ["store", "ls", "--store", url, "--json"]).output)["states"]
    assert all(r["tiers"] == ["file", "redis"] for r in listed) and len(listed) == 2
    # the other way: a state only Redis holds reaches the folder
    a, data = states[0]
    (tmp_path / "disk" / f"{a}.upc").unlink()
    text = runner.invoke(app, ["store", "sync", "--store", url, "--to", "file"])
    assert text.exit_code == 0 and "copied 1" in text.output
    assert (tmp_path / "disk" / f"{a}.upc").read_bytes() == data
    bad = runner.invoke(app, ["store", "sync", "--store", url, "--to", "s3"])
    assert bad.exit_code == 2 and "--to s3: no such tier" in bad.output


def test_states_put_while_the_s3_bucket_was_missing_reach_it_by_sync(s3_service, aws_env, states, tmp_path):
    from kite.store import sync_store

    name = f"kite-late-{tmp_path.name[-8:].lower().replace('_', '-')}"
    url = f"file://{tmp_path}/disk,s3://{name}/p?endpoint_url={s3_service.endpoint}"
    store = _open(url)
    for _, data in states:
        assert store.put(data).tiers["s3"].startswith("failed: NoSuchBucket")
    assert len(store.journal.pending()) == 2
    s3_service.bucket(name)                                     # the bucket is there now
    progress = []
    report = sync_store(_open(url), progress=lambda *a: progress.append(a))
    assert sorted(c["id"] for c in report.copied) == sorted(a for a, _ in states)
    assert progress[0] == ("sync", 0, 2) and progress[-1] == ("sync", 2, 2)
    assert sorted(_open(url).tiers[1].ids()) == sorted(a for a, _ in states)
    assert _open(url).journal.pending() == [] and sync_store(_open(url)).copied == []
