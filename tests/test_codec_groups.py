"""States coded on bases shared across layers (a grouped regenerator, kite.upcycle.codec.groups):
the regenerator's fit, the state's layout and header, loads of all or some layers, the checks a
load makes, and the settings such a regenerator refuses."""

from __future__ import annotations

import pytest
import torch

from kite.errors import BadInput
from kite.upcycle import CompressSettings, StateFile, codec_settings, compress_document, load_prefix
from kite.upcycle.capture import capture
from kite.upcycle.codec.regenerator import Regenerator, RegeneratorFit
from tests.tiny_models import CORPUS

DOC = CORPUS.replace(". ", ".\n\n", 5)


@pytest.fixture(scope="module")
def tiny_lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["llama"]), device="cpu")


def _fit(lm, group: int) -> Regenerator:
    fit = RegeneratorFit(n_layers=lm.geometry.n_layers, layer_group=group)
    for i in range(3):
        cap = capture(lm, CORPUS[i * 97:] + CORPUS[:i * 97])
        fit.add(cap.keys_pre, cap.values, cap.ids)
    return fit.finish({"model_fingerprint": lm.fingerprints.base})


@pytest.fixture(scope="module")
def grouped(tiny_lm):
    return _fit(tiny_lm, tiny_lm.geometry.n_layers)


def _compress(lm, reg, out, ratio=8.0, **kw):
    return compress_document(lm, DOC, out, CompressSettings(codec=codec_settings(ratio), n_clusters=3, min_span_tokens=8,
                                                            max_span_tokens=24, **kw), regenerator=reg)


def test_a_grouped_regenerator_is_the_weighted_pca_of_its_layers_side_by_side(tiny_lm, grouped, tmp_path):
    geo = tiny_lm.geometry
    L, W = geo.n_layers, geo.n_kv_heads * geo.head_dim
    assert grouped.grouped and grouped.meta["version"] == 3 and grouped.layer_groups == [(0, L)]
    assert not grouped.weighted          # its weights scale layers; it is not attention-weighted
    mean, evals, U = grouped.side(0, "k")
    w = grouped.weights(0)["k"]
    assert U.dtype == torch.float16 and tuple(U.shape) == (1, L * W, L * W) and tuple(w.shape) == (1, L * W)
    # each layer's features weigh 1 / its calibration variance, alike across its dims
    assert all(len(set(w[0, i * W:(i + 1) * W].tolist())) == 1 for i in range(L))
    # the stored basis is U / sqrt(w) of an orthonormal U: U^T diag(w) U = I (to fp16)
    Uf = U[0].double()
    gram = Uf.T @ (w[0].double()[:, None] * Uf)
    assert torch.allclose(gram, torch.eye(L * W, dtype=torch.float64), atol=2e-2)
    assert bool((evals[0][:-1] >= evals[0][1:]).all())
    grouped.save(tmp_path / "r")
    back = Regenerator.load(tmp_path / "r")
    assert back.fingerprint == grouped.fingerprint and back.layer_groups == grouped.layer_groups
    with pytest.raises(ValueError, match="bases across layers"):
        grouped.layer(0)                 # the per-layer codec never codes on it


