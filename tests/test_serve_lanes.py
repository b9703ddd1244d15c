"""`kite serve --resident lanes`: loaded states coded again into nibble lanes (kite.kernels.lanes,
kite.upcycle.load.lanes) for the batch, whose attention reads them from their codes (the torch
reference on the CPU, the lanes kernel on a GPU): a row after a state in lanes decodes as a row
after the rows the lanes decode to; the server holds and reports them; bad settings are one line."""

from __future__ import annotations

import shutil

import httpx
import pytest
from typer.testing import CliRunner

from kite.cli.main import app as cli
from kite.errors import BadInput
from kite.runtime.cache import CodedPrefix
from kite.upcycle import StateFile, codec
from tests.test_lanes_kernel import decoded
from tests.test_serve import _settings, _start
from tests.test_serve_coded import _complete, compress_doc, tiny_lm


@pytest.fixture(scope="module")
def lm(tiny_models):
    return tiny_lm(tiny_models)


@pytest.fixture(scope="module")
def state(lm, tmp_path_factory):
    return compress_doc(lm, tmp_path_factory.mktemp("lanes-states") / "pca.upc", codec.settings_for(4))


@pytest.mark.parametrize("bits", [(4, 4), (2, 4)])
def test_a_batch_row_after_a_state_in_lanes_decodes_as_after_its_decoded_rows(lm, state, bits):
    """BatchDecoder (CPU, fp32): the row whose state stays in lanes gives the tokens and prompt NLL of
    the row after the same rows decoded, beside a row without a state; nothing is rebuilt into it."""
    from kite.runtime.batch_decode import BatchDecoder
    from kite.upcycle.load.lanes import load_lanes

    with StateFile(state) as sf:
        held, report = load_lanes(sf, lm, lane_bits=bits)
    assert report.resident == "lanes" and report.resident_bytes == held.nbytes > 0 and held.lanes
    prompt = lm.tokenizer("What does the contract say about payment?")["input_ids"]
    dec = BatchDecoder(lm, max_rows=3)
    h_plain = dec.add(prompt[:5], max_new_tokens=8, stop_ids=set())
    h_lanes = dec.add(prompt, prefix=held, max_new_tokens=8, stop_ids=set())
    h_rows = dec.add(prompt, prefix=decoded(held), max_new_tokens=8, stop_ids=set())
    assert dec.cache.row_lengths(dec._active[h_lanes].row) == [0] * lm.geometry.n_layers
    res = dec.drain()
    assert res[h_lanes].text == res[h_rows].text and res[h_plain].text
    assert abs(res[h_lanes].prompt_nll_bits - res[h_rows].prompt_nll_bits) <= 1e-4
    assert res[h_lanes].prefix_tokens == res[h_rows].prefix_tokens > 0


def test_the_prefix_cache_holds_full_and_partial_loads_in_lanes(lm, state):
    from kite.serve.prefixes import PrefixCache
    from kite.upcycle import load_prefix

    cache = PrefixCache(max_bytes=1 << 30, resident="lanes", lane_bits="2:4")
    with StateFile(state) as sf:
        first = sorted(c["label"] for c in sf.meta["clusters"])[:1]
        for clusters in (None, first):
            held, report = cache.load(sf, lm, clusters=clusters, layers=None, precision=None)
            raw, _ = load_prefix(sf, lm, clusters=clusters)
            assert isinstance(held, CodedPrefix) and held.lanes and report.resident == "lanes" and not report.warnings
            assert held.tokens_per_layer() == raw.tokens_per_layer() and held.next_position == raw.next_position
            assert held.nbytes < raw.nbytes()                 # keys at 2 bits, values at 4, plus tables
        again, hit = cache.load(sf, lm, clusters=first, layers=None, precision=None)
    assert again is held and "cached" in hit.timings_ms and cache.hits == 1


