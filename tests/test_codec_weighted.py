"""Attention-aware distortion in the codec: weighted PCA, its dual encoding, the measured choice
between the document's basis and a weighted regenerator's, and the weights themselves."""

from __future__ import annotations

import json

import pytest
import torch

from kite.errors import BadInput
from kite.upcycle import codec as C
from kite.upcycle.codec.coders import coder
from kite.upcycle.codec import weights as W
from kite.upcycle.codec.regenerator import Regenerator, RegeneratorFit

H, d = 2, 16


def _data(seed: int, T: int = 1024, spectrum: torch.Tensor | None = None) -> torch.Tensor:
    """[H, T, d] Gaussian tokens with a fixed (per seed-family) anisotropic spectrum and mean."""
    g = torch.Generator().manual_seed(seed)
    if spectrum is None:
        spectrum = torch.logspace(1, -2, H * d)
    rot = torch.linalg.qr(torch.randn(H * d, H * d, generator=torch.Generator().manual_seed(7)))[0]
    X = (torch.randn(T, H * d, generator=g) * spectrum.sqrt()) @ rot.T + 0.5
    return X.reshape(T, H, d).permute(1, 0, 2).contiguous()


def _weights(seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return W.as_blocks(torch.rand(H, d, generator=g) ** 3 * 50 + 0.05, joint=True)


def _settings(**kw):
    return C.settings_for("ratio=8", **kw)


def test_a_weighted_side_decodes_its_dual_encoding_and_survives_bytes():
    """The stored basis U / sqrt(w) is not orthonormal: parts are encoded with its dual (w * basis),
    and the weights travel with the layer codec's bytes, so a codec read back encodes the same."""
    x, w = _data(1), _weights()
    s = C.settings_for("ratio=2", basis_fmt="fp32", k_bits=16, v_bits=16)    # every component at 8 bits
    lc = C.fit_layer(x, x, s, weights={"k": w, "v": w})
    assert bool((lc.tensors["k.bits"] == 8).all())
    assert lc.meta["k"]["mode"] == "pca" and "k.w" in lc.tensors and "v.w" in lc.tensors
    part = C.encode(lc, x, x, torch.arange(x.shape[1]))
    kh, _ = C.decode(lc, part)
    assert ((kh - x).norm() / x.norm()).item() < 0.02
    back = C.from_bytes(C.to_bytes(lc), C.LayerCodec)
    again = C.encode(back, x, x, torch.arange(x.shape[1]))
    assert torch.equal(C.decode(back, again)[0], kh)
    # projecting with the basis' transpose (what an orthonormal basis allows) would be wrong here
    basis = C.PcaSide.basis(lc, "k")
    gram = basis.T @ basis
    assert (gram - torch.eye(gram.shape[0])).abs().max().item() > 0.1


@pytest.mark.parametrize("seed", [1, 2])
def test_weighted_pca_leaves_the_weighted_error_it_predicts_and_less_than_plain_pca(seed):
    """fit's return (expected weighted squared error per token) matches decode(encode(x)) measured on
    the tokens, and the weighted fit beats the plain one in the weighted metric at the same budget."""
    x, w = _data(seed, T=2048), _weights()
    s = _settings(basis_fmt="fp32")
    t, m = {}, {"settings": s.to_json(), "H": H, "d": d}
    predicted = coder("pca").fit("k", x, s, t, m, weights=w)
    measured = C.weighted_error(C.LayerCodec(t, m), "k", x, w) / x.shape[1]
    assert 0.7 * predicted <= measured <= 1.4 * predicted, (predicted, measured)
    plain = C.fit_layer(x, x, s)
    assert measured < 0.9 * C.weighted_error(plain, "k", x, w) / x.shape[1]


def _weighted_regenerator(seeds, spectrum=None) -> Regenerator:
    """A weighted regenerator of one layer, fitted on synthetic KV with queries whose energy gives
    the key weights and an o_proj whose column energy gives the value weights."""
    g = torch.Generator().manual_seed(5)
    fit = RegeneratorFit(n_layers=1)
    query_sq = torch.rand(2 * H * d, generator=g) ** 3 * 100 + 0.1        # 2 query heads per KV head
    for seed in seeds:
        x = _data(seed, spectrum=spectrum)
        fit.add([x], [x.flip(-1)], query_sq=[query_sq])
    o_weight = torch.randn(8, 2 * H * d, generator=g) * torch.rand(2 * H * d, generator=g)
    return fit.finish({"model_fingerprint": "kite-fp1:test"}, value_weights=[W.value_weights(o_weight, H, d)])


def _candidates(x, s, reg, side, w):
    """Each candidate's measured weighted error, fitted as the measured choice fits them."""
    errs = {}
    for name, mode, given, ww in (("rpca", "rpca", reg.side(0, side), w), ("pca-w", "pca", None, w),
                                  ("pca", "pca", None, None)):
        t, m = {}, {"settings": s.to_json(), "H": H, "d": d}
        coder(mode).fit(side, x, s, t, m, pca=given, weights=ww)
        lc = C.LayerCodec(t, m)
        if mode == "rpca":
            C.attach_regenerator(lc, {side: given[2]}, sides=(side,))
        errs[name] = C.weighted_error(lc, side, x, w)
    return errs


@pytest.mark.parametrize("case", ["same distribution, short document", "another distribution"])
def test_the_measured_choice_keeps_the_basis_with_the_lower_weighted_error(case):
    if case.startswith("same"):
        reg = _weighted_regenerator((10, 11, 12))
        x = _data(2, T=256)                     # short: a document's own basis costs many bytes
    else:
        reg = _weighted_regenerator((10, 11, 12), spectrum=torch.logspace(-2, 1, H * d))
        x = _data(2, T=2048)
    s = _settings()
    ws = reg.weights(0)
    lc = C.fit_layer(x, x.flip(-1), s, **reg.layer(0))
    for side, X in (("k", x), ("v", x.flip(-1))):
        errs = _candidates(X, s, reg, side, ws[side])
        best = min(errs, key=errs.get)
        got = {"rpca": "rpca", "pca": "pca-w" if f"{side}.w" in lc.tensors else "pca"}[lc.meta[side]["mode"]]
        assert got == best, (side, errs, got)
        assert C.weighted_error(lc, side, X, ws[side]) == pytest.approx(errs[best], rel=1e-6)
    modes = {lc.meta[side]["mode"] for side in "kv"}
    assert modes == ({"rpca"} if case.startswith("same") else {"pca"})


def test_key_weights_pair_rope_dims_and_sum_the_query_heads_of_a_kv_head():
    q = torch.arange(4 * 8, dtype=torch.float64)            # 4 query heads of d=8, 2 KV heads
    w = W.key_weights(q, n_kv_heads=2, head_dim=8)
    per_head = q.reshape(4, 8)
    pair = per_head[:, :4] + per_head[:, 4:]
    want = torch.cat([pair, pair], dim=1).reshape(2, 2, 8).sum(dim=1)
    assert torch.equal(w, want)
    o = torch.randn(5, 4 * 8, dtype=torch.float64)
    assert torch.allclose(W.value_weights(o, 2, 8), o.pow(2).sum(0).reshape(2, 2, 8).sum(1))
    b = W.as_blocks(torch.tensor([[0.0, 1.0], [2.0, 5.0]]), joint=True)
    assert b.shape == (1, 4) and b.mean().item() == pytest.approx(1.0, abs=W.FLOOR) and b.min() >= W.FLOOR
    with pytest.raises(ValueError, match="query heads"):
        W.key_weights(torch.ones(3 * 8), n_kv_heads=2, head_dim=8)


def test_a_weighted_regenerator_is_version_2_and_an_unweighted_one_loads_as_before(tmp_path):
    reg = _weighted_regenerator((10, 11))
    assert reg.weighted and reg.meta["version"] == 2 and reg.meta["weights"]["floor"] == W.FLOOR
    reg.save(tmp_path / "w")
    back = Regenerator.load(tmp_path / "w")
    assert back.fingerprint == reg.fingerprint and torch.equal(back.weights(0)["k"], reg.weights(0)["k"])
    # the weighted basis decodes as U / sqrt(w): its columns are orthonormal in the weighted metric
    _, _, basis = back.side(0, "k")
    root = back.weights(0)["k"].sqrt()
    U = basis[0] * root[0][:, None]
    assert torch.allclose(U.T @ U, torch.eye(H * d), atol=1e-4)
    plain = RegeneratorFit(n_layers=1)
    plain.add([_data(10)], [_data(11)])                    # no queries: unweighted, version 1
    old = plain.finish({"model_fingerprint": "kite-fp1:test"}, value_weights=[torch.ones(H, d)])
    assert not old.weighted and old.meta["version"] == 1 and old.weights(0) is None
    assert old.layer(0)["weights"] is None
    old.save(tmp_path / "old")
    assert Regenerator.load(tmp_path / "old").fingerprint == old.fingerprint
    meta = json.loads((tmp_path / "w" / "regenerator.json").read_text())
    meta["version"] = 4
    (tmp_path / "w" / "regenerator.json").write_text(json.dumps(meta))
    with pytest.raises(BadInput, match="format 4 is newer"):
        Regenerator.load(tmp_path / "w")


def test_weights_must_be_positive_and_shaped_like_the_blocks():
    x = _data(1, T=128)
    with pytest.raises(ValueError, match="positive"):
        C.fit_layer(x, x, _settings(), weights={"k": torch.zeros(1, H * d)})
    with pytest.raises(ValueError, match="1x32"):
        C.fit_layer(x, x, _settings(), weights={"k": torch.ones(1, 7)})


def test_an_unweighted_regenerator_can_pick_by_measured_plain_error():
    fit = RegeneratorFit(n_layers=1)
    for seed in (10, 11, 12):
        x = _data(seed, spectrum=torch.logspace(-2, 1, H * d))
        fit.add([x], [x])
    reg = fit.finish({"model_fingerprint": "kite-fp1:test"})
    reg.choice = "measured"
    s = _settings()
    for T in (256, 2048):
        x = _data(2, T=T)
        lc = C.fit_layer(x, x, s, **reg.layer(0))
        assert "k.w" not in lc.tensors
        ones = torch.ones(1, H * d)
        errs = {}
        for mode, given in (("rpca", reg.side(0, "k")), ("pca", None)):
            t, m = {}, {"settings": s.to_json(), "H": H, "d": d}
            coder(mode).fit("k", x, s, t, m, pca=given)
            trial = C.LayerCodec(t, m)
            if mode == "rpca":
                C.attach_regenerator(trial, {"k": given[2]}, sides=("k",))
            errs[mode] = C.weighted_error(trial, "k", x, ones)
        assert lc.meta["k"]["mode"] == min(errs, key=errs.get)
    with pytest.raises(ValueError, match="choice"):
        C.fit_layer(x, x, s, choice="best")