def test_a_grouped_regenerator_weighs_each_layers_features_by_attention_and_each_layer_by_its_weight(tiny_lm,
                                                                                                   tmp_path):
    """With the documents' queries, the model's o_proj and layer weights, a feature's weight is 1 / its
    layer's calibration variance, times its attention weight in the layer (its RoPE pair's query
    energy, or its o_proj columns' energy; mean 1 in the layer), times its layer side's weight; the
    basis is the PCA in that metric; states coded on it load every layer."""
    from kite.upcycle.codec import LayerWeights, model_value_weights
    from kite.upcycle.codec import weights as W

    geo = tiny_lm.geometry
    L, H, d = geo.n_layers, geo.n_kv_heads, geo.head_dim
    fit = RegeneratorFit(n_layers=L, layer_group=L)
    plain = RegeneratorFit(n_layers=L, layer_group=L)
    for i in range(3):
        cap = capture(tiny_lm, CORPUS[i * 97:] + CORPUS[:i * 97], queries=True)
        fit.add(cap.keys_pre, cap.values, cap.ids, query_sq=cap.query_sq)
        plain.add(cap.keys_pre, cap.values, cap.ids)
    lw = LayerWeights((1.0, 4.0, 0.5), (0.25, 2.0, 1.0))
    vw = model_value_weights(tiny_lm)
    reg = fit.finish({"model_fingerprint": tiny_lm.fingerprints.base}, value_weights=vw, layer_weights=lw)
    base = plain.finish({"model_fingerprint": tiny_lm.fingerprints.base}).weights(0)
    assert reg.grouped and not reg.weighted and reg.meta["layer_weights"] == lw.fingerprint
    assert "query energy" in reg.meta["weights"]["k"] and "keys' weight" in reg.meta["weights"]["k"]
    assert "o_proj" in reg.meta["weights"]["v"] and "values' weight" in reg.meta["weights"]["v"]
    for side in ("k", "v"):
        inside = torch.cat([W.as_blocks(W.key_weights(fit.query_sq[i], H, d) if side == "k" else vw[i], True)
                            for i in range(L)], dim=1).double()
        across = lw.side(side).repeat_interleave(H * d)[None]
        want = (base[side].double() * inside * across).to(torch.float16).double()
        assert torch.allclose(reg.weights(0)[side].double(), want, rtol=2e-3)
        assert len(set(reg.weights(0)[side][0, :H * d].tolist())) > 1       # not alike inside a layer
        _, _, U = reg.side(0, side)
        w = reg.weights(0)[side][0].double()
        assert torch.allclose(U[0].double().T @ (w[:, None] * U[0].double()), torch.eye(L * H * d, dtype=torch.float64),
                              atol=2e-2)
    res = _compress(tiny_lm, reg, tmp_path / "s.upc", ratio=8.0)
    assert abs(res.compression_ratio - 8.0) / 8.0 < 0.03
    prefix, _ = load_prefix(tmp_path / "s.upc", tiny_lm, regenerator=reg)
    assert len(prefix.keys) == L and all(torch.isfinite(k).all() for k in prefix.keys)
    with pytest.raises(ValueError, match="grouped regenerator only"):
        plain_layers = RegeneratorFit(n_layers=L)
        plain_layers.add(cap.keys_pre, cap.values, cap.ids)
        plain_layers.finish({}, layer_weights=lw)
    with pytest.raises(BadInput, match="are for 2 layers, the model has 3"):
        fit.finish({}, value_weights=vw, layer_weights=LayerWeights((1.0,) * 2, (1.0,) * 2))


def test_a_grouped_regenerator_of_kv_that_varies_little_keeps_its_weights_in_fp16_on_one_scale(tiny_lm):
    """1 / a small variance would pass fp16's largest number: every group's and side's weights are
    scaled by one power of two, so their ratios (all the state-wide allocation compares) are kept."""
    L = tiny_lm.geometry.n_layers
    fits = {scale: RegeneratorFit(n_layers=L, layer_group=L) for scale in (1.0, 1e-4)}
    for i in range(2):
        cap = capture(tiny_lm, CORPUS[i * 97:] + CORPUS[:i * 97])
        for scale, fit in fits.items():
            fit.add([k * scale for k in cap.keys_pre], [v * scale for v in cap.values], cap.ids)
    big, small = (fits[s].finish({"model_fingerprint": tiny_lm.fingerprints.base}).weights(0) for s in (1.0, 1e-4))
    for side in ("k", "v"):
        assert torch.isfinite(small[side]).all() and float(small[side].max()) <= 2 ** 14
    ratio = small["k"].double() / big["k"].double()
    assert torch.allclose(ratio, ratio[0, :1].expand_as(ratio), rtol=2e-3)         # one scale for every feature
    assert torch.allclose(small["v"].double() / big["v"].double(), ratio, rtol=2e-3)   # and both sides
    assert float(big["v"].max()) * 1e8 > 65504          # unscaled, 1 / the small KV's variance would not fit fp16


@pytest.mark.parametrize("group, joint, message", [(2, True, "divides the model's 3 layers"),
                                                   (0, True, "whole number"),
                                                   (3, False, "joint heads")])
def test_a_layer_group_must_divide_the_layers_over_joint_heads(group, joint, message):
    with pytest.raises(BadInput, match=message):
        RegeneratorFit(n_layers=3, layer_group=group, joint_heads=joint)


