"""Layer weights (kite.upcycle.codec.LayerWeights): measured per model, they weigh each layer side in
the state-wide bit allocation; states made with them name them in their header and address, decode
without them, and the two codec paths write the same bytes with them."""

from __future__ import annotations

import json

import pytest
import torch

from kite.errors import BadInput
from kite.upcycle import codec, measure_layer_weights
from kite.upcycle.compress import CompressSettings, compress_document
from kite.upcycle.format import StateFile
from kite.upcycle.load import load_prefix
from tests.tiny_models import CORPUS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["qwen2"]), device="cpu")


def _weights(L, heavy=0, side="v"):
    k, v = [1.0] * L, [1.0] * L
    (v if side == "v" else k)[heavy] = 8.0
    return codec.LayerWeights(tuple(k), tuple(v))


def test_a_heavier_layer_side_gets_more_bits():
    g = torch.Generator().manual_seed(0)
    K = torch.randn(3, 2, 600, 16, generator=g) * torch.linspace(3, 0.1, 16)
    V = torch.randn(3, 2, 600, 16, generator=g) * torch.linspace(2, 0.1, 16)
    sets = list(torch.arange(600).chunk(3))
    s = codec.settings_for(16)
    plain = codec.fit_state(list(K), list(V), s, sets, overhead_bytes=0)
    heavy = codec.fit_state(list(K), list(V), s, sets, overhead_bytes=0, layer_weights=_weights(3, heavy=1))
    bits = lambda lcs: [int(lc.tensors["v.bits"].long().sum()) for lc in lcs]   # noqa: E731
    assert bits(heavy)[1] > bits(plain)[1]
    assert sum(bits(heavy)) - bits(heavy)[1] < sum(bits(plain)) - bits(plain)[1]


def test_states_made_with_weights_name_them_decode_and_match_on_both_codec_paths(lm, tmp_path):
    w = _weights(lm.geometry.n_layers, heavy=1, side="k")
    st = CompressSettings(codec=codec.settings_for(8), n_clusters=3, min_span_tokens=8, max_span_tokens=48,
                          layer_weights=w)
    a = compress_document(lm, CORPUS, tmp_path / "a.upc", st, address=True)
    b = compress_document(lm, CORPUS, tmp_path / "b.upc", st, address=True, device="cpu")
    plain = compress_document(lm, CORPUS, tmp_path / "p.upc", CompressSettings(
        codec=codec.settings_for(8), n_clusters=3, min_span_tokens=8, max_span_tokens=48), address=True)
    with StateFile(a.path) as fa, StateFile(b.path) as fb, StateFile(plain.path) as fp:
        assert fa.meta["layer_weights"] == {"fingerprint": w.fingerprint}
        assert "layer_weights" not in fp.meta
        assert fa.meta["address"]["id"] == fb.meta["address"]["id"] != fp.meta["address"]["id"]
        for key in fa.index:
            assert fa.read(key) == fb.read(key), key
    assert abs(a.compression_ratio / 8 - 1) <= 0.03
    prefix, _ = load_prefix(a.path, lm)
    assert all(bool(torch.isfinite(k).all()) for k in prefix.keys)


def test_weights_for_another_model_or_malformed_are_one_line_of_bad_input(lm, tmp_path):
    st = CompressSettings(codec=codec.settings_for(8), layer_weights=_weights(lm.geometry.n_layers + 1))
    with pytest.raises(BadInput, match="layers"):
        compress_document(lm, CORPUS, tmp_path / "x.upc", st)
    other = codec.LayerWeights((1.0,) * lm.geometry.n_layers, (1.0,) * lm.geometry.n_layers,
                               {"model_fingerprint": "kite-fp1:" + "0" * 64})
    with pytest.raises(BadInput, match="another model"):
        compress_document(lm, CORPUS, tmp_path / "x.upc", CompressSettings(codec=codec.settings_for(8), layer_weights=other))
    with pytest.raises(BadInput, match="positive"):
        codec.LayerWeights((1.0, -1.0), (1.0, 1.0))
    for body in ("not json", json.dumps({"format": "other"}), json.dumps({"format": "kite-layer-weights", "version": 1})):
        (tmp_path / "w.json").write_text(body)
        with pytest.raises(BadInput, match="layer weights"):
            codec.LayerWeights.load(tmp_path / "w.json")
    with pytest.raises(BadInput, match="no such file"):
        codec.LayerWeights.load(tmp_path / "missing.json")


def test_weights_round_trip_through_their_file(tmp_path):
    w = codec.LayerWeights((0.5, 1.5), (1.25, 0.75), {"ratio": 16.0})
    back = codec.LayerWeights.load(w.save(tmp_path / "w.json"))
    assert back == w and back.fingerprint == w.fingerprint and back.meta == {"ratio": 16.0}


def test_measured_weights_favour_the_layer_sides_whose_errors_cost_most(lm):
    """measure() on the tiny model: a weight per layer side, positive, mean 1, recorded how."""
    w = measure_layer_weights(lm, {"a": CORPUS}, 16, context_tokens=200, continuation_tokens=40, parts=2)
    assert w.n_layers == lm.geometry.n_layers
    allw = list(w.k) + list(w.v)
    assert all(x > 0 for x in allw) and abs(sum(allw) / len(allw) - 1) < 1e-4
    assert w.meta["model_fingerprint"] == lm.fingerprints.base and w.meta["documents"] == ["a"]
    w.check(lm.geometry.n_layers, lm.fingerprints.base)


