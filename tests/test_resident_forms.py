"""Every registered resident form (kite.upcycle.RESIDENT_FORMS, ``kite serve --resident``) on the tiny
test models: it holds a load (full and partial) and the bytes it reports; a batch row after it decodes
exactly as after the KV it stands for (``as_kv``) and within a stated tolerance of the raw form; the
server's prefix cache keeps it, falls back to raw where it refuses a load, and a server in it answers
as concurrent rows did alone. A form added to the registry is tested here without a new line; what
the matrix builds it with and how close to raw it must come are FORM_SETTINGS and NLL_TOLERANCE_BITS.
Bad names (a retired form among them) are one line of bad input everywhere."""

from __future__ import annotations

import re
import shutil
from dataclasses import fields, is_dataclass

import httpx
import pytest
import torch
from typer.testing import CliRunner

from kite.cli.main import app as cli
from kite.errors import BadInput
from kite.runtime.resident import KVPrefix
from kite.upcycle import RESIDENT_FORMS, StateFile, codec, resident_form
from kite.upcycle.compress import CompressSettings, compress_document
from tests.test_serve import DOC, _settings, _start

FORMS = sorted(RESIDENT_FORMS)
# What the matrix builds each form with (a form not named here: its defaults).
FORM_SETTINGS = {"lanes": {"lane_bits": "8"}}
# How far a row's prompt NLL after a form's load may be from the same row after the raw load, in bits
# (8-bit lanes: a second quantization of the rebuilt KV); a form not named here: 0.05.
NLL_TOLERANCE_BITS = {"raw": 1e-6, "lanes": 0.05}
PROMPT = " What does the contract say about payment?"


def form(name: str):
    return resident_form(name, **FORM_SETTINGS.get(name, {}))


def tolerance(name: str) -> float:
    return NLL_TOLERANCE_BITS.get(name, 0.05)


def tiny_lm(tiny_models):
    """The tiny Llama on the CPU, one thread (a shared 2-core machine)."""
    from kite.model import load_model

    torch.set_num_threads(1)
    return load_model(str(tiny_models["llama"]), device="cpu")


def compress_doc(lm, path, spec):
    """DOC compressed at ``spec`` into ``path`` (3 clusters of 8-24-token spans): ``path``."""
    compress_document(lm, DOC, path, CompressSettings(codec=spec, n_clusters=3, min_span_tokens=8,
                                                      max_span_tokens=24), device="cpu")
    return path


def complete(client, state="pca", max_tokens=6):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                             "kite": {"state": state}})
    assert r.status_code == 200, r.text
    return r.json()


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of every tensor reachable from ``obj`` (dataclass fields, lists, tuples), each counted once."""
    seen = set() if seen is None else seen
    if torch.is_tensor(obj):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x, seen) for x in obj)
    if is_dataclass(obj):
        return sum(tensor_bytes(getattr(obj, f.name), seen) for f in fields(obj))
    return 0


@pytest.fixture(scope="module")
def lm(tiny_models):
    return tiny_lm(tiny_models)


@pytest.fixture(scope="module")
def state(lm, tmp_path_factory):
    return compress_doc(lm, tmp_path_factory.mktemp("resident-states") / "pca.upc", codec.settings_for(4))


# -- a form holds a load -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FORMS)
def test_a_form_holds_full_and_partial_loads_and_the_bytes_it_reports(lm, state, name):
    from kite.upcycle import load_prefix

    f = form(name)
    with StateFile(state) as sf:
        first = sorted(c["label"] for c in sf.meta["clusters"])[:1]
        for clusters in (None, first):
            held, report = f.load(sf, lm, clusters=clusters)
            raw, raw_report = load_prefix(sf, lm, clusters=clusters)
            assert isinstance(held, f.prefix_type) and report.resident == name and not report.warnings
            assert report.resident_bytes == f.nbytes(held) == held.nbytes() == tensor_bytes(held) > 0
            assert held.tokens_per_layer() == raw.tokens_per_layer() and held.next_position == raw.next_position
            assert [held.holds(i) for i in range(held.n_layers)] == [n > 0 for n in raw.tokens_per_layer()]
            for key in ("clusters", "labels", "layers", "precision", "tokens", "sink_tokens"):
                assert getattr(report, key) == getattr(raw_report, key), key
            kv = held.as_kv()
            assert isinstance(kv, KVPrefix) and kv.tokens_per_layer() == raw.tokens_per_layer()
            if held.beside:       # held apart from the row's slots: it fills none
                assert held.slot_tokens() == [0] * held.n_layers
            else:
                assert held.slot_tokens() == held.tokens_per_layer()


# -- the batch reads it --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FORMS)
def test_a_batch_row_after_a_form_decodes_as_after_its_kv_and_near_the_raw_load(lm, state, name):
    """BatchDecoder (CPU, fp32), four rows together: no state, the form's load, the KV it stands for,
    the raw load. The form's row gives the tokens and prompt NLL of the row after its KV (the form's
    attention is exact over what it holds) and a prompt NLL within the form's tolerance of raw."""
    from kite.runtime.batch_decode import BatchDecoder
    from kite.upcycle import load_prefix

    with StateFile(state) as sf:
        held, _ = form(name).load(sf, lm)
        raw, _ = load_prefix(sf, lm)
    prompt = lm.tokenizer(PROMPT)["input_ids"]
    dec = BatchDecoder(lm, max_rows=4)
    h_plain = dec.add(prompt[:5], max_new_tokens=8, stop_ids=set())
    h_form = dec.add(prompt, prefix=held, max_new_tokens=8, stop_ids=set())
    h_kv = dec.add(prompt, prefix=held.as_kv(), max_new_tokens=8, stop_ids=set())
    h_raw = dec.add(prompt, prefix=raw, max_new_tokens=8, stop_ids=set())
    assert dec.cache.row_lengths(dec._active[h_form].row) == held.slot_tokens()
    res = dec.drain()
    assert res[h_plain].text
    assert res[h_form].text == res[h_kv].text and res[h_form].new_tokens == res[h_kv].new_tokens
    assert abs(res[h_form].prompt_nll_bits - res[h_kv].prompt_nll_bits) <= 1e-4
    assert res[h_form].prefix_tokens == res[h_raw].prefix_tokens > 0
    assert abs(res[h_form].prompt_nll_bits - res[h_raw].prompt_nll_bits) <= tolerance(name)