def test_a_grouped_state_keeps_a_codec_and_parts_per_group_and_loads_every_layer(tiny_lm, grouped, tmp_path):
    geo = tiny_lm.geometry
    made = _compress(tiny_lm, grouped, tmp_path / "s.upc", ratio=4)
    with StateFile(made.path) as sf:
        assert sf.meta["layer_groups"] == [[0, geo.n_layers]]
        assert sf.meta["regenerator"] == {"fingerprint": grouped.fingerprint, "sides": 2}
        n = len(sf.meta["clusters"])
        assert sorted(sf.index) == sorted(["L0"] + [f"c{c}/L0/{s}" for c in range(n) for s in "KV"])
    assert made.compression_ratio == pytest.approx(4.0, rel=0.05)
    full = capture(tiny_lm, DOC)
    prefix, report = load_prefix(made.path, tiny_lm, regenerator=grouped)
    assert report.layers == list(range(geo.n_layers))
    for layer in range(geo.n_layers):
        for want, got in ((full.values[layer], prefix.values[layer]),):
            err = (want - got.float()).pow(2).sum() / (want - want.mean(1, keepdim=True)).pow(2).sum()
            assert float(err) < 0.02, layer           # 4x keeps each layer's values to a few percent
    # a load of one layer decodes its group and keeps that layer: the same rows as the full load
    one, report = load_prefix(made.path, tiny_lm, regenerator=grouped, layers=[1])
    assert torch.equal(one.keys[1], prefix.keys[1]) and torch.equal(one.values[1], prefix.values[1])
    assert one.keys[0].shape[1] == 0 and report.bytes_read > 0


def test_more_compression_costs_more_error(tiny_lm, grouped, tmp_path):
    full = capture(tiny_lm, DOC)
    errs = []
    for ratio in (4, 16):
        made = _compress(tiny_lm, grouped, tmp_path / f"s{ratio}.upc", ratio=ratio)
        prefix, _ = load_prefix(made.path, tiny_lm, regenerator=grouped)
        errs.append(sum(float((v - p.float()).pow(2).sum()) for v, p in zip(full.values, prefix.values)))
        assert made.compression_ratio > 0.9 * ratio
    assert errs[0] < errs[1]


def test_a_grouped_state_passes_verify_and_a_missing_group_part_is_named(tiny_lm, grouped, tmp_path):
    from kite.upcycle.format.container import StateWriter
    from kite.upcycle.inspect import describe_state

    made = _compress(tiny_lm, grouped, tmp_path / "s.upc")
    report = describe_state(made.path, verify=True)
    assert report["layer_groups"] == [[0, tiny_lm.geometry.n_layers]]
    assert report["checksums"]["failed"] == [] and report["checksums"]["ok"] == 1 + 2 * len(report["clusters"])
    with StateFile(made.path) as sf:
        meta = {k: v for k, v in sf.meta.items() if k not in ("blobs", "content")}
        blobs = {k: sf.read(k) for k in sf.index}
    # a blob of a layer that is not a group's first is not called for
    # (the writer checks the header as a reader would: such a state is never written)
    w = StateWriter(zstd=False)
    w.add_many([*blobs.items(), ("L1", blobs["L0"])])
    with pytest.raises(BadInput, match="a part L1 that 1 layer groups and clusters"):
        w.write(tmp_path / "extra.upc", meta)
    # groups that do not cover the layers are a corrupt header
    w = StateWriter(zstd=False)
    w.add_many(blobs.items())
    with pytest.raises(BadInput, match="does not cover the state's 3 layers"):
        w.write(tmp_path / "groups.upc", {**meta, "layer_groups": [[0, 1]]})
    # and a state whose groups are dropped calls for every layer's parts
    w = StateWriter(zstd=False)
    w.add_many(blobs.items())
    with pytest.raises(BadInput, match="no part L1"):
        w.write(tmp_path / "ungrouped.upc", {k: v for k, v in meta.items() if k != "layer_groups"})


def test_a_damaged_group_part_is_named_by_the_load(tiny_lm, grouped, tmp_path):
    from kite.upcycle.format.container import StateWriter

    made = _compress(tiny_lm, grouped, tmp_path / "s.upc")
    with StateFile(made.path) as sf:
        meta = {k: v for k, v in sf.meta.items() if k not in ("blobs", "content")}
        blobs = {k: sf.read(k) for k in sf.index}
    from kite.upcycle import codec

    part = codec.from_bytes(blobs["c0/L0/V"])
    part.meta["T"] += 1                                   # a token count its cluster does not have
    blobs["c0/L0/V"] = codec.to_bytes(part)
    w = StateWriter(zstd=False)
    w.add_many(blobs.items())
    w.write(tmp_path / "bad.upc", meta)
    with pytest.raises(BadInput, match="part c0/L0/V does not decode"):
        load_prefix(tmp_path / "bad.upc", tiny_lm, regenerator=grouped)


