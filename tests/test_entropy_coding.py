"""Entropy coding of a state's quantized coefficients (``compression.entropy_coding``,
``kite upcycle compress --entropy-coding``): parts stored with their codes entropy coded read back
as the very blobs the codec wrote, a state at a ratio keeps its size and spends the saved bits on
its components, and a damaged coded part is named in one line."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kite.errors import BadInput
from kite.upcycle import codec
from kite.upcycle.codec import entropy, state_bits
from kite.upcycle.codec.entropy import entropy_code, part_runs
from kite.upcycle.compress import CompressSettings, compress_document
from kite.upcycle.format import StateFile, codec_blob, entropy_blob
from kite.upcycle.load import load_prefix
from tests.tiny_models import CORPUS

# the embedded model: states of real sizes (a tiny model's parts are too small for coding to pay)
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]
TEXT = " ".join([CORPUS] * 3)    # ~1,300 tokens: parts of a few thousand codes, as real states have


@pytest.fixture(scope="module")
def lm(embedded):
    """The embedded model: a tiny model's parts are too small for coding to pay (they stay raw)."""
    return embedded


def _settings(ratio: float, coded: bool) -> CompressSettings:
    return CompressSettings(codec=codec.settings_for(ratio), n_clusters=3, min_span_tokens=8, max_span_tokens=48,
                            entropy_coding=coded)


def _blobs(path) -> dict[str, bytes]:
    with StateFile(path) as st:
        return {key: st.read(key) for key in st.index}


def _bits(blobs: dict[str, bytes]) -> int:
    """Every component bit the layer codecs allocated (both sides of every layer)."""
    total = 0
    for key, data in blobs.items():
        if "/" in key:
            continue
        _, table, _ = codec_blob.read_table(data)
        for name, dt, shape, off in table:
            if name.endswith(".bits"):
                total += int(codec_blob.numpy_at(np.frombuffer(data, dtype=np.uint8), (off, dt, shape)).sum())
    return total


@pytest.fixture(scope="module")
def plain(lm, tmp_path_factory):
    path = tmp_path_factory.mktemp("plain") / "p.upc"
    made = compress_document(lm, TEXT, path, _settings(8, False))
    return made, _blobs(path)


@pytest.fixture(scope="module")
def coded(lm, tmp_path_factory):
    """The document's 8x state, entropy coded, made once: (what compress_document answered, its path).
    A test that changes it works on a copy."""
    path = tmp_path_factory.mktemp("coded") / "e.upc"
    return compress_document(lm, TEXT, path, _settings(8, True)), path


def test_every_part_comes_back_as_the_blob_the_codec_wrote(plain):
    _, blobs = plain
    stored, section = entropy_code(list(blobs.items()))
    tables = entropy_blob.tables_from(section)
    coded = [(key, data, raw) for key, data, raw, how in stored if how == entropy_blob.CODEC]
    # a part of a few hundred codes stays raw (its runs' headers would cost what coding saves)
    assert len(coded) >= len([k for k in blobs if "/" in k]) // 4
    for key, data, raw in coded:
        assert raw == len(blobs[key]) and len(data) < raw
        assert entropy_blob.unpack(data, raw, tables) == blobs[key], key
    assert all(how == "raw" for key, _, _, how in stored if "/" not in key)   # layer codecs stay as they are


def test_a_parts_runs_are_its_codes_bit_classes(plain):
    _, blobs = plain
    (offset, length), runs = part_runs(blobs["L0"], blobs["c0/L0/K"], "k")
    _, table, _ = codec_blob.read_table(blobs["c0/L0/K"])
    codes = next((off, shape) for name, _, shape, off in table if name == "codes")
    assert (offset, length) == (codes[0], codes[1][0])
    widths = [bw for bw, _ in runs]
    assert widths == sorted(set(widths)) and all(1 <= bw <= 8 for bw in widths)


@pytest.mark.parametrize("ratio", [8, 16])
def test_a_coded_state_is_the_ratio_asked_and_spends_what_coding_saved(lm, plain, coded, tmp_path, ratio):
    if ratio == 8:
        base, (made, path) = plain, coded
    else:
        base = (compress_document(lm, TEXT, tmp_path / "p.upc", _settings(ratio, False)), _blobs(tmp_path / "p.upc"))
        path = tmp_path / "e.upc"
        made = compress_document(lm, TEXT, path, _settings(ratio, True))
    assert abs(made.compression_ratio / ratio - 1) <= 0.03, made.compression_ratio
    assert "entropy" in made.timings_ms
    with StateFile(path) as st:
        assert set(entropy_blob.tables_from(st.meta["entropy"])) <= set(range(1, 9))
        assert {e.codec for key, e in st.index.items() if "/" in key} >= {entropy_blob.CODEC}
    assert _bits(_blobs(path)) > _bits(base[1])    # the saved bytes went to more bits


