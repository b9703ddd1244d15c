"""`kite serve --resident lanes`, what is its own (the matrix of every resident form is
tests/test_resident_forms.py): lanes at other widths read exactly as the rows they decode to, and
bad lane settings are one line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kite.cli.main import app as cli
from kite.errors import BadInput
from kite.upcycle import StateFile, codec
from tests.test_resident_forms import compress_doc, tiny_lm


@pytest.fixture(scope="module")
def lm(tiny_models):
    return tiny_lm(tiny_models)


@pytest.fixture(scope="module")
def state(lm, tmp_path_factory):
    return compress_doc(lm, tmp_path_factory.mktemp("lanes-states") / "pca.upc", codec.settings_for(4))


@pytest.mark.parametrize("bits", [(4, 4), (2, 4)])
def test_a_batch_row_after_a_state_in_lanes_decodes_as_after_its_decoded_rows(lm, state, bits):
    """BatchDecoder (CPU, fp32): the row whose state stays in lanes gives the tokens and prompt NLL of
    the row after the same rows decoded; nothing is rebuilt into it; keys at 2 bits hold fewer bytes."""
    from kite.runtime.batch_decode import BatchDecoder
    from kite.upcycle import load_lanes, load_prefix

    with StateFile(state) as sf:
        held, report = load_lanes(sf, lm, lane_bits=bits)
        raw, _ = load_prefix(sf, lm)
    assert report.resident == "lanes" and report.resident_bytes == held.nbytes() < raw.nbytes()
    prompt = lm.tokenizer("What does the contract say about payment?")["input_ids"]
    dec = BatchDecoder(lm, max_rows=2)
    h_lanes = dec.add(prompt, prefix=held, max_new_tokens=8, stop_ids=set())
    h_rows = dec.add(prompt, prefix=held.as_kv(), max_new_tokens=8, stop_ids=set())
    assert dec.cache.row_lengths(dec._active[h_lanes].row) == [0] * lm.geometry.n_layers
    res = dec.drain()
    assert res[h_lanes].text == res[h_rows].text
    assert abs(res[h_lanes].prompt_nll_bits - res[h_rows].prompt_nll_bits) <= 1e-4
    assert res[h_lanes].prefix_tokens == res[h_rows].prefix_tokens > 0


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
    from kite.upcycle import lanes_for

    assert (lanes_for(4, 128), lanes_for(2, 64), lanes_for(8, 64)) == (128, 32, 128)
    with pytest.raises(BadInput, match="not a power of 2"):
        lanes_for(4, 96)