@pytest.mark.parametrize("how, message", [
    ({"ratio": None}, "one ratio"),
    ({"label_ratios": {"payment": 16.0}}, "per-label ratios"),
])
def test_a_grouped_regenerator_codes_at_one_ratio_only(tiny_lm, grouped, tmp_path, how, message):
    if how.get("ratio", 1) is None:
        s = CompressSettings(codec=codec_settings("int4"), n_clusters=3)
    else:
        s = CompressSettings(codec=codec_settings(8.0), n_clusters=3, **how)
    with pytest.raises(BadInput, match=message):
        compress_document(tiny_lm, DOC, tmp_path / "s.upc", s, regenerator=grouped)


def test_a_grouped_state_does_not_load_without_its_regenerator(tiny_lm, grouped, tmp_path, monkeypatch):
    from kite.errors import FingerprintMismatch
    from kite.upcycle.codec import regenerator as R

    made = _compress(tiny_lm, grouped, tmp_path / "s.upc")
    monkeypatch.setattr(R, "_LOADED", {})
    with pytest.raises(FingerprintMismatch, match=grouped.fingerprint[9:21]):
        load_prefix(made.path, tiny_lm)


def test_train_fits_a_grouped_regenerator_and_codes_its_states_on_it(tiny_models, tmp_path):
    from typer.testing import CliRunner

    from kite.cli.main import app
    from tests.conftest import parse_json
    from tests.test_train import _pairs_file

    def train(out, *extra):
        return CliRunner().invoke(app, ["upcycle", "train", "--model", str(tiny_models["llama"]), "--data-path",
                                        str(_pairs_file(tmp_path)), "--output-dir", str(out), "--eval-fraction", "0.2",
                                        "--regenerator-only", "--json", *extra])

    res = train(tmp_path / "bad", "--layer-group", "2")          # the tiny model has 3 layers
    assert res.exit_code == 2 and "--layer-group 2: expected a whole number that divides the model's 3 layers" \
        in res.output, res.output
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())   # nothing written
    res = train(tmp_path / "zero", "--layer-group", "0")
    assert res.exit_code == 2 and "--layer-group" in res.output
    res = train(tmp_path / "run", "--layer-group", "3")
    assert res.exit_code == 0, res.output
    rep = parse_json(res.output)
    reg = Regenerator.load(tmp_path / "run" / "regenerator")
    assert reg.layer_groups == [(0, 3)] and reg.fingerprint == rep["regenerator"]["fingerprint"]
    assert rep["regenerator"]["layer_groups"] == [[0, 3]]
    assert rep["layer_weights"] is None and rep["regenerator"]["layer_weights"] is None   # none ship for it
    assert "query energy" in reg.meta["weights"]["k"]             # attention-weighted inside each layer
    states = sorted((tmp_path / "run" / "states").rglob("*.upc"))
    assert states
    for path in states:
        with StateFile(path) as sf:
            assert sf.meta["layer_groups"] == [[0, 3]] and sf.meta["regenerator"]["fingerprint"] == reg.fingerprint


def test_train_fits_the_layer_weights_it_is_given_into_its_bases_across_layers(tiny_models, tmp_path):
    """Named layer weights go into a grouped regenerator's bases (its states are coded without them);
    the report and the run's key name them."""
    from typer.testing import CliRunner

    from kite.cli.main import app
    from kite.upcycle.codec import LayerWeights
    from tests.conftest import parse_json
    from tests.test_train import _pairs_file

    w = LayerWeights((1.0, 3.0, 0.5), (0.5, 2.0, 1.0))
    w.save(tmp_path / "w.json")
    (tmp_path / "u.yaml").write_text(f"layer_weights: {tmp_path / 'w.json'}\n")

    def train(out, *extra):
        return CliRunner().invoke(app, ["upcycle", "train", "--model", str(tiny_models["llama"]), "--data-path",
                                        str(_pairs_file(tmp_path)), "--output-dir", str(out), "--eval-fraction", "0.2",
                                        "--regenerator-only", "--layer-group", "3", "--json", *extra])

    res = train(tmp_path / "run", "--config", str(tmp_path / "u.yaml"))
    assert res.exit_code == 0, res.output
    rep = parse_json(res.output)
    reg = Regenerator.load(tmp_path / "run" / "regenerator")
    assert reg.meta["layer_weights"] == w.fingerprint == rep["regenerator"]["layer_weights"]
    assert rep["layer_weights"] is None
    for path in sorted((tmp_path / "run" / "states").rglob("*.upc")):
        with StateFile(path) as sf:
            assert sf.meta.get("layer_weights") is None and sf.meta["regenerator"]["fingerprint"] == reg.fingerprint
    res = train(tmp_path / "run", "--resume")                  # fitted with other weights: another run
    assert res.exit_code != 0 and "holds another run" in res.output


