"""gpu_load's in-process caches: blob checksums verified once per file version, tables reused.

A later staging of the unchanged file skips re-hashing and rebuilding the tables; a file changed
in place (a new mtime) is verified again, and a corrupt blob never loads silently.
"""

from __future__ import annotations

import hashlib
import os
import time
import types

import pytest
import torch

from kite.errors import BadInput
from kite.upcycle import codec, gpu_load
from kite.upcycle.compress import CompressSettings, compress_document
from kite.upcycle.rope import rope_cos_sin
from kite.upcycle.state_file import StateFile
from tests.tiny_models import CORPUS

DOC = CORPUS.replace(". ", ".\n\n", 3)


@pytest.fixture(scope="module")
def lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["qwen2"]))


@pytest.fixture()
def state(lm, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "s.upc"
    compress_document(lm, DOC, out, CompressSettings(codec=codec.settings_for(4), n_clusters=3, min_span_tokens=8,
                                                     max_span_tokens=24))
    gpu_load.forget_verified()
    yield out
    gpu_load.forget_verified()


class _Count:
    """Counts the blake2b calls made by gpu_load (the real hash underneath)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = hashlib.blake2b

        def counted(*a, **k):
            self.n += 1
            return real(*a, **k)

        monkeypatch.setattr(gpu_load, "hashlib", types.SimpleNamespace(blake2b=counted))


def _stage(path, lm, verify=True):
    with StateFile(path) as sf:
        sel = [(c["id"], None) for c in sf.meta["clusters"]]
        pos = [torch.cat([torch.arange(s, e) for s, e in c["token_ranges"]]) for c in sf.meta["clusters"]]
        geo = lm.geometry
        hot = gpu_load.stage_state(sf, sel, pos, list(range(geo.n_layers)), n_layers=geo.n_layers,
                                   H=geo.n_kv_heads, d=geo.head_dim, verify=verify, threads=2)
        n_blobs = len(sf.index)
    cos, sin = rope_cos_sin(lm.model, hot.positions)
    keys, values = gpu_load.load_staged(hot, device="cpu", dtype=torch.float32, cos=cos, sin=sin)
    return hot, keys, values, n_blobs


def _flip_byte_in_place(path, key):
    with StateFile(path) as sf:
        at = sf._data_start + sf.index[key].offset + sf.index[key].length // 2
    before = os.stat(path).st_mtime_ns
    time.sleep(0.02)   # the file system's timestamps are coarse: let the write land in a later tick
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
