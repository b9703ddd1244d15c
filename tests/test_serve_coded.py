"""`kite serve --resident coded`: loaded states held in coded form for the batch (the coded
attention reads them; on the CPU its torch reference), the same answers as raw, and raw with a
warning for the loads the coded form cannot hold."""

from __future__ import annotations

import shutil

import httpx
import pytest
from typer.testing import CliRunner

from kite.cli.main import app as cli
from kite.errors import BadInput
from kite.runtime.cache import CodedPrefix, KVPrefix
from kite.upcycle import StateFile, codec
from kite.upcycle.compress import CompressSettings, compress_document
from tests.test_serve import DOC, _settings, _start

PROMPT = " What does the contract say about payment?"


def tiny_lm(tiny_models):
    """The tiny Llama on the CPU, one thread (a shared 2-core machine)."""
    import torch

    from kite.model import load_model

    torch.set_num_threads(1)
    return load_model(str(tiny_models["llama"]), device="cpu")


def compress_doc(lm, path, spec):
    """DOC compressed at ``spec`` into ``path`` (3 clusters of 8-24-token spans): ``path``."""
    compress_document(lm, DOC, path, CompressSettings(codec=spec, n_clusters=3, min_span_tokens=8,
                                                      max_span_tokens=24), device="cpu")
    return path


@pytest.fixture(scope="module")
def lm(tiny_models):
    return tiny_lm(tiny_models)


@pytest.fixture(scope="module")
def states(lm, tmp_path_factory):
    """A PCA-coded state (ratio 4: the coded form holds it) and an exact one (it does not)."""
    root = tmp_path_factory.mktemp("coded-states")
    return {name: compress_doc(lm, root / f"{name}.upc", spec)
            for name, spec in (("pca", codec.settings_for(4)), ("exact", codec.settings_for("exact")))}


# -- the prefix cache --------------------------------------------------------------------------------

def test_prefix_cache_holds_a_full_load_coded_and_reports_it(lm, states):
    from kite.serve.prefixes import PrefixCache
    from kite.upcycle import load_prefix

    cache = PrefixCache(max_bytes=1 << 30, resident="coded")
    with StateFile(states["pca"]) as state:
        prefix, report = cache.load(state, lm, clusters=None, layers=None, precision=None)
        raw, raw_report = load_prefix(state, lm)
        again, hit = cache.load(state, lm, clusters=None, layers=None, precision=None)
        version = state.version
    assert isinstance(prefix, CodedPrefix) and again is prefix
    assert report.resident == "coded" and report.resident_bytes == prefix.nbytes > 0 and not report.warnings
    assert raw_report.resident == "raw" and raw_report.resident_bytes == raw.nbytes()
    assert prefix.tokens_per_layer() == raw.tokens_per_layer() and prefix.next_position == raw.next_position
    for field in ("clusters", "labels", "layers", "precision", "tokens", "sink_tokens"):
        assert getattr(report, field) == getattr(raw_report, field), field
    assert report.bytes_read > 0 and {"stage", "transcode", "hot_tier_hit"} <= set(report.timings_ms)
    assert "cached" in hit.timings_ms and hit.resident == "coded" and hit.bytes_read == 0
    assert cache.nbytes == prefix.nbytes and (cache.hits, cache.misses) == (1, 1)
    assert cache.held_paths() == {version[0]}


def test_prefix_cache_partial_clusters_stay_coded_with_their_sinks(lm, states):
    from kite.serve.prefixes import PrefixCache
    from kite.upcycle import load_prefix

    cache = PrefixCache(max_bytes=1 << 30, resident="coded")
    with StateFile(states["pca"]) as state:
        label = state.meta["clusters"][-1]["label"]
        prefix, report = cache.load(state, lm, clusters=[label], layers=None, precision=None)
        raw, raw_report = load_prefix(state, lm, clusters=[label])
    assert isinstance(prefix, CodedPrefix) and report.resident == "coded"
    assert prefix.tokens_per_layer() == raw.tokens_per_layer()
    assert (report.tokens, report.sink_tokens) == (raw_report.tokens, raw_report.sink_tokens)


@pytest.mark.parametrize("kwargs, reason", [({"layers": [0]}, "holds every layer"),
                                            ({"precision": "int8"}, "its own precision")])
def test_prefix_cache_falls_back_to_raw_for_a_load_the_coded_form_does_not_cover(lm, states, kwargs, reason):
    from kite.serve.prefixes import PrefixCache

    cache = PrefixCache(max_bytes=1 << 30, resident="coded")
    args = {"clusters": None, "layers": None, "precision": None, **kwargs}
    with StateFile(states["pca"]) as state:
        prefix, report = cache.load(state, lm, **args)
        _, hit = cache.load(state, lm, **args)
    assert isinstance(prefix, KVPrefix) and report.resident == "raw"
    assert any(w.startswith("server.resident is coded, but this load is held raw") and reason in w
               for w in report.warnings), report.warnings
    assert hit.warnings == report.warnings and "cached" in hit.timings_ms   # the raw load was kept


def test_prefix_cache_remembers_a_state_it_cannot_hold_coded(lm, states, monkeypatch):
    import kite.upcycle as upcycle
    from kite.serve.prefixes import PrefixCache

    tries = []
    real = upcycle.load_resident
    monkeypatch.setattr(upcycle, "load_resident", lambda *a, **k: tries.append(1) or real(*a, **k))
    cache = PrefixCache(max_bytes=0, resident="coded")   # keeps nothing: every load loads
    with StateFile(states["exact"]) as state:
        for _ in range(2):
            prefix, report = cache.load(state, lm, clusters=None, layers=None, precision=None)
            assert isinstance(prefix, KVPrefix) and report.resident == "raw"
            assert any("PCA-coded" in w and "exact.upc" in w for w in report.warnings), report.warnings
            assert not any(str(states["exact"].parent) in w for w in report.warnings)   # no server folders
    assert len(tries) == 1 and cache.nbytes == 0