def test_a_grouped_states_cluster_is_recoded_at_a_higher_ratio_on_its_group(tiny_lm, grouped, tmp_path):
    from kite.upcycle import cluster_ratios, recode_clusters

    made = _compress(tiny_lm, grouped, tmp_path / "s.upc", ratio=4)
    before, _ = load_prefix(made.path, tiny_lm, regenerator=grouped)
    size = recode_clusters(made.path, {0: 16.0}, regenerator=grouped)
    assert size < made.state_bytes
    with StateFile(made.path) as sf:
        assert cluster_ratios(sf.meta)[0] == 16.0 and sf.meta["layer_groups"] == [[0, tiny_lm.geometry.n_layers]]
        rows0 = [t for s, e in sf.meta["clusters"][0]["token_ranges"] for t in range(s, e)]
    after, _ = load_prefix(made.path, tiny_lm, regenerator=grouped)
    full = capture(tiny_lm, DOC)
    others = sorted(set(range(full.n_tokens)) - set(rows0))
    err = {}
    for name, p in (("before", before), ("after", after)):
        for which, rows in (("recoded", rows0), ("others", others)):
            err[(name, which)] = sum(float((v[:, rows] - x.float()[:, rows]).pow(2).sum())
                                     for v, x in zip(full.values, p.values))
    assert err[("after", "recoded")] > err[("before", "recoded")]          # the recoded cluster lost bits
    assert err[("after", "others")] == pytest.approx(err[("before", "others")])   # the others are as they were


@pytest.mark.parametrize("T, even", [(700, True), (700, False), (512, True), (37, False)])
def test_a_parts_classes_in_one_plan_are_the_bytes_of_the_class_by_class_quantizer(T, even):
    """The one-launch quantizer a part's coefficients take on a GPU (kite.kernels.quant.quantize_plan)
    lays out the bytes the class-by-class quantizer writes: run here on the host's reference."""
    from kite.upcycle.codec import coders
    from kite.upcycle.codec.settings import settings_for

    s = settings_for(16.0, even_groups=even)
    g = torch.Generator().manual_seed(T)
    C = torch.randn(T, 40, generator=g) * torch.linspace(4, 0.1, 40)
    colbits = torch.tensor([8, 1, 3, 3, 0, 2, 5, 4] * 5)
    want = coders._classes(C, colbits, T, s)
    got = coders._classes_on_device(C, colbits, T, s)
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert coders._classes_on_device(C, torch.zeros(40, dtype=torch.long), T, s) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_a_parts_classes_are_the_hosts_bytes():
    from kite.upcycle.codec import coders
    from kite.upcycle.codec.settings import settings_for

    s = settings_for(16.0)
    g = torch.Generator().manual_seed(5)
    C = torch.randn(700, 40, generator=g) * torch.linspace(4, 0.1, 40)
    colbits = torch.tensor([8, 1, 3, 3, 0, 2, 5, 4] * 5)
    want = coders._classes(C, colbits, 700, s)
    got = coders._classes_on_device(C.cuda(), colbits, 700, s)
    for a, b in zip(want, got):
        assert torch.equal(a, b.cpu())


def _group_parts(lm, reg, device: str, outliers: int = 0):
    """Each side's parts of a grouped state's three clusters, coded together (encode_groups) and one
    by one (PcaSide.encode, as before the parts were coded together)."""
    from kite.upcycle.codec import groups
    from kite.upcycle.codec.coders import coder
    from kite.upcycle.codec.settings import settings_for

    cap = capture(lm, DOC)
    T = cap.n_tokens
    sets = [torch.arange(0, T, 3), torch.arange(1, T, 3), torch.arange(2, T, 3)]    # the sink in the first
    s = settings_for(16.0, outliers=outliers)
    keys = [k.to(device) for k in cap.keys_pre]
    values = [v.to(device) for v in cap.values]
    fits = groups.fit_groups(keys, values, s, sets, reg)
    together = {(c, side): getattr(part, side) for _, c, part in groups.encode_groups(fits, sets)
                for side in ("k", "v")}
    alone = {}
    for c, at in enumerate(sets):
        on = at.to(device)
        for side in ("k", "v"):
            alone[(c, side)] = coder("rpca").encode(fits[0].codec, side, fits[0].blocks[side][:, on], at,
                                                    coefficients=fits[0].coefficients[side][on])
    return together, alone


