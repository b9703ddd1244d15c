"""The loader's in-process caches: blob checksums verified once per file version, tables reused.

A later staging of the unchanged file skips re-hashing and rebuilding the tables; a file changed
in place (a new mtime) is verified again, and a corrupt blob never loads silently.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from kite.errors import BadInput
from kite.upcycle import codec, load
from kite.upcycle.compress import CompressSettings, compress_document
from kite.upcycle.rope import rope_cos_sin
from kite.upcycle.format import StateFile
from tests.tiny_models import CORPUS

DOC = CORPUS.replace(". ", ".\n\n", 3)


@pytest.fixture(scope="module")
def lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["qwen2"]), device="cpu")


@pytest.fixture()
def state(lm, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "s.upc"
    compress_document(lm, DOC, out, CompressSettings(codec=codec.settings_for(4), n_clusters=3, min_span_tokens=8,
                                                     max_span_tokens=24))
    load.forget_verified()
    yield out
    load.forget_verified()


class _Count:
    """Counts the blob checksum checks (the real check underneath)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = StateFile.check_blob

        def counted(sf, key, stored):
            self.n += 1
            return real(sf, key, stored)

        monkeypatch.setattr(StateFile, "check_blob", counted)


def _stage(path, lm, verify=True):
    with StateFile(path) as sf:
        sel = [(c["id"], None) for c in sf.meta["clusters"]]
        pos = [torch.cat([torch.arange(s, e) for s, e in c["token_ranges"]]) for c in sf.meta["clusters"]]
        geo = lm.geometry
        hot = load.stage_state(sf, sel, pos, list(range(geo.n_layers)), n_layers=geo.n_layers,
                                   H=geo.n_kv_heads, d=geo.head_dim, verify=verify, threads=2)
        n_blobs = len(sf.index)
    cos, sin = rope_cos_sin(lm.model, hot.positions)
    keys, values = load.load_staged(hot, device="cpu", dtype=torch.float32, cos=cos, sin=sin)
    return hot, keys, values, n_blobs


def _flip_byte_in_place(path, key):
    with StateFile(path) as sf:
        at = sf.data_start + sf.index[key].offset + sf.index[key].length // 2
    before = os.stat(path).st_mtime_ns
    # kept as a sleep: what is tested is a rewrite the file system's coarse timestamps can tell apart
    # (the cache keys on mtime), so the write must land in a later tick than `before`
    time.sleep(0.02)
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x5A]))
    assert os.stat(path).st_mtime_ns != before


def test_repeat_staging_skips_hashing_and_table_building(state, lm, monkeypatch):
    count = _Count(monkeypatch)
    hot1, k1, v1, n_blobs = _stage(state, lm)
    assert count.n == n_blobs and not hot1.cached_tables       # every blob of the load checked once
    hot2, k2, v2, _ = _stage(state, lm)
    assert count.n == n_blobs and hot2.cached_tables            # unchanged file: no hash, cached tables
    for a, b in zip(k1 + v1, k2 + v2):
        assert torch.equal(a, b)


def test_file_modified_in_place_is_verified_again(state, lm, monkeypatch):
    _stage(state, lm)
    with StateFile(state) as sf:
        key = next(k for k in sf.index if k.endswith("/V"))
    _flip_byte_in_place(state, key)
    count = _Count(monkeypatch)
    with pytest.raises(BadInput, match="checksum mismatch"):
        _stage(state, lm)
    assert count.n > 0
    with pytest.raises(BadInput, match="checksum mismatch"):   # still refused on the next try
        _stage(state, lm)


def test_corrupt_blob_detected_on_first_load_and_unverified_loads_record_nothing(state, lm):
    with StateFile(state) as sf:
        key = next(k for k in sf.index if k.endswith("/K"))
    _flip_byte_in_place(state, key)
    _stage(state, lm, verify=False)                  # not checked: loads (garbage), records nothing
    with pytest.raises(BadInput, match=f"checksum mismatch in part {key}"):
        _stage(state, lm)


def test_rewritten_file_gets_a_new_version(state, lm, monkeypatch):
    _stage(state, lm)
    data = state.read_bytes()
    tmp = state.with_suffix(".new")
    tmp.write_bytes(data)
    os.replace(tmp, state)                           # atomic replace: a new inode, same bytes
    count = _Count(monkeypatch)
    hot, *_ = _stage(state, lm)
    assert count.n > 0 and not hot.cached_tables


# --- verified-version records across processes ---------------------------------------------------

@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """The cross-process records go to this test's own KITE_CACHE."""
    monkeypatch.setenv("KITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KITE_VERIFY_RECORD", raising=False)


def _rewrite_with_writer(src, dst):
    """src's blobs written again by StateWriter (which records the new file as verified)."""
    from kite.upcycle.format import StateWriter

    with StateFile(src) as sf:
        w = StateWriter()
        for key in sf.index:
            w.add(key, sf.read(key))
        w.write(dst, dict(sf.meta))
    return dst