# -- the server's prefix cache -------------------------------------------------------------------------

@pytest.mark.parametrize("name", FORMS)
def test_the_prefix_cache_keeps_a_load_in_its_form_and_evicts_by_its_bytes(lm, state, name):
    from kite.serve.prefixes import PrefixCache

    settings = FORM_SETTINGS.get(name, {})
    full = {"clusters": None, "layers": None, "precision": None}
    with StateFile(state) as sf:
        cache = PrefixCache(1 << 30, name, **settings)
        held, report = cache.load(sf, lm, **full)
        again, hit = cache.load(sf, lm, **full)
        version = sf.version
        assert cache.resident == name and report.resident == name and again is held
        assert "cached" in hit.timings_ms and hit.resident == name and hit.bytes_read == 0
        assert cache.nbytes == held.nbytes() and (cache.hits, cache.misses) == (1, 1)
        assert cache.held_paths() == {version[0]}
        one_layer, _ = cache.load(sf, lm, **{**full, "layers": [0]})
        small = PrefixCache(max(held.nbytes(), one_layer.nbytes()), name, **settings)   # room for one of them
        small.load(sf, lm, **full)
        small.load(sf, lm, **{**full, "layers": [0]})                                # the full load goes
        assert small.nbytes == one_layer.nbytes() and small.hits == 0


@pytest.mark.parametrize("name", [n for n in FORMS if n != "raw"])
def test_a_load_a_form_refuses_is_held_raw_with_a_warning_and_not_tried_again(lm, state, name, monkeypatch):
    from kite.serve.prefixes import PrefixCache

    cache = PrefixCache(0, name, **FORM_SETTINGS.get(name, {}))   # keeps nothing: every load loads
    tries = []

    def refuse(sf, lm_, **kw):
        tries.append(1)
        raise BadInput(f"{sf.path}: not in this form")

    monkeypatch.setattr(cache.form, "load", refuse)
    with StateFile(state) as sf:
        for _ in range(2):
            prefix, report = cache.load(sf, lm, clusters=None, layers=None, precision=None)
            assert isinstance(prefix, KVPrefix) and report.resident == "raw"
            assert report.warnings == [f"server.resident is {name}, but this load is held raw: pca.upc: "
                                       "not in this form"]   # the server's folders stay its own
    assert len(tries) == 1 and cache.nbytes == 0


# -- names ---------------------------------------------------------------------------------------------