@pytest.mark.parametrize("outliers", [0, 3])
def test_a_groups_parts_coded_together_are_the_bytes_of_each_coded_alone(tiny_lm, grouped, outliers):
    """One quantizer launch for every part of a side (kite.upcycle.codec.groups.encode_side) writes
    each part's bytes as coding it alone does: its codes, scales, minima, sinks and outliers."""
    together, alone = _group_parts(tiny_lm, grouped, "cpu", outliers)
    assert len(together) == len(alone) == 6
    for key, want in alone.items():
        got = together[key]
        assert got.meta == want.meta and set(got.tensors) == set(want.tensors)
        assert {"codes", "scale", "min"} <= set(got.tensors) and ("out.idx" in got.tensors) == (key[0] == 0 or outliers > 0)
        for name, t in want.tensors.items():
            assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name], t), (key, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_a_groups_parts_coded_together_are_the_hosts_bytes(tiny_lm, grouped):
    """On a GPU the parts coded together are the bytes the GPU codes each alone, whose codes are the
    host's quantizer's (test_on_a_gpu_a_parts_classes_are_the_hosts_bytes)."""
    together, alone = _group_parts(tiny_lm, grouped, "cuda")
    for key, want in alone.items():
        for name, t in want.tensors.items():
            assert torch.equal(together[key].tensors[name].cpu(), t.cpu()), (key, name)


def _blobs():
    from kite.upcycle.codec.blob import Blob, LayerCodec

    g = torch.Generator().manual_seed(9)
    return [LayerCodec(tensors={"k.mean": torch.randn(3, 7, generator=g).half(), "k.bits": torch.arange(6).reshape(2, 3)},
                       meta={"H": 1}),
            Blob(tensors={"codes": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
                          "scale": torch.randn(5, generator=g).bfloat16(), "out.idx": torch.tensor([1, 4], dtype=torch.int16),
                          "empty": torch.zeros(0, 4)}, meta={"T": 13}),
            Blob(tensors={}, meta={"T": 0})]


def test_blobs_serialized_together_are_the_bytes_of_each_alone():
    from kite.upcycle.codec import to_bytes, to_bytes_many

    blobs = _blobs()
    assert to_bytes_many(blobs) == [to_bytes(b) for b in blobs]
    assert to_bytes_many([]) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_blobs_serialized_together_are_the_hosts_bytes():
    from dataclasses import replace

    from kite.upcycle.codec import to_bytes, to_bytes_many

    blobs = _blobs()
    on_gpu = [replace(b, tensors={k: t.cuda() for k, t in b.tensors.items()}) for b in blobs]
    assert to_bytes_many(on_gpu) == [to_bytes(b) for b in blobs]


def test_two_groups_of_two_layers_keep_their_parts_apart_and_load_alike(tmp_path):
    from kite.model import load_model
    from kite.testing.tiny_models import make_tiny_model

    lm = load_model(str(make_tiny_model(tmp_path / "m4", "llama", layers=4)), device="cpu")
    reg = _fit(lm, 2)
    assert reg.layer_groups == [(0, 2), (2, 4)]
    made = _compress(lm, reg, tmp_path / "s.upc", ratio=4)
    with StateFile(made.path) as sf:
        assert sf.meta["layer_groups"] == [[0, 2], [2, 4]]
        n = len(sf.meta["clusters"])
        # in file order, each group's codec then its parts
        assert list(sf.index) == [k for a in (0, 2) for k in [f"L{a}"] + [f"c{c}/L{a}/{s}" for c in range(n) for s in "KV"]]
    assert made.compression_ratio == pytest.approx(4.0, rel=0.05)
    full = capture(lm, DOC)
    prefix, _ = load_prefix(made.path, lm, regenerator=reg)
    for layer in range(4):
        want, got = full.values[layer], prefix.values[layer].float()
        assert float((want - got).pow(2).sum() / (want - want.mean(1, keepdim=True)).pow(2).sum()) < 0.02, layer
    some, report = load_prefix(made.path, lm, regenerator=reg, layers=[0, 3])
    assert [some.keys[layer].shape[1] > 0 for layer in range(4)] == [True, False, False, True]
    assert torch.equal(some.keys[3], prefix.keys[3]) and torch.equal(some.values[0], prefix.values[0])


def _staged(lm, path, reg, layers):
    from kite.upcycle import load, rope_cos_sin

    geo = lm.geometry
    with StateFile(path) as state:
        assert load.supports_state(state)
        sel = load.select(state, None)
        hot = load.stage_state(state, sel.parts, sel.part_positions, layers, n_layers=geo.n_layers,
                               H=geo.n_kv_heads, d=geo.head_dim, threads=1, regenerator=reg)
    cos, sin = rope_cos_sin(lm.model, hot.positions)
    return load.load_staged(hot, device="cpu", dtype=torch.float32, cos=cos, sin=sin, n_layers=geo.n_layers)


@pytest.mark.parametrize("layers, group", [(4, 2), (3, 3)])
def test_the_staged_load_of_a_grouped_state_is_the_host_decode(tmp_path, layers, group):
    """The GPU path's staging and rebuild (here their torch fallbacks): one product per group, each
    member layer's slice finished into its rows (its sink row too), the layers not asked left out."""
    from kite.model import load_model
    from kite.testing.tiny_models import make_tiny_model

    lm = load_model(str(make_tiny_model(tmp_path / "m", "llama", layers=layers)), device="cpu")
    reg = _fit(lm, group)
    made = _compress(lm, reg, tmp_path / "s.upc", ratio=8)
    ref, _ = load_prefix(made.path, lm, regenerator=reg)
    asked = [0, layers - 1]
    keys, values = _staged(lm, made.path, reg, asked)
    for layer in range(layers):
        if layer not in asked:
            assert keys[layer] is None and values[layer] is None
            continue
        for got, want in ((keys[layer], ref.keys[layer]), (values[layer], ref.values[layer])):
            assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-4), layer
        assert torch.equal(values[layer][:, 0], ref.values[layer][:, 0])     # the sink row, exact


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_a_grouped_state_loads_staged_and_from_graphs_as_the_host_decodes(tmp_path):
    from kite.model import load_model
    from kite.testing.tiny_models import make_tiny_model
    from kite.upcycle.load import HotTier

    folder = make_tiny_model(tmp_path / "m", "llama", layers=4)
    lm = load_model(str(folder), device="cpu")
    reg = _fit(lm, 2)
    made = _compress(lm, reg, tmp_path / "s.upc", ratio=8)
    ref, _ = load_prefix(made.path, lm, regenerator=reg)
    gpu = load_model(str(folder), device="cuda")
    tier = HotTier(pin=True)
    for _ in range(3):        # staged, staged from the hot tier (graphs marked), replayed graphs
        got, report = load_prefix(made.path, gpu, regenerator=reg, tier=tier, layers=[0, 1, 3])
        assert "gpu_load" in report.timings_ms
        assert got.keys[2].shape[1] == 0
        for layer in (0, 1, 3):
            for a, b in ((got.keys[layer], ref.keys[layer]), (got.values[layer], ref.values[layer])):
                tol = (1e-4 if gpu.dtype == torch.float32 else 2e-2) * float(b.abs().max())
                assert torch.allclose(a.float().cpu(), b, atol=tol, rtol=0), layer