_STAGE_IN_CHILD = """
import sys, torch
from kite.upcycle import load
from kite.upcycle.format import StateFile
with StateFile(sys.argv[1]) as sf:
    g = sf.meta["model"]["geometry"]
    sel = [(c["id"], None) for c in sf.meta["clusters"]]
    pos = [torch.cat([torch.arange(s, e) for s, e in c["token_ranges"]]) for c in sf.meta["clusters"]]
    load.stage_state(sf, sel, pos, list(range(g["n_layers"])), n_layers=g["n_layers"], H=g["n_kv_heads"],
                         d=g["head_dim"], threads=2)
load.flush_records()
"""


def _stage_in_another_process(path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", _STAGE_IN_CHILD, str(path)], check=True, cwd=root,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))},
                   timeout=300)


def test_writer_records_the_file_it_wrote(state, lm, monkeypatch):
    out = _rewrite_with_writer(state, state.with_name("w.upc"))
    load.forget_verified(persisted=False)          # a new process: nothing in memory
    count = _Count(monkeypatch)
    hot, k1, v1, _ = _stage(out, lm)
    assert count.n == 0 and not hot.cached_tables      # the writer's record: no blob hashed
    load.forget_verified(out)                      # record dropped: every blob hashed again
    hot2, k2, v2, n_blobs = _stage(out, lm)
    assert count.n == n_blobs
    for a, b in zip(k1 + v1, k2 + v2):
        assert torch.equal(a, b)


def test_writer_records_nothing_when_turned_off(state, lm, monkeypatch):
    monkeypatch.setenv("KITE_VERIFY_RECORD", "0")
    out = _rewrite_with_writer(state, state.with_name("w.upc"))
    monkeypatch.delenv("KITE_VERIFY_RECORD")
    load.forget_verified(persisted=False)
    count = _Count(monkeypatch)
    _, _, _, n_blobs = _stage(out, lm)
    assert count.n == n_blobs


@pytest.mark.slow
def test_record_of_another_process_honoured_only_for_the_identical_version(state, lm, monkeypatch):
    _stage_in_another_process(state)                   # verifies every blob there and records it
    load.forget_verified(persisted=False)
    count = _Count(monkeypatch)
    _stage(state, lm)
    assert count.n == 0                                 # same version: taken from the record
    # replaced by a copy (same bytes, new inode): another version, hashed again
    tmp = state.with_suffix(".new")
    tmp.write_bytes(state.read_bytes())
    os.replace(tmp, state)
    load.forget_verified(persisted=False)
    _, _, _, n_blobs = _stage(state, lm)
    assert count.n == n_blobs
    # recorded again by another process, then modified in place: re-verified and refused
    _stage_in_another_process(state)
    with StateFile(state) as sf:
        key = next(k for k in sf.index if k.endswith("/V"))
    _flip_byte_in_place(state, key)
    load.forget_verified(persisted=False)
    with pytest.raises(BadInput, match=f"checksum mismatch in part {key}"):
        _stage(state, lm)


def test_corrupt_blob_caught_when_no_record(state, lm, monkeypatch):
    out = _rewrite_with_writer(state, state.with_name("w.upc"))
    with StateFile(out) as sf:
        key = next(k for k in sf.index if k.endswith("/K"))
    _flip_byte_in_place(out, key)                      # new version: the writer's record no longer counts
    load.forget_verified(persisted=False)
    with pytest.raises(BadInput, match=f"checksum mismatch in part {key}"):
        _stage(out, lm)
    load.forget_verified()                         # no record at all
    with pytest.raises(BadInput, match=f"checksum mismatch in part {key}"):
        _stage(out, lm)
    with StateFile(out) as sf:                         # the full check never trusts a record
        assert sf.verify()[key].startswith("corrupt")