def test_prefix_cache_sizes_both_forms_and_evicts_across_them(lm, states):
    from kite.serve.prefixes import PrefixCache, prefix_bytes

    full = {"clusters": None, "layers": None, "precision": None}
    with StateFile(states["pca"]) as state:
        coded, _ = PrefixCache(1 << 30, "coded").load(state, lm, **full)
        one_layer, _ = PrefixCache(1 << 30, "raw").load(state, lm, **{**full, "layers": [0]})
        assert prefix_bytes(coded) == coded.nbytes and prefix_bytes(one_layer) == one_layer.nbytes()
        cache = PrefixCache(max(coded.nbytes, one_layer.nbytes()), "coded")   # room for one of them
        cache.load(state, lm, **full)                           # held coded
        cache.load(state, lm, **{**full, "layers": [0]})        # held raw: the coded one goes
        assert cache.nbytes == one_layer.nbytes() and [key[1] for key in cache._entries] == ["raw"]


def test_raw_is_the_default_and_a_bad_form_is_one_line_bad_input(tmp_path):
    from kite.serve.prefixes import PrefixCache
    from kite.serve.settings import ServeSettings

    assert PrefixCache(1).resident == "raw"
    assert ServeSettings(state_dir=tmp_path, rules_path=tmp_path / "r.yaml").resident == "raw"
    for make in (lambda: PrefixCache(1, "sideways"),
                 lambda: ServeSettings(state_dir=tmp_path, rules_path=tmp_path / "r.yaml", resident="sideways")):
        with pytest.raises(BadInput, match=r"^server.resident 'sideways': expected one of raw, coded, lanes$"):
            make()


def test_kite_serve_refuses_a_bad_resident_flag_in_one_line():
    r = CliRunner().invoke(cli, ["serve", "--resident", "sideways"])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "server.resident" in lines[0] and "expected raw, coded or lanes" in lines[0], r.output


# -- a real server ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(lm, states, tmp_path_factory):
    """Two servers over the same model, one holding states raw, one coded; each with the PCA state."""
    out = {}
    for form in ("raw", "coded"):
        root = tmp_path_factory.mktemp(f"serve-{form}")
        settings = _settings(root, fusion=True, resident=form)
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(states["pca"], settings.state_dir / "pca.upc")
        server, app, _ = _start(lm, settings, root)
        out[form] = (server, httpx.Client(base_url=server.url, timeout=120), app)
    yield out
    for server, client, _ in out.values():
        client.close()
        server.stop()


def _complete(client, state="pca", max_tokens=6):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                             "kite": {"state": state}})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_coded_server_answers_as_the_raw_one(servers):
    raw, coded = _complete(servers["raw"][1]), _complete(servers["coded"][1])
    assert raw["kite"]["load"]["resident"] == "raw" and coded["kite"]["load"]["resident"] == "coded"
    assert coded["kite"]["load"]["resident_bytes"] > 0 and not coded["kite"]["warnings"]
    assert coded["choices"][0]["text"] == raw["choices"][0]["text"]
    assert coded["usage"]["completion_tokens"] == raw["usage"]["completion_tokens"]
    g_raw, g_coded = raw["kite"]["generation"], coded["kite"]["generation"]
    assert g_coded["prefix_tokens"] == g_raw["prefix_tokens"] > 0
    # the measured gain's side with the state: the prefill's NLL, exact reference vs rebuilt KV (fp32)
    assert abs(g_coded["prompt_nll_bits"] - g_raw["prompt_nll_bits"]) <= 1e-4
    assert coded["kite"]["gain"] == pytest.approx(raw["kite"]["gain"], abs=1e-4)
    again = _complete(servers["coded"][1])
    assert "cached" in again["kite"]["load"]["timings_ms"] and again["kite"]["load"]["resident"] == "coded"
    assert again["choices"][0]["text"] == coded["choices"][0]["text"]


def test_a_coded_server_holds_a_state_it_cannot_code_raw_and_says_why(servers):
    client = servers["coded"][1]
    r = client.post("/v1/states", json={"document": DOC})   # the server's uploads are coded exactly
    assert r.status_code in (200, 201), r.text
    out = _complete(client, state=r.json()["id"], max_tokens=3)
    assert out["kite"]["loaded"] and out["kite"]["load"]["resident"] == "raw"
    assert any(w.startswith("server.resident is coded, but this load is held raw") and "PCA-coded" in w
               for w in out["kite"]["warnings"]), out["kite"]["warnings"]
    assert out["choices"][0]["text"]


def test_coded_and_raw_rows_decode_together_as_each_alone(servers):
    """Concurrent requests on the coded server, some over the coded state and some over a state held
    raw (in the batch together as they arrive together), answer as each did alone."""
    from concurrent.futures import ThreadPoolExecutor

    client = servers["coded"][1]
    exact = client.post("/v1/states", json={"document": DOC}).json()["id"]
    asks = ["pca", exact, "pca", exact, "pca"]
    alone = {sid: _complete(client, state=sid, max_tokens=5)["choices"][0]["text"] for sid in set(asks)}
    with ThreadPoolExecutor(len(asks)) as pool:
        outs = list(pool.map(lambda sid: _complete(client, state=sid, max_tokens=5), asks))
    for sid, out in zip(asks, outs):
        assert out["kite"]["load"]["resident"] == ("coded" if sid == "pca" else "raw")
        assert out["choices"][0]["text"] == alone[sid]