def test_layer_weights_are_not_applied_to_states_on_bases_across_layers():
    """The weights KITE ships for a model are left out of such states; weights a user names are
    refused in one line (the regenerator weighs its layers itself)."""
    from kite.upcycle.pipeline import layer_weights_for

    assert layer_weights_for(None, False, None, grouped=True) is None
    with pytest.raises(BadInput, match="weighs its layers itself"):
        layer_weights_for(None, True, object(), grouped=True)


def test_a_grouped_state_whose_header_drops_its_regenerator_is_refused_in_one_line(tiny_lm, grouped, tmp_path):
    from kite.upcycle import load
    from kite.upcycle.format.container import StateWriter

    made = _compress(tiny_lm, grouped, tmp_path / "s.upc")
    with StateFile(made.path) as sf:
        meta = {k: v for k, v in sf.meta.items() if k not in ("blobs", "content", "regenerator")}
        blobs = {k: sf.read(k) for k in sf.index}
    w = StateWriter(zstd=False)
    w.add_many(blobs.items())
    w.write(tmp_path / "bare.upc", meta)
    with pytest.raises(BadInput, match="does not decode"):
        load_prefix(tmp_path / "bare.upc", tiny_lm)                        # the host decode
    geo = tiny_lm.geometry
    with StateFile(tmp_path / "bare.upc") as state, \
            pytest.raises(BadInput, match="coded on a regenerator's basis, and the header names none"):
        sel = load.select(state, None)
        load.stage_state(state, sel.parts, sel.part_positions, [0], n_layers=geo.n_layers, H=geo.n_kv_heads,
                         d=geo.head_dim, threads=1)                         # the GPU path's staging


