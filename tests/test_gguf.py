"""`kite gguf`: states embedded in a GGUF model file (embed, list, extract), offered by id to
`kite generate --upc` and `kite serve`; the GGUF copy keeps every tensor and key as it was.

Units use a small GGUF written here (random tensors, some of them quantized) and the tiny Llama's
state, with the model's fingerprint given (a random GGUF is not a model transformers converts); the
round trip on the embedded model's own GGUF, converted for real, is in test_gguf_embedded.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kite.cli.main import app
from kite.errors import BadInput
from kite.model.fingerprint import Fingerprints, short
from tests.conftest import parse_json

runner = CliRunner()


def write_small_gguf(path: Path) -> Path:
    """A GGUF of every kind of metadata value the tokenizer and config use and three tensors (f32,
    f16, q8_0), written with the gguf package's writer."""
    import gguf

    w = gguf.GGUFWriter(path, arch="llama")
    w.add_name("small test model")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "hello", "wörld"])
    w.add_array("tokenizer.ggml.token_type", [3, 3, 1, 1])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((4, 32), dtype=np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((32, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _fields(reader) -> dict:
    return {name: ([t.name for t in f.types], f.contents()) for name, f in reader.fields.items()
            if not name.startswith("GGUF.")}


@pytest.fixture()
def small_gguf(tmp_path) -> Path:
    return write_small_gguf(tmp_path / "small.gguf")


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    """A KITE_CACHE of the test's own (embedded states are extracted into it)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("KITE_CACHE", str(folder))
    return folder


@pytest.fixture()
def made_by(monkeypatch):
    """Set the fingerprints the GGUF's model has (`made_by(fps)`): a random GGUF is no model to convert."""
    from kite.store import gguf_embed as store_gguf

    def given(fps: Fingerprints) -> None:
        monkeypatch.setattr(store_gguf, "_model_fingerprints", lambda model, progress: fps)

    return given


@pytest.fixture()
def state(tiny_contract_state, made_by) -> Path:
    """The tiny Llama's contract state; the small GGUF counts as that model."""
    lm, _, path = tiny_contract_state
    made_by(lm.fingerprints)
    return path


def _embed(*args: str):
    return runner.invoke(app, ["gguf", "embed", *args])


# -- the copy --------------------------------------------------------------------------------------

def test_a_copy_keeps_every_tensor_and_key_and_adds_strings_after_them(small_gguf, tmp_path):
    from kite.model.gguf import copy_gguf, is_kite_key, open_gguf

    src = open_gguf(small_gguf)
    out = tmp_path / "out.gguf"
    copy_gguf(src, out, add={"kite.upc.x": "aGk=", "kite.upc_meta.x": "{}"})
    got = open_gguf(out)
    want = {**_fields(src), "kite.upc.x": (["STRING"], "aGk="), "kite.upc_meta.x": (["STRING"], "{}")}
    assert _fields(got) == want
    assert list(_fields(got)) == list(want)  # the order too
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in got.tensors] == \
           [(t.name, t.tensor_type, t.shape.tolist()) for t in src.tensors]
    for a, b in zip(src.tensors, got.tensors):
        assert a.data.tobytes() == b.data.tobytes()
    # leaving KITE's keys out again gives back the original file, byte for byte
    copy_gguf(got, tmp_path / "again.gguf", drop=is_kite_key)
    assert (tmp_path / "again.gguf").read_bytes() == small_gguf.read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_copy_onto_its_own_file_and_an_interrupted_copy_leave_whole_files(small_gguf, monkeypatch):
    import gguf

    from kite.model.gguf import copy_gguf, open_gguf

    before = small_gguf.read_bytes()
    copy_gguf(open_gguf(small_gguf), small_gguf, add={"kite.note": "in place"})
    assert open_gguf(small_gguf).fields["kite.note"].contents() == "in place"
    after = small_gguf.read_bytes()

    def fail(self, *a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", fail)
    with pytest.raises(OSError):
        copy_gguf(open_gguf(small_gguf), small_gguf)
    assert small_gguf.read_bytes() == after != before
    assert sorted(p.name for p in small_gguf.parent.iterdir()) == ["small.gguf"]


# -- bad input: a GGUF that is not one -----------------------------------------------------------

@pytest.mark.parametrize("content, says", [(b"", "not a GGUF file (an empty file"),
                                           (b"KITEUPC\0 not a model", "not a GGUF file (its first bytes are b'KITE'"),
                                           (None, "no such file"), ("folder", "is a folder")])
def test_a_gguf_that_is_not_one_is_one_line(tmp_path, content, says):
    path = tmp_path / "model.gguf"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    for args in (["gguf", "list", str(path)], ["gguf", "extract", str(path), "--state", "x", "-o", str(tmp_path / "x.upc")],
                 ["gguf", "embed", str(path), str(tmp_path / "s.upc"), "-o", str(tmp_path / "o.gguf")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert says in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "o.gguf").exists() and not (tmp_path / "x.upc").exists()


def test_model_flags_refuse_a_gguf_that_is_not_one_before_anything_loads(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a model")
    for args in (["model", "info", "--model", str(fake)], ["generate", "--model", str(fake), "--prompt", "hi"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert f"--model {fake}: not a GGUF file" in result.output


def test_a_truncated_gguf_is_one_line(small_gguf):
    small_gguf.write_bytes(small_gguf.read_bytes()[: small_gguf.stat().st_size // 2])
    result = runner.invoke(app, ["gguf", "list", str(small_gguf)])
    assert result.exit_code == 2, result.output
    assert "corrupt or truncated GGUF file" in result.output and len(result.output.strip().splitlines()) == 1


# -- embed, list, extract --------------------------------------------------------------------------

def test_embed_list_and_extract_give_the_state_back_byte_for_byte(small_gguf, state, tmp_path, cache):
    out = tmp_path / "with-states.gguf"
    result = _embed(str(small_gguf), str(state), f"nda={state}", "-o", str(out), "--json")
    assert result.exit_code == 0, result.output
    report = parse_json(result.output)
    assert [s["id"] for s in report["added"]] == ["contract", "nda"] and report["kept"] == []
    assert report["output_bytes"] == out.stat().st_size > report["model_bytes"] == small_gguf.stat().st_size

    listed = parse_json(runner.invoke(app, ["gguf", "list", str(out), "--json"]).output)
    from kite.upcycle import StateFile

    with StateFile(state) as sf:
        meta = sf.meta
    first = listed["states"][0]
    assert first["id"] == "contract" and first["tokens"] == meta["n_tokens"]
    assert first["labels"] == sorted({c["label"] for c in meta["clusters"]})
    assert first["fingerprint"] == meta["fingerprints"]["combined"]
    assert first["bytes"] == state.stat().st_size and first["compression"] == "zstd"

    table = runner.invoke(app, ["gguf", "list", str(out)])
    assert table.exit_code == 0 and "contract" in table.output and "nda" in table.output

    for sid in ("contract", "nda"):
        back = tmp_path / f"{sid}.upc"
        result = runner.invoke(app, ["gguf", "extract", str(out), "--state", sid, "-o", str(back), "--json"])
        assert result.exit_code == 0, result.output
        assert back.read_bytes() == state.read_bytes()
        assert parse_json(result.output)["sha256"] == first["sha256"]


def test_the_gguf_keeps_the_model_and_holds_each_state_as_documented(small_gguf, state, tmp_path):
    """docs/upc-format.md, "Embedded in a GGUF": two string keys per state, zstd + base64 and JSON."""
    import base64
    import hashlib

    import zstandard

    from kite.model.gguf import open_gguf

    out = tmp_path / "with-states.gguf"
    assert _embed(str(small_gguf), str(state), "-o", str(out)).exit_code == 0
    reader = open_gguf(out)
    fields = _fields(reader)
    assert {k: v for k, v in fields.items() if not k.startswith("kite.")} == _fields(open_gguf(small_gguf))
    assert [k for k in fields if k.startswith("kite.")] == ["kite.upc.contract", "kite.upc_meta.contract"]
    data = zstandard.ZstdDecompressor().decompress(base64.b64decode(fields["kite.upc.contract"][1]))
    assert data == state.read_bytes()
    meta = json.loads(fields["kite.upc_meta.contract"][1])
    assert meta["format"] == "kite-upc-gguf" and meta["version"] == 1
    assert meta["sha256"] == hashlib.sha256(data).hexdigest() and meta["bytes"] == len(data)


def test_embedding_again_keeps_the_states_already_there(small_gguf, state, tmp_path):
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    assert _embed(str(small_gguf), str(state), "-o", str(one)).exit_code == 0
    result = _embed(str(one), f"second={state}", "-o", str(two), "--json")
    assert result.exit_code == 0, result.output
    assert parse_json(result.output)["kept"] == ["contract"]
    listed = parse_json(runner.invoke(app, ["gguf", "list", str(two), "--json"]).output)
    assert [s["id"] for s in listed["states"]] == ["contract", "second"]
    # in place: the output may be the model file itself
    assert _embed(str(two), f"third={state}", "-o", str(two)).exit_code == 0
    listed = parse_json(runner.invoke(app, ["gguf", "list", str(two), "--json"]).output)
    assert [s["id"] for s in listed["states"]] == ["contract", "second", "third"]


def test_a_state_of_another_model_is_refused_naming_both_fingerprints(small_gguf, tiny_contract_state, made_by,
                                                                      tmp_path):
    lm, _, state = tiny_contract_state
    other = Fingerprints(model="kite-fp1:" + "a" * 64, tokenizer=lm.fingerprints.tokenizer, adapter=None,
                         combined="kite-fp1:" + "b" * 64)
    made_by(other)
    out = tmp_path / "out.gguf"
    result = _embed(str(small_gguf), str(state), "-o", str(out))
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert len(line.splitlines()) == 1
    assert short(lm.fingerprints.combined) in line and "b" * 12 in line, line
    assert f"model fingerprint {short(lm.fingerprints.model)} ≠ {'a' * 12}" in line
    assert not out.exists()


@pytest.mark.parametrize("states, says", [
    (["bad/id={state}"], "state id 'bad/id'"),
    (["{state}", "contract={state}"], "state id 'contract' is given twice"),
    (["=x.upc"], "expected STATE.upc or ID=STATE.upc"),
    (["{missing}"], "no such state file"),
    ([], "Missing argument"),
])
def test_bad_state_arguments_are_one_line(small_gguf, state, tmp_path, states, says):
    args = [s.format(state=state, missing=tmp_path / "missing.upc") for s in states]
    result = _embed(str(small_gguf), *args, "-o", str(tmp_path / "out.gguf"))
    assert result.exit_code == 2, result.output
    assert says in result.output, result.output
    assert not (tmp_path / "out.gguf").exists()


def test_an_id_the_file_already_embeds_is_refused(small_gguf, state, tmp_path):
    one = tmp_path / "one.gguf"
    assert _embed(str(small_gguf), str(state), "-o", str(one)).exit_code == 0
    result = _embed(str(one), str(state), "-o", str(tmp_path / "two.gguf"))
    assert result.exit_code == 2 and "one.gguf already embeds a state 'contract'" in result.output


def test_a_corrupt_state_is_refused_before_anything_is_written(small_gguf, state, tmp_path):
    from kite.upcycle import StateFile

    bad = tmp_path / "bad.upc"
    data = bytearray(state.read_bytes())
    with StateFile(state) as sf:
        entry = next(iter(sf.index.values()))
        data[sf.data_start + entry.offset] ^= 0xFF
    bad.write_bytes(bytes(data))
    result = _embed(str(small_gguf), str(bad), "-o", str(tmp_path / "out.gguf"))
    assert result.exit_code == 2 and "fail their checksum" in result.output, result.output
    assert not (tmp_path / "out.gguf").exists()


def test_a_state_id_not_in_the_gguf_is_one_line_naming_those_it_has(small_gguf, state, tmp_path):
    out = tmp_path / "out.gguf"
    assert _embed(str(small_gguf), str(state), "-o", str(out)).exit_code == 0
    result = runner.invoke(app, ["gguf", "extract", str(out), "--state", "contrakt", "-o", str(tmp_path / "x.upc")])
    assert result.exit_code == 2
    assert "--state contrakt: out.gguf embeds no state 'contrakt' (it embeds: contract)" in result.output
    result = runner.invoke(app, ["gguf", "extract", str(small_gguf), "--state", "x", "-o", str(tmp_path / "x.upc")])
    assert result.exit_code == 2 and "embeds none" in result.output
    assert not (tmp_path / "x.upc").exists()
    empty = runner.invoke(app, ["gguf", "list", str(small_gguf)])
    assert empty.exit_code == 0 and "no embedded states" in empty.output


def test_an_embedded_state_whose_bytes_changed_is_refused(small_gguf, state, tmp_path):
    from kite.model.gguf import copy_gguf, open_gguf
    from kite.store.gguf import STATE_KEY, read_state, state_keys
    from kite.upcycle import StateFile

    out = tmp_path / "out.gguf"
    assert _embed(str(small_gguf), str(state), "-o", str(out)).exit_code == 0
    reader = open_gguf(out)
    # one byte of the state changed, framed as the writer frames it, beside the metadata (sha256) of
    # the original (a character flipped in the text itself can land on bits the decoder ignores)
    _, data = read_state(out, "contract", reader)
    changed = bytearray(data)
    changed[len(changed) // 2] ^= 0x01
    with StateFile(state) as sf:
        meta = sf.meta
    key = STATE_KEY + "contract"
    framed = state_keys("contract", meta, bytes(changed), state)[1][key]
    tampered = tmp_path / "tampered.gguf"
    copy_gguf(reader, tampered, drop=lambda k: k == key, add={key: framed})
    result = runner.invoke(app, ["gguf", "extract", str(tampered), "--state", "contract", "-o", str(tmp_path / "x.upc")])
    assert result.exit_code == 2 and "embedded state 'contract': corrupt" in result.output, result.output
    assert not (tmp_path / "x.upc").exists()


# -- offered to loaders by id -----------------------------------------------------------------------

def test_state_path_gives_a_file_or_the_state_a_gguf_model_embeds(small_gguf, state, tmp_path, cache,
                                                                    tiny_models):
    from kite.store import state_path

    out = tmp_path / "out.gguf"
    assert _embed(str(small_gguf), str(state), "-o", str(out)).exit_code == 0
    assert state_path(state, str(out)) == state                    # a file that exists is that file
    cached = state_path("contract", str(out))
    assert cached.parent == cache / "gguf_states" and cached.read_bytes() == state.read_bytes()
    stamp = cached.stat().st_mtime_ns
    assert state_path("contract", str(out)) == cached and cached.stat().st_mtime_ns == stamp  # extracted once
    cached.write_bytes(b"changed")
    assert state_path("contract", str(out)).read_bytes() == state.read_bytes()              # and again if changed
    with pytest.raises(BadInput, match=r"--upc nda: no such state file, and out.gguf embeds no state 'nda' "
                                       r"\(it embeds: contract\)"):
        state_path("nda", str(out))
    # a model that is no GGUF file: the path, for the state reader to refuse
    assert state_path("nda", str(tiny_models["llama"])) == Path("nda")


def test_a_server_of_a_gguf_model_lists_and_answers_from_its_embedded_states(small_gguf, state, tiny_contract_state,
                                                                            tmp_path, cache):
    import httpx

    from kite.model.sources import ModelSource
    from kite.serve import BackgroundServer, create_app
    from kite.serve.app import embedded_states
    from kite.yoco.health import HealthStore
    from tests.test_serve import TOKEN, _pipeline, _settings

    out = tmp_path / "out.gguf"
    assert _embed(str(small_gguf), str(state), "-o", str(out)).exit_code == 0
    lm = tiny_contract_state[0]
    embedded = embedded_states(ModelSource(str(out), "gguf", out))
    assert list(embedded["embedded"]) == ["contract"] and embedded["embedded_in"] == "out.gguf"
    settings = _settings(tmp_path / "serve", admin_token=TOKEN, fusion=True)
    app_ = create_app(_pipeline(lm), settings, health=HealthStore(tmp_path / "health.sqlite"), embedded=embedded)
    server = BackgroundServer(app_)
    server.start()
    try:
        client = httpx.Client(base_url=server.url, timeout=60)
        listed = client.get("/v1/states").json()["data"]
        assert [(s["id"], s.get("embedded")) for s in listed] == [("contract", "out.gguf")]
        r = client.post("/v1/completions", json={"prompt": " What is the capital of France?", "max_tokens": 2,
                                                 "kite": {"state": "contract"}})
        assert r.status_code == 200, r.text
        assert r.json()["kite"]["loaded"] is True and r.json()["kite"]["state"] == "contract"
        r = client.post("/v1/states", json={"document": "Another document.", "id": "contract"})
        assert r.status_code == 409 and "embedded in out.gguf" in r.json()["error"]["message"]
        r = client.delete("/v1/states/contract")
        assert r.status_code == 409
        assert client.get("/v1/states/contract").status_code == 200
        client.close()
    finally:
        server.stop()


def test_a_gguf_whose_model_bytes_were_converted_before_gets_that_folder(small_gguf, state, tmp_path, cache,
                                                                         monkeypatch):
    """The model file with states embedded (or a copy of it) is not converted again: its bytes without
    KITE's keys are compared (sha256) with those a cached folder was converted from."""
    import hashlib

    from kite.model import convert, gguf as model_gguf

    def no_conversion(gguf, source):
        raise AssertionError(f"converted {gguf}")

    monkeypatch.setattr(convert, "_read_gguf_model", no_conversion)
    st = small_gguf.stat()   # the record a conversion of small.gguf leaves (before sha256s were kept)
    earlier = cache / "models" / "small-0123456789abcdef"
    earlier.mkdir(parents=True)
    (earlier / "kite-source.json").write_text(json.dumps({"gguf": str(small_gguf), "size": st.st_size,
                                                          "mtime_ns": st.st_mtime_ns}))
    out = tmp_path / "with-states.gguf"
    assert _embed(str(small_gguf), str(state), "-o", str(out)).exit_code == 0
    folder = convert.converted_gguf_folder(out)
    assert folder.is_symlink() and folder.resolve() == earlier.resolve()
    opener = model_gguf.open_gguf
    monkeypatch.setattr(model_gguf, "open_gguf", no_conversion)
    assert convert.converted_gguf_folder(out) == folder   # found by its path now: nothing read
    monkeypatch.setattr(model_gguf, "open_gguf", opener)

    # a record that keeps the sha256 of what it converted is matched by it, its file gone
    (earlier / "kite-source.json").write_text(json.dumps(
        {"gguf": str(tmp_path / "gone.gguf"), "size": 1, "mtime_ns": 0, "source_size": st.st_size,
         "source_sha256": hashlib.sha256(small_gguf.read_bytes()).hexdigest()}))
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(out.read_bytes())
    assert convert.converted_gguf_folder(copy).resolve() == earlier.resolve()

    # the same size, other bytes: converted, not shared
    data = bytearray(small_gguf.read_bytes())
    data[-1] ^= 0xFF
    other = tmp_path / "other.gguf"
    other.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="converted"):
        convert.converted_gguf_folder(other)


def test_the_embed_command_is_listed_with_its_arguments(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    res = runner.invoke(app, ["gguf", "--help"])
    assert res.exit_code == 0 and "embed" in res.stdout
    res = runner.invoke(app, ["gguf", "embed", "--help"])
    assert res.exit_code == 0 and "--output" in res.stdout


def test_copies_get_the_umask_mode(small_gguf, tmp_path):
    from kite.model.gguf import copy_gguf, open_gguf

    old = os.umask(0o027)
    try:
        copy_gguf(open_gguf(small_gguf), tmp_path / "m.gguf")
    finally:
        os.umask(old)
    assert (tmp_path / "m.gguf").stat().st_mode & 0o777 == 0o640


def test_a_conversion_that_finishes_second_keeps_the_folder_of_the_first(small_gguf, cache, monkeypatch):
    """Two processes converting the same model file at once (two `kite` commands on a fresh cache):
    the one that finishes second leaves the first's whole folder in place, and none of its own."""
    from types import SimpleNamespace

    from kite.model import convert

    target = cache / "models" / f"{small_gguf.stem}-{convert._cache_key(small_gguf)}"

    def other_process_finishes_first(gguf, source):
        target.mkdir(parents=True)
        (target / "theirs").write_text("converted by the other process")
        (target / convert.SOURCE_RECORD).write_text("{}")
        saver = SimpleNamespace(save_pretrained=lambda folder, **kw: (Path(folder) / "ours").write_text("x"))
        return saver, SimpleNamespace(hf_quantizer=None, config=SimpleNamespace(), save_pretrained=saver.save_pretrained)

    monkeypatch.setattr(convert, "_read_gguf_model", other_process_finishes_first)
    assert convert.converted_gguf_folder(small_gguf) == target
    assert (target / "theirs").exists() and not (target / "ours").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]      # no scratch left