def test_a_document_too_short_is_named_before_any_document_is_measured(lm, monkeypatch):
    from kite.upcycle import weigh

    measured = []
    monkeypatch.setattr(weigh, "capture", lambda *a, **k: measured.append(1) or 1 / 0)
    with pytest.raises(BadInput, match="short: .* tokens"):
        measure_layer_weights(lm, {"long": CORPUS, "short": " ".join(CORPUS.split()[:30])}, 16, context_tokens=200,
                              continuation_tokens=40, parts=2)
    assert not measured


def test_weigh_writes_weights_that_compress_and_eval_take_from_the_command_line(tiny_models, tmp_path):
    from typer.testing import CliRunner

    from kite.cli.main import app
    from tests.conftest import parse_json

    runner = CliRunner()
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    model, weights = str(tiny_models["qwen2"]), tmp_path / "w.json"
    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text("compression:\n  cluster_num: 3\n  min_span_tokens: 8\n  max_span_tokens: 48\n"
                   "semantic_tagging:\n  generated_examples_per_label: 2\n")
    got = runner.invoke(app, ["upcycle", "weigh", "--model", model, "--input", str(doc), "--output", str(weights),
                              "--context-tokens", "200", "--continuation-tokens", "40", "--json"])
    assert got.exit_code == 0, got.output
    made = parse_json(got.stdout)
    assert made["path"] == str(weights) and len(made["k"]) == len(made["v"]) == 3
    out = tmp_path / "doc.upc"
    got = runner.invoke(app, ["upcycle", "compress", "--model", model, "--input", str(doc), "--output", str(out),
                              "--config", str(cfg), "--ratio", "8", "--layer-weights", str(weights), "--json"])
    assert got.exit_code == 0, got.output
    with StateFile(out) as sf:
        assert sf.meta["layer_weights"]["fingerprint"] == made["fingerprint"]
    shown = runner.invoke(app, ["upcycle", "inspect", str(out)])
    assert f"layer weights {made['fingerprint'].removeprefix('kite-fp1:')[:12]}" in shown.output
    got = runner.invoke(app, ["upcycle", "compress", "--model", model, "--input", str(doc), "--output",
                              str(tmp_path / "plain.upc"), "--config", str(cfg), "--ratio", "8", "--layer-weights",
                              "none"])
    assert got.exit_code == 0, got.output
    assert "layer weights none" in runner.invoke(app, ["upcycle", "inspect", str(tmp_path / "plain.upc")]).output
    (tmp_path / "bad.json").write_text("{}")
    got = runner.invoke(app, ["upcycle", "eval", "--model", model, "--input", str(doc), "--config", str(cfg),
                              "--ratio", "8", "--layer-weights", str(tmp_path / "bad.json")])
    assert got.exit_code == 2 and "layer weights" in got.output
    got = runner.invoke(app, ["upcycle", "weigh", "--model", model, "--output", str(tmp_path / "no" / "w.json")])
    assert got.exit_code == 2


def test_a_model_without_shipped_weights_allocates_plainly_and_a_named_file_or_none_wins(lm, tmp_path):
    from kite.upcycle import UpcycleConfig, open_pipeline

    assert codec.shipped_for(lm.fingerprints.base) is None
    assert open_pipeline(lm=lm, tagger=False, upcycle_config=UpcycleConfig()).settings.layer_weights is None
    w = _weights(lm.geometry.n_layers)
    w.save(tmp_path / "w.json")
    named = open_pipeline(lm=lm, tagger=False, upcycle_config=UpcycleConfig(), layer_weights=tmp_path / "w.json")
    assert named.settings.layer_weights == w
    cfg = UpcycleConfig(layer_weights="none")
    assert open_pipeline(lm=lm, tagger=False, upcycle_config=cfg).settings.layer_weights is None


@pytest.mark.slow
def test_the_embedded_model_compresses_with_the_weights_kite_ships_for_it_unless_told_none(embedded):
    """kite/data/layer_weights/ holds the embedded model's weights (`kite upcycle weigh`'s defaults):
    found by the model's fingerprint, they are the CLI's and the server's default (open_pipeline);
    --layer-weights none (or layer_weights: none) allocates without them."""
    from kite.upcycle import UpcycleConfig, open_pipeline

    shipped = codec.shipped_for(embedded.fingerprints.base)
    assert shipped is not None and shipped.meta["ratio"] == 16.0
    shipped.check(embedded.geometry.n_layers, embedded.fingerprints.base)
    assert open_pipeline(lm=embedded, tagger=False, upcycle_config=UpcycleConfig()).settings.layer_weights == shipped
    assert open_pipeline(lm=embedded, tagger=False, upcycle_config=UpcycleConfig(),
                         layer_weights="none").settings.layer_weights is None


def test_weighs_help_names_the_alpha_it_defaults_to():
    from typer.testing import CliRunner

    from kite.cli.main import app
    from kite.upcycle.codec.layer_weights import ALPHA

    shown = " ".join(CliRunner().invoke(app, ["upcycle", "weigh", "--help"]).output.replace("│", " ").split())
    assert f"default {ALPHA:g}, KITE's" in shown