def test_a_grouped_state_entropy_coded_loads_as_it_does_plain(tiny_lm, grouped, tmp_path):
    """A group's parts (every layer of a cluster in one part) are large enough to code; the coded
    state is the ratio asked and its host load and staging give what its blobs, stored plain, give."""
    from kite.upcycle import StateWriter

    made = _compress(tiny_lm, grouped, tmp_path / "e.upc", entropy_coding=True)
    assert abs(made.compression_ratio / 8 - 1) <= 0.03, made.compression_ratio
    with StateFile(tmp_path / "e.upc") as st:
        assert any(e.codec == "rans" for e in st.index.values())
        writer = StateWriter(zstd=False)
        writer.add_many([(key, st.read(key)) for key in st.index])
        writer.write(tmp_path / "plain.upc", {k: v for k, v in st.meta.items()
                                              if k not in ("content", "signature", "entropy")})
    want, _ = load_prefix(tmp_path / "plain.upc", tiny_lm, regenerator=grouped)
    got, _ = load_prefix(tmp_path / "e.upc", tiny_lm, regenerator=grouped)
    staged = _staged(tiny_lm, tmp_path / "e.upc", grouped, list(range(tiny_lm.geometry.n_layers)))
    for layer in range(tiny_lm.geometry.n_layers):
        assert torch.equal(got.keys[layer], want.keys[layer]) and torch.equal(got.values[layer], want.values[layer])
        assert torch.allclose(staged[0][layer], want.keys[layer], atol=1e-4 * float(want.keys[layer].abs().max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_an_entropy_coded_state_loads_staged_and_from_graphs_as_its_plain_twin(tiny_models, grouped,
                                                                                        tmp_path):
    """The GPU path inflates a coded part on the host before its staging: a coded state on the
    device (staged, from the hot tier, replayed graphs) is its plain twin on the device."""
    from kite.model import load_model
    from kite.upcycle import StateWriter
    from kite.upcycle.load import HotTier

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    made = _compress(lm, grouped, tmp_path / "e.upc", entropy_coding=True)
    with StateFile(made.path) as st:
        assert any(e.codec == "rans" for e in st.index.values())
        writer = StateWriter(zstd=False)
        writer.add_many([(key, st.read(key)) for key in st.index])
        writer.write(tmp_path / "plain.upc", {k: v for k, v in st.meta.items()
                                              if k not in ("content", "signature", "entropy")})
    gpu = load_model(str(tiny_models["llama"]), device="cuda")
    tiers = HotTier(pin=True), HotTier(pin=True)
    for _ in range(3):        # staged, staged from the hot tier, replayed graphs
        want, _ = load_prefix(tmp_path / "plain.upc", gpu, regenerator=grouped, tier=tiers[0])
        got, report = load_prefix(made.path, gpu, regenerator=grouped, tier=tiers[1])
        assert "gpu_load" in report.timings_ms
        for layer in range(gpu.geometry.n_layers):
            assert torch.equal(got.keys[layer], want.keys[layer]), layer
            assert torch.equal(got.values[layer], want.values[layer]), layer


@pytest.mark.slow     # (a benchmark script in its own Python: a torch import)
def test_the_quality_benchmark_refuses_weighted_per_layer_bases_across_layers_before_a_model_loads():
    """`--weighted` is for per-layer bases; bases across layers are always attention-weighted."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "regenerator_quality.py"), "--weighted",
                          "--layer-group", "30"], cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "bases across layers are always attention-weighted" in run.stderr
    assert "Traceback" not in run.stderr and "calibration 1/" not in run.stderr     # nothing fitted