def test_a_coded_state_loads_on_both_paths_as_its_blobs_say(lm, coded, tmp_path):
    """The host load and the GPU path's staging (run on the CPU) read a coded state as the same
    state stored plain: its blobs decoded, rewritten raw."""
    import shutil

    import torch

    from kite.upcycle.format import StateWriter
    from tests.test_gpu_path import _staged_load

    shutil.copy(coded[1], tmp_path / "e.upc")
    with StateFile(tmp_path / "e.upc") as st:
        assert st.verify()
        writer = StateWriter(zstd=False)
        writer.add_many([(key, st.read(key)) for key in st.index])
        writer.write(tmp_path / "plain.upc", {k: v for k, v in st.meta.items()
                                              if k not in ("content", "signature", "entropy")})
    want, _ = load_prefix(tmp_path / "plain.upc", lm)
    got, report = load_prefix(tmp_path / "e.upc", lm)
    _, keys, values = _staged_load(tmp_path / "e.upc", lm)
    assert report.tokens > 0
    for layer in range(lm.geometry.n_layers):
        assert torch.equal(got.keys[layer], want.keys[layer]) and torch.equal(got.values[layer], want.values[layer])
        assert torch.allclose(keys[layer], want.keys[layer], atol=1e-4 * float(want.keys[layer].abs().max()))
        assert torch.allclose(values[layer], want.values[layer], atol=1e-4 * float(want.values[layer].abs().max()))


def test_without_a_budget_coding_only_shrinks_the_file(plain):
    _, blobs = plain
    calls = []

    def code(bonus):
        calls.append(bonus)
        return list(blobs.items())

    stored, section, ms = entropy.coded_within(code, None)
    assert calls == [0] and ms >= 0 and section is not None
    assert sum(len(d) for _, d, _, _ in stored) < sum(len(b) for b in blobs.values())


def test_the_budget_is_refilled_until_the_blobs_take_it(plain):
    """The bytes the entropy coding saved go back into the next coding until the stored blobs take the
    plain coding's budget (here a stand-in whose blobs grow by the bonus in bytes no coding shrinks)."""
    import random

    _, blobs = plain
    items = list(blobs.items())
    plain_bytes = sum(len(b) for b in blobs.values())
    calls = []

    def code(bonus):
        calls.append(bonus)
        return items + ([("pad", random.Random(bonus).randbytes(bonus))] if bonus > 0 else [])

    stored, _, _ = entropy.coded_within(code, lambda: plain_bytes)
    assert calls[0] == 0 and calls[1] > 0 and len(calls) <= state_bits.PASSES
    assert abs(sum(len(d) for _, d, _, _ in stored) - plain_bytes) <= state_bits.TOLERANCE * plain_bytes


def test_a_damaged_coded_part_is_one_line_naming_it(lm, coded, tmp_path):
    from kite.upcycle.format.mutants import resealed

    with StateFile(coded[1]) as st:
        key, e = next((k, e) for k, e in st.index.items() if e.codec == entropy_blob.CODEC)
        start = st.data_start + e.offset
    data = bytearray(coded[1].read_bytes())
    _, offset, _, nruns = struct.unpack_from("<3sIIB", data, start)
    first_run = start + 12 + 9 * nruns + offset
    data[first_run:first_run + 16] = bytes(16)      # its first run's coder header and states zeroed;
    #                                                 every checksum made again
    (tmp_path / "bad.upc").write_bytes(resealed(bytes(data)))
    with StateFile(tmp_path / "bad.upc") as st, pytest.raises(BadInput) as err:
        st.read(key)
    assert f"part {key}" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(BadInput):
        load_prefix(tmp_path / "bad.upc", lm)


@pytest.mark.parametrize("damage", ["magic", "runs", "length", "table"])
def test_entropy_blob_refuses_what_it_cannot_read(plain, damage):
    _, blobs = plain
    stored, section = entropy_code(list(blobs.items()))
    tables = entropy_blob.tables_from(section)
    key, data, raw, _ = next(row for row in stored if row[3] == entropy_blob.CODEC)
    if damage == "magic":
        data = b"XXX" + data[3:]
    elif damage == "runs":
        data = data[:11] + bytes([255]) + data[12:]      # more runs than the part holds
    elif damage == "length":
        data = data[:-1]
    else:
        tables = {}
    with pytest.raises(ValueError):
        entropy_blob.unpack(data, raw, tables)


