"""The tiered state store without services: content addresses, verification on every read, tiers
in memory and on disk, faults injected with fakes (a tier that fails, a full disk, a torn object).
The Redis and S3 tiers against real servers: tests/test_store_services.py."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from kite.errors import BadInput
from tests.tiny_models import CORPUS

DOCS = [CORPUS, CORPUS.replace(". ", ".\n\n", 4), CORPUS[: len(CORPUS) // 2]]


@pytest.fixture(scope="module")
def pipe(tiny_models):
    from kite.model import load_model
    from kite.upcycle import open_pipeline

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    return open_pipeline(lm=lm, tagger=False, ratio=4, clusters=2)


@pytest.fixture(scope="module")
def states(pipe, tmp_path_factory):
    """Three addressed states of the tiny Llama: [(address, path, bytes)]."""
    folder = tmp_path_factory.mktemp("states")
    out = []
    for i, doc in enumerate(DOCS):
        path = folder / f"doc{i}.upc"
        result = pipe.compress(doc, path)
        out.append((result.address, path, path.read_bytes()))
    return out


def _store(url: str):
    from kite.store import open_store

    return open_store(url)


# ---------------------------------------------------------------- addresses

def test_compress_records_the_address_computed_before_compressing(pipe, states):
    from kite.store import verify_state

    for doc, (address, _, data) in zip(DOCS, states):
        assert pipe.address_of(doc).id == address
        assert verify_state(data).id == address
    assert len({a for a, _, _ in states}) == 3


def test_address_depends_on_settings_and_tokens_and_model(pipe):
    from dataclasses import replace

    from kite.upcycle import address_for, codec_settings

    ids = [1, 2, 3, 4]
    base = address_for("kite-fp1:aa", ids, pipe.settings, None, None).id
    assert address_for("kite-fp1:aa", ids, pipe.settings, None, None).id == base
    assert address_for("kite-fp1:ab", ids, pipe.settings, None, None).id != base
    assert address_for("kite-fp1:aa", [1, 2, 3, 5], pipe.settings, None, None).id != base
    assert address_for("kite-fp1:aa", ids, pipe.settings, None, "kite-fp1:cc").id != base
    other = replace(pipe.settings, codec=codec_settings(8.0))
    assert address_for("kite-fp1:aa", ids, other, None, None).id != base
    # the tagger by how it tags, not by what its training measured (machine-dependent last bits)
    tagger = {"method": "ridge", "embedding_layers": [2], "labels": ["a", "b"], "validation_accuracy": 0.9,
              "temperature": 0.21}
    tagged = address_for("kite-fp1:aa", ids, pipe.settings, tagger, None).id
    assert tagged != base
    assert address_for("kite-fp1:aa", ids, pipe.settings, {**tagger, "validation_accuracy": 0.91,
                                                          "temperature": 0.2100001}, None).id == tagged
    assert address_for("kite-fp1:aa", ids, pipe.settings, {**tagger, "labels": ["a", "c"]}, None).id != tagged


@pytest.mark.slow   # a fresh KITE process
def test_address_is_the_same_in_other_processes_whatever_the_hash_seed(pipe):
    from kite.upcycle import address_for

    code = ("import json,sys; from kite.upcycle import address_for, codec_settings; "
            "from kite.upcycle.compress import CompressSettings; "
            "s=CompressSettings(codec=codec_settings(4.0), n_clusters=2, label_ratios={'b': 8.0, 'a': 6.0}); "
            "print(address_for('kite-fp1:aa', list(range(50)), s, {'labels': ['x', 'y']}, None).id)")
    from kite.upcycle import codec_settings
    from kite.upcycle.compress import CompressSettings

    here = address_for("kite-fp1:aa", list(range(50)),
                       CompressSettings(codec=codec_settings(4.0), n_clusters=2, label_ratios={"a": 6.0, "b": 8.0}),
                       {"labels": ["x", "y"]}, None).id
    # this process's string hashes are seeded at random; the other one's with a fixed seed
    env = {**os.environ, "PYTHONHASHSEED": "1"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == here


def test_a_tampered_or_missing_address_is_refused(pipe, states, tmp_path):
    from kite.store import CorruptState, StoreError, Unaddressed, verify_state
    from kite.upcycle import StateFile, compress_document
    from kite.upcycle.format import rewrite_header

    address, path, _ = states[0]
    with StateFile(path) as sf:
        meta = dict(sf.meta)
    meta["address"] = {**meta["address"], "tokens_sha256": "0" * 64}
    rewrite_header(path, tmp_path / "forged.upc", meta)
    with pytest.raises(CorruptState, match="not the hash of its fields"):
        verify_state((tmp_path / "forged.upc").read_bytes())
    # filed under another id
    with pytest.raises(CorruptState, match="filed under"):
        verify_state(states[1][2], expect_id=address)
    # written without an address (a library call, or before addresses): clean but unaddressed
    compress_document(pipe.lm, CORPUS, tmp_path / "plain.upc", pipe.settings)
    with pytest.raises(Unaddressed):
        verify_state((tmp_path / "plain.upc").read_bytes())
    with pytest.raises(Unaddressed):
        _store("mem://").put((tmp_path / "plain.upc").read_bytes())
    with pytest.raises(BadInput):   # nothing stored
        _store("mem://").put(b"not a state")
    assert StoreError is not None


def test_migrate_drops_the_address(states, tmp_path):
    import shutil

    from kite.upcycle import StateFile, migrate

    _, path, _ = states[0]
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(path, folder / "s.upc")
    with StateFile(folder / "s.upc") as sf:
        old = sf.meta["fingerprints"]["combined"]
    migrate(folder, old, "kite-fp1:" + "ab" * 32, force=True)
    (moved,) = folder.glob("*.upc")
    with StateFile(moved) as sf:
        assert "address" not in sf.meta       # the moved state is not what its address named


# ---------------------------------------------------------------- reads, promotion, corruption

def test_reads_go_top_down_and_promote_hits(states, tmp_path):
    store = _store(f"mem://?max=10MB,file://{tmp_path}/disk")
    address, _, data = states[0]
    store.tiers[1].put(address, data)          # only on disk
    assert store.where(address) == ["file"]
    assert store.get(address) == data
    assert store.where(address) == ["mem", "file"]
    assert store.get(address) == data
    assert store.counters.hits == {"file": 1, "mem": 1}
    assert store.get("f" * 64) is None and store.counters.misses == 1


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "other state"])
def test_a_corrupt_copy_is_never_returned_and_is_refetched_below(states, tmp_path, damage):
    store = _store(f"mem://,file://{tmp_path}/disk")
    address, _, data = states[0]
    store.put(data)
    bad = {"truncated": data[: len(data) - 100],
           "flipped byte": data[:-50] + bytes([data[-50] ^ 1]) + data[-49:],
           "other state": states[1][2]}[damage]
    store.tiers[0].put(address, bad)           # the memory tier's copy is torn
    assert store.get(address) == data
    assert store.counters.snapshot()["errors"] == [{"tier": "mem", "op": "verify", "count": 1}]
    assert store.tiers[0].get(address) == data  # repaired by the promotion
    # torn in the only tier that has it: a miss, never the bad bytes
    (tmp_path / "disk" / f"{address}.upc").write_bytes(bad)
    store.tiers[0].delete(address)
    assert store.get(address) is None
    assert ("file", "verify") in store.counters.errors
    assert not (tmp_path / "disk" / f"{address}.upc").exists()   # dropped from that tier


class FailingTier:
    """A tier whose backend is down: every call raises TierError (the fake for fault injection)."""

    def __new__(cls, name="down", write="through"):
        from kite.store import MemoryTier, TierError

        class Down(MemoryTier):
            def _fail(self, op):
                raise TierError(self.name, op, "connection refused")

            def get(self, state_id):
                self._fail("get")

            def put(self, state_id, data):
                self._fail("put")

            def ids(self):
                self._fail("list")

            def stat(self, state_id):
                self._fail("stat")

            def usage(self):
                self._fail("stat")

        return Down(name, write)


def test_a_tier_that_is_down_is_skipped_and_counted(states, tmp_path):
    from kite.store import DiskTier, TieredStore

    store = TieredStore([FailingTier(), DiskTier(tmp_path / "disk")])
    address, _, data = states[0]
    report = store.put(data)
    assert report.tiers["file"] == "stored" and report.failed == {"down": "failed: connection refused"}
    assert store.get(address) == data           # fell through to the disk
    errors = {(e["tier"], e["op"]): e["count"] for e in store.counters.snapshot()["errors"]}
    assert errors[("down", "put")] == 1 and errors[("down", "get")] == 1 and errors[("down", "promote")] == 1
    stats = store.stats()
    assert stats["tiers"][0]["error"] and stats["tiers"][0]["objects"] is None
    assert stats["recent_failures"][0]["tier"] == "down"


def test_a_full_disk_is_reported_and_a_put_nothing_took_raises(states, tmp_path, monkeypatch):
    import kite.store.disk as disk
    from kite.store import StoreError

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "write_bytes", full)
    store = _store(f"mem://,file://{tmp_path}/disk")
    report = store.put(states[0][2])
    assert report.tiers == {"mem": "stored", "file": f"failed: {tmp_path}/disk/{states[0][0]}.upc: the disk is full"}
    assert store.counters.errors[("file", "put")] == 1
    with pytest.raises(StoreError, match="no store tier took"):
        _store(f"file://{tmp_path}/disk2").put(states[0][2])


def test_write_back_tiers_are_written_in_the_background_and_failures_reported(states, tmp_path):
    from kite.store import DiskTier, MemoryTier, TieredStore

    store = TieredStore([MemoryTier(), DiskTier(tmp_path / "disk", write="back"), FailingTier("remote", "back")])
    address, _, data = states[0]
    report = store.put(data)
    assert report.tiers == {"mem": "stored", "file": "queued", "remote": "queued"}
    failures = store.flush()
    assert (tmp_path / "disk" / f"{address}.upc").read_bytes() == data
    assert [(f["tier"], f["op"]) for f in failures] == [("remote", "put")]
    assert store.counters.errors[("remote", "put")] == 1
    # the missed write-back is journaled; once the tier takes a put again it gets the missed state too
    assert [(m.tier, m.id) for m in store.journal.pending()] == [(f"remote {store.tiers[2].describe()}", address)]
    back = MemoryTier("remote")
    store.tiers[2] = back
    other = states[1][2]
    store.put(other)
    store.flush()
    assert sorted(back.ids()) == sorted([address, states[1][0]]) and store.journal.pending() == []


# ---------------------------------------------------------------- bounds and the disk index

def test_memory_tier_keeps_its_bound_least_recently_used_out(states):
    sizes = [len(d) for _, _, d in states]
    store = _store(f"mem://?max={sizes[0] + sizes[1] + 10}")
    store.put(states[0][2])
    store.put(states[1][2])
    store.get(states[0][0])                     # 0 is now the most recent
    store.put(states[2][2])
    held = set(store.tiers[0].ids())
    assert states[1][0] not in held and states[0][0] in held
    assert store.stats()["tiers"][0]["evictions"] >= 1
    assert store.stats()["tiers"][0]["bytes"] <= sizes[0] + sizes[1] + 10
    tiny = _store("mem://?max=100")
    assert tiny.put(states[0][2]).tiers["mem"].startswith("declined")


@pytest.mark.slow   # a fresh KITE process
def test_disk_index_is_rebuilt_from_the_files_headers_in_a_fresh_process(states, tmp_path):
    folder = tmp_path / "disk"
    store = _store(f"file://{folder}")
    for _, _, data in states:
        store.put(data)
    (folder / f"{'a' * 64}.upc").write_bytes(states[0][2])   # a state under another's name
    (folder / "notes.upc").write_text("hello")
    code = ("import json; from kite.store import DiskTier; t = DiskTier(%r); "
            "print(json.dumps({'ids': t.ids(), 'rejected': t.rejected}))" % str(folder))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert got["ids"] == sorted(a for a, _, _ in states)
    assert sorted(got["rejected"]) == sorted(["a" * 64, "notes"])
    assert "holds state" in got["rejected"]["a" * 64] and "not a state address" in got["rejected"]["notes"]


def test_gc_evicts_a_disk_tier_to_its_bound(states, tmp_path):
    folder = tmp_path / "disk"
    big = _store(f"file://{folder}")
    for _, _, data in states:
        big.put(data)
    bound = len(states[2][2]) + 10
    store = _store(f"file://{folder}?max={bound}")
    dropped = store.gc()["file"]
    assert len(dropped) == 2
    assert store.tiers[0].usage()[1] <= bound


@pytest.mark.parametrize("url,message", [
    ("", "empty"),
    ("mem://?max=lots", "expected a size"),
    ("ftp://host/x", "scheme 'ftp'"),
    ("mem://,mem://", "one mem:// tier"),
    ("file://", "needs a folder"),
    ("mem://?color=red", "unknown parameter color"),
    ("mem://?write=later", "write='later'"),
    ("redis://", "needs host:port"),
    ("s3://", "needs a bucket"),
    ("mem://,,file:///tmp/x", "empty tier"),
])
def test_bad_store_urls_are_one_line(url, message):
    with pytest.raises(BadInput, match=message) as err:
        _store(url)
    assert "\n" not in str(err.value)