def test_writer_keeps_zstd_for_large_blobs_only_where_it_saves_a_lot(tmp_path):
    import numpy as np

    from kite.upcycle.format import LARGE_BLOB, LARGE_MIN_SAVING, StateWriter

    rng = np.random.default_rng(0)
    seven_bit = lambda n: rng.integers(0, 128, n, dtype=np.uint8).tobytes()   # noqa: E731  ~12 % under zstd
    # the parts of a one-layer, two-cluster state (a header names every part its geometry calls for)
    small, large, zeros, noise, empty = "L0", "c0/L0/K", "c0/L0/V", "c1/L0/K", "c1/L0/V"
    blobs = {small: seven_bit(4096), large: seven_bit(4 * LARGE_BLOB), zeros: bytes(4 * LARGE_BLOB),
             noise: rng.integers(0, 256, 8192, dtype=np.uint8).tobytes(), empty: b""}
    meta = {"format": "kite-upc", "n_tokens": 2, "model": {"geometry": {"n_layers": 1, "n_kv_heads": 1, "head_dim": 8}},
            "codec": {"k_mode": "raw", "v_mode": "raw"},
            "clusters": [{"id": 0, "label": "a", "token_ranges": [[0, 1]], "n_tokens": 1},
                         {"id": 1, "label": "b", "token_ranges": [[1, 2]], "n_tokens": 1}]}
    w = StateWriter(large_min_saving=LARGE_MIN_SAVING)  # the GPU-serving rule
    for k, b in blobs.items():
        w.add(k, b)
    w.write(tmp_path / "z.upc", meta)
    old = StateWriter()                                # the default: 3 % for every blob
    for k, b in blobs.items():
        old.add(k, b)
    old.write(tmp_path / "z_old.upc", meta)
    with StateFile(tmp_path / "z.upc") as sf, StateFile(tmp_path / "z_old.upc") as so:
        assert {k: e.codec for k, e in sf.index.items()} == {small: "zstd", large: "raw", zeros: "zstd",
                                                              noise: "raw", empty: "raw"}
        assert so.index[large].codec == "zstd"
        for k, b in blobs.items():
            assert sf.read(k) == b == so.read(k)


# --- the loader's tables kept across processes ------------------------------------------------------

class _CountTables:
    """Counts the tables built (one parts_layout call per side of a layer built, none when copied)."""

    def __init__(self, monkeypatch):
        from kite.upcycle.load import staging

        self.n = 0
        real = staging.parts_layout

        def counted(*a, **k):
            self.n += 1
            return real(*a, **k)

        monkeypatch.setattr(staging, "parts_layout", counted)


def _same_plans(a, b):
    return all(pa.sides == pb.sides and pa.off == pb.off and pa.size == pb.size
               for pa, pb in zip(a.layers, b.layers))


def test_tables_kept_for_a_new_process(state, lm, monkeypatch):
    """A new process staging a file some process staged copies the tables it saved: same plans,
    same KV, nothing built; a damaged tables file is ignored."""
    hot1, k1, v1, _ = _stage(state, lm)
    load.flush_records()
    assert len(list(load.tables_dir().glob("*.tbl"))) == 1
    load.forget_verified(persisted=False)          # a new process: nothing in memory
    built = _CountTables(monkeypatch)
    hot2, k2, v2, _ = _stage(state, lm)
    assert hot2.cached_tables and built.n == 0 and _same_plans(hot1, hot2)
    for a, b in zip(k1 + v1, k2 + v2):
        assert torch.equal(a, b)
    (tbl,) = load.tables_dir().glob("*.tbl")
    tbl.write_bytes(tbl.read_bytes()[:-100])            # cut short: not used, built again
    load.forget_verified(persisted=False)
    hot3, k3, v3, _ = _stage(state, lm)
    assert not hot3.cached_tables and built.n > 0 and _same_plans(hot1, hot3)
    for a, b in zip(k1 + v1, k3 + v3):
        assert torch.equal(a, b)


def test_prepared_state_loads_without_hashing_or_building_tables(state, lm, monkeypatch):
    """compress_document on a GPU prepares the file it wrote: a new process's first load neither
    hashes (the writer's record) nor builds tables; dropping the record drops the tables."""
    out = _rewrite_with_writer(state, state.with_name("w.upc"))
    _stage(out, lm, verify=False)                      # tables in memory only: an unverified load keeps nothing
    load.flush_records()
    assert not list(load.tables_dir().glob("*.tbl"))
    assert load.prepare_state(out)                 # kept now, though this process had them already
    assert len(list(load.tables_dir().glob("*.tbl"))) == 1
    load.forget_verified(persisted=False)
    count, built = _Count(monkeypatch), _CountTables(monkeypatch)
    hot, *_ = _stage(out, lm)
    assert count.n == 0 and built.n == 0 and hot.cached_tables
    load.forget_verified(out)
    assert not list(load.tables_dir().glob("*.tbl"))


def test_tables_of_another_version_are_not_used(state, lm, monkeypatch):
    _stage(state, lm)
    load.flush_records()
    tmp = state.with_suffix(".new")
    tmp.write_bytes(state.read_bytes())
    os.replace(tmp, state)                             # same bytes, a new inode: another version
    load.forget_verified(persisted=False)
    built = _CountTables(monkeypatch)
    hot, *_ = _stage(state, lm)
    assert not hot.cached_tables and built.n > 0


def test_no_tables_kept_when_records_are_off(state, lm, monkeypatch):
    monkeypatch.setenv("KITE_VERIFY_RECORD", "0")
    assert not load.prepare_state(state)
    _stage(state, lm)
    load.flush_records()
    assert not list(load.tables_dir().glob("*.tbl"))