@pytest.mark.parametrize("spec", ["3", "4:5", "four", "2:4:8"])
def test_bad_lane_bits_are_one_line_bad_input_everywhere(tmp_path, monkeypatch, spec):
    from kite.config import load_config
    from kite.errors import KiteError
    from kite.serve.prefixes import PrefixCache
    from kite.serve.settings import ServeSettings

    msg = rf"^server.lane_bits '{spec}': expected B or K:V with bits in 1, 2, 4, 8$"
    with pytest.raises(BadInput, match=msg):
        PrefixCache(1, "lanes", spec)
    with pytest.raises(BadInput, match=msg):
        ServeSettings(state_dir=tmp_path, rules_path=tmp_path / "r.yaml", resident="lanes", lane_bits=spec)
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.yaml").write_text(f"server:\n  resident: lanes\n  lane_bits: '{spec}'\n")
    monkeypatch.setenv("KITE_HOME", str(home))
    with pytest.raises(KiteError, match="lane_bits"):
        load_config()
    monkeypatch.delenv("KITE_HOME")
    r = CliRunner().invoke(cli, ["serve", "--resident", "lanes", "--lane-bits", spec])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "lane_bits" in lines[0], r.output


def test_config_keys_reach_the_settings(tmp_path, monkeypatch):
    from kite.config import load_config
    from kite.serve.settings import ServeSettings

    home = tmp_path / "home"
    home.mkdir()
    (home / "config.yaml").write_text("server:\n  resident: lanes\n  lane_bits: '2:4'\n")
    monkeypatch.setenv("KITE_HOME", str(home))
    settings = ServeSettings.from_config(load_config())
    assert (settings.resident, settings.lane_bits) == ("lanes", "2:4")


def test_head_dims_the_lanes_cannot_take_are_bad_input():
    from kite.upcycle.load.lanes import lanes_for

    assert (lanes_for(4, 128), lanes_for(2, 64), lanes_for(8, 64)) == (128, 32, 128)
    with pytest.raises(BadInput, match="not a power of 2"):
        lanes_for(4, 96)


# -- a real server ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(lm, state, tmp_path_factory):
    """Two servers over the same model, one holding states raw, one in 8-bit lanes."""
    out = {}
    for form in ("raw", "lanes"):
        root = tmp_path_factory.mktemp(f"serve-{form}")
        settings = _settings(root, fusion=True, resident=form, lane_bits="8")
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(state, settings.state_dir / "pca.upc")
        server, app, _ = _start(lm, settings, root)
        out[form] = (server, httpx.Client(base_url=server.url, timeout=120), app)
    yield out
    for server, client, _ in out.values():
        client.close()
        server.stop()


def test_a_lanes_server_holds_the_state_in_lanes_and_reads_it_as_the_raw_one(servers):
    raw, held = _complete(servers["raw"][1]), _complete(servers["lanes"][1])
    assert raw["kite"]["load"]["resident"] == "raw" and held["kite"]["load"]["resident"] == "lanes"
    assert 0 < held["kite"]["load"]["resident_bytes"] and not held["kite"]["warnings"]
    g_raw, g_held = raw["kite"]["generation"], held["kite"]["generation"]
    assert g_held["prefix_tokens"] == g_raw["prefix_tokens"] > 0
    # 8 bits an element: the prompt's NLL after the state within 0.05 bits of the rebuilt KV's
    assert abs(g_held["prompt_nll_bits"] - g_raw["prompt_nll_bits"]) <= 0.05
    assert held["choices"][0]["text"]
    again = _complete(servers["lanes"][1])
    assert "cached" in again["kite"]["load"]["timings_ms"] and again["choices"][0]["text"] == held["choices"][0]["text"]


def test_concurrent_rows_in_lanes_decode_as_each_alone(servers):
    """Requests arriving together share the batch (their lanes stacked for the attention) and answer
    as one alone did."""
    from concurrent.futures import ThreadPoolExecutor

    client = servers["lanes"][1]
    alone = _complete(client)["choices"][0]["text"]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: _complete(client), range(4)))
    assert all(o["kite"]["load"]["resident"] == "lanes" and o["choices"][0]["text"] == alone for o in outs)