def test_the_registry_is_what_validation_reads(tmp_path, monkeypatch):
    from kite.serve.prefixes import PrefixCache
    from kite.serve.settings import ServeSettings
    from kite.upcycle import ResidentForm
    from kite.upcycle.load.resident_forms import RawResident, register

    assert FORMS == ["lanes", "raw"] and PrefixCache(1).resident == "raw"
    assert ServeSettings(state_dir=tmp_path, rules_path=tmp_path / "r.yaml").resident == "raw"
    monkeypatch.setattr("kite.upcycle.load.resident_forms.RESIDENT_FORMS", dict(RESIDENT_FORMS))

    @register
    class Mirror(RawResident):
        name = "mirror"

    assert ServeSettings(state_dir=tmp_path, rules_path=tmp_path / "r.yaml", resident="mirror").resident == "mirror"
    assert isinstance(PrefixCache(1, "mirror").form, Mirror) and issubclass(Mirror, ResidentForm)
    with pytest.raises(ValueError, match="'raw' is registered already"):
        register(type("Again", (RawResident,), {"name": "raw"}))


@pytest.mark.parametrize("bad", ["coded", "sideways", "RAW"])
def test_a_name_not_registered_is_one_line_of_bad_input_naming_the_forms(tmp_path, monkeypatch, bad, tiny_models):
    from kite.serve.prefixes import PrefixCache
    from kite.serve.settings import ServeSettings

    msg = "^" + re.escape(f"server.resident '{bad}': expected one of {', '.join(RESIDENT_FORMS)}") + "$"
    for make in (lambda: resident_form(bad), lambda: PrefixCache(1, bad),
                 lambda: ServeSettings(state_dir=tmp_path, rules_path=tmp_path / "r.yaml", resident=bad)):
        with pytest.raises(BadInput, match=msg):
            make()
    monkeypatch.setenv("KITE_HOME", str(tmp_path / "home"))
    model = ["--model", str(tiny_models["llama"])]
    for args, config in ((["serve", *model, "--resident", bad], None), (["serve", *model], f"server:\n  resident: {bad}\n")):
        if config:
            (tmp_path / "home").mkdir(exist_ok=True)
            (tmp_path / "home" / "config.yaml").write_text(config)
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2, r.output
        lines = [line for line in r.output.splitlines() if line.strip()]
        assert len(lines) == 1 and f"server.resident '{bad}': expected one of " in lines[0], r.output
        assert all(n in lines[0] for n in FORMS), r.output


# -- a real server -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(lm, state, tmp_path_factory):
    """A server per form over the same model, each with the PCA state."""
    out = {}
    for name in FORMS:
        root = tmp_path_factory.mktemp(f"serve-{name}")
        settings = _settings(root, fusion=True, resident=name, **FORM_SETTINGS.get(name, {}))
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(state, settings.state_dir / "pca.upc")
        server, app, _ = _start(lm, settings, root)
        out[name] = (server, httpx.Client(base_url=server.url, timeout=120), app)
    yield out
    for server, client, _ in out.values():
        client.close()
        server.stop()


@pytest.mark.parametrize("name", FORMS)
def test_a_server_holds_states_in_its_form_and_answers_near_the_raw_one(servers, name):
    raw, held = complete(servers["raw"][1]), complete(servers[name][1])
    assert held["kite"]["load"]["resident"] == name and not held["kite"]["warnings"]
    assert held["kite"]["load"]["resident_bytes"] > 0 and held["choices"][0]["text"]
    g_raw, g_held = raw["kite"]["generation"], held["kite"]["generation"]
    assert g_held["prefix_tokens"] == g_raw["prefix_tokens"] > 0
    assert abs(g_held["prompt_nll_bits"] - g_raw["prompt_nll_bits"]) <= tolerance(name)
    again = complete(servers[name][1])
    assert "cached" in again["kite"]["load"]["timings_ms"] and again["kite"]["load"]["resident"] == name
    assert again["choices"][0]["text"] == held["choices"][0]["text"]


@pytest.mark.parametrize("name", FORMS)
def test_concurrent_rows_in_a_form_decode_as_each_alone(servers, name):
    """Requests arriving together share the batch (a form held beside its slots attended for all the
    rows at once) and answer as one alone did, beside a state the server holds raw."""
    from concurrent.futures import ThreadPoolExecutor

    client = servers[name][1]
    exact = client.post("/v1/states", json={"document": DOC})   # uploads are coded exactly
    assert exact.status_code in (200, 201), exact.text
    asks = ["pca", exact.json()["id"], "pca", "pca"]
    alone = {sid: complete(client, state=sid, max_tokens=5)["choices"][0]["text"] for sid in set(asks)}
    with ThreadPoolExecutor(len(asks)) as pool:
        outs = list(pool.map(lambda sid: complete(client, state=sid, max_tokens=5), asks))
    for sid, out in zip(asks, outs):
        assert out["choices"][0]["text"] == alone[sid]
        assert out["kite"]["load"]["resident"] == name and not out["kite"]["warnings"]