def test_the_compress_command_codes_a_state_when_asked(tmp_path):
    import json

    from typer.testing import CliRunner

    from kite.cli.main import app

    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT)
    args = ["upcycle", "compress", "--model", "smollm2-135m", "--input", str(doc), "--ratio", "8", "--json"]
    plain = CliRunner().invoke(app, args + ["--output", str(tmp_path / "p.upc")])
    coded = CliRunner().invoke(app, args + ["--output", str(tmp_path / "e.upc"), "--entropy-coding"])
    assert plain.exit_code == 0 and coded.exit_code == 0, coded.output
    with StateFile(tmp_path / "e.upc") as st:
        assert any(e.codec == entropy_blob.CODEC for e in st.index.values()) and "entropy" in st.meta
    with StateFile(tmp_path / "p.upc") as st:
        assert all(e.codec == "raw" for e in st.index.values()) and "entropy" not in st.meta
    ratio = json.loads(coded.stdout[coded.stdout.index("{"):])["compression_ratio"]
    assert abs(ratio / 8 - 1) <= 0.03
    seen = CliRunner().invoke(app, ["upcycle", "inspect", str(tmp_path / "e.upc"), "--json"])
    ec = json.loads(seen.stdout[seen.stdout.index("{"):])["entropy_coded"]
    assert 0 < ec["parts"] <= ec["of_parts"] and ec["bytes_saved"] > 0
    seen = CliRunner().invoke(app, ["upcycle", "inspect", str(tmp_path / "p.upc"), "--json"])
    assert json.loads(seen.stdout[seen.stdout.index("{"):])["entropy_coded"] is None


def test_a_coded_part_claiming_a_huge_plain_length_is_refused_when_the_state_opens(coded, tmp_path):
    import json as js

    from kite.upcycle.format.mutants import resealed

    data = bytearray(coded[1].read_bytes())
    hlen = struct.unpack_from("<I", data, 12)[0]
    meta = js.loads(bytes(data[32:32 + hlen]))
    row = next(r for r in meta["blobs"] if r[4] == entropy_blob.CODEC)
    row[3] = 1 << 40                     # a terabyte from a few kilobytes
    header = js.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode()
    bad = bytes(data[:12]) + struct.pack("<I", len(header)) + bytes(data[16:32]) + header + bytes(data[32 + hlen:])
    (tmp_path / "bad.upc").write_bytes(resealed(bad))
    with pytest.raises(BadInput, match="entropy coded in"):
        StateFile(tmp_path / "bad.upc")


def test_the_eval_command_measures_a_coded_state(tmp_path):
    import json

    from typer.testing import CliRunner

    from kite.cli.main import app

    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT)
    r = CliRunner().invoke(app, ["upcycle", "eval", "--model", "smollm2-135m", "--input", str(doc), "--ratio", "8",
                                 "--context-tokens", "768", "--continuation-tokens", "64", "--entropy-coding", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout[r.stdout.index("{"):])
    assert abs(got["compression_ratio"] / 8 - 1) <= 0.03 and got["ppl_state"] > 0


def test_a_server_whose_config_asks_for_it_stores_coded_states_and_answers_from_them(lm, tmp_path):
    import httpx

    from kite.serve import BackgroundServer, create_app
    from kite.upcycle import Pipeline, UpcycleConfig, compress_settings
    from kite.yoco.health import HealthStore
    from tests.test_serve import _settings

    cfg = UpcycleConfig.model_validate({"compression": {"svd_ratio": 0.125, "cluster_num": 3, "min_span_tokens": 8,
                                                        "max_span_tokens": 48, "entropy_coding": True}})
    pipe = Pipeline(lm=lm, tagger=None, settings=compress_settings(cfg), config=cfg, config_path=None)
    settings = _settings(tmp_path, fusion=True)
    server = BackgroundServer(create_app(pipe, settings, health=HealthStore(tmp_path / "health.sqlite")))
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            r = c.post("/v1/states", json={"document": TEXT})
            assert r.status_code in (200, 201), r.text
            sid = r.json()["id"]
            with StateFile(next((tmp_path / "states").rglob("*.upc"))) as st:
                assert any(e.codec == entropy_blob.CODEC for e in st.index.values())
            r = c.post("/v1/completions", json={"prompt": " Who pays the fees?", "max_tokens": 2,
                                                "kite": {"state": sid}})
            assert r.status_code == 200, r.text
            assert r.json()["kite"]["loaded"] is True
    finally:
        server.stop()


def test_a_setting_that_is_not_true_or_false_is_refused_before_anything_runs(tmp_path):
    from typer.testing import CliRunner

    from kite.cli.main import app

    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text("compression:\n  entropy_coding: sometimes\n")
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT)
    r = CliRunner().invoke(app, ["upcycle", "compress", "--model", "smollm2-135m", "--input", str(doc),
                                 "--output", str(tmp_path / "e.upc"), "--config", str(cfg)])
    assert r.exit_code == 2 and "entropy_coding" in r.output, r.output
    assert not (tmp_path / "e.upc").exists()
