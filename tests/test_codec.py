"""KV codec: exact round trip, byte accounting, precision tolerances (random tensors, fast).

The matrix tests run over every preset in the registry (`codec.PRESETS`) and the tabled ratios, so
a new preset is tested the moment it is listed (and must be given a tolerance here)."""

import math

import pytest
import torch

from kite.upcycle import codec as C
from kite.upcycle.codec import dequantize, quantize
from kite.upcycle.codec.settings import RATIO_FILL, RATIO_K_SHARE

H, T, D = 3, 512, 64
SETTINGS = sorted(C.PRESETS) + [f"ratio={r:g}" for r in sorted(RATIO_K_SHARE)]


pytestmark = pytest.mark.usefixtures("one_thread")


def _kv(seed=0, T=T):
    g = torch.Generator().manual_seed(seed)
    # keys: large mean + decaying spectrum (pre-RoPE-like); values: flatter spectrum
    scales_k = torch.logspace(0.5, -1.5, D)
    scales_v = torch.logspace(0, -0.7, D)
    rot = torch.linalg.qr(torch.randn(H, D, D, generator=g))[0]
    k = (torch.randn(H, T, D, generator=g) * scales_k) @ rot + 3 * torch.randn(H, 1, D, generator=g)
    v = (torch.randn(H, T, D, generator=g) * scales_v) @ rot.transpose(1, 2)
    k[:, 0] *= 4  # a sink-like first token
    return k.float(), v.float()


def _rel(a, b):
    return ((a - b).pow(2).sum() / (b - b.mean(dim=1, keepdim=True)).pow(2).sum()).item()


def _roundtrip(setting, k, v, parts=2):
    s = C.settings_for(setting)
    lc = C.fit_layer(k, v, s)
    n = k.shape[1]
    b = [round(i * n / parts) for i in range(parts + 1)]
    enc = [C.encode(lc, k[:, x:y], v[:, x:y], torch.arange(x, y)) for x, y in zip(b[:-1], b[1:])]
    dec = [C.decode(lc, p) for p in enc]
    kh = torch.cat([d[0] for d in dec], dim=1)
    vh = torch.cat([d[1] for d in dec], dim=1)
    return lc, enc, kh, vh, C.nbytes(lc) + C.nbytes(enc)


def test_exact_is_bit_exact():
    k, v = _kv()
    _, _, kh, vh, nb = _roundtrip("exact", k, v)
    assert torch.equal(kh, k) and torch.equal(vh, v)


def test_full_rank_fp32_pca_is_near_exact():
    k, v = _kv(T=256)
    s = C.CodecSettings(k_bits=64, v_bits=64, basis_fmt="fp32", max_bits=8, group_size=0)
    _, _, kh, vh, _ = _roundtrip(s, k, v)
    assert _rel(kh, k) < 1e-4 and _rel(vh, v) < 1e-4


def test_every_side_coder_is_used_by_a_preset_or_the_regenerator():
    modes = {m for s in map(C.settings_for, SETTINGS) for m in (s.k_mode, s.v_mode)}
    assert modes | {C.RegenSide.mode} == set(C.CODERS)   # rpca: tested with a regenerator below


@pytest.mark.parametrize("setting", SETTINGS)
def test_byte_accounting_matches_serialized(setting):
    k, v = _kv(1)
    lc, enc, kh, vh, nb = _roundtrip(setting, k, v)
    ser = C.to_bytes(lc)
    assert len(ser) == C.nbytes(lc)
    total = len(ser)
    lc2 = C.from_bytes(ser, C.LayerCodec)
    for p in enc:
        bk, bv = C.to_bytes(p.k), C.to_bytes(p.v)
        assert len(bk) == C.nbytes(p.k) and len(bv) == C.nbytes(p.v)
        total += len(bk) + len(bv)
        p2 = C.EncodedPart(C.from_bytes(bk), C.from_bytes(bv))
        a, b = C.decode(lc, p), C.decode(lc2, p2)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert total == nb


# relative squared error allowed per setting (keys, values)
TOLERANCE = {
    "exact": (0.0, 0.0), "fp32": (0.0, 0.0), "fp16": (1e-6, 1e-6), "bf16": (1e-4, 1e-4), "fp8": (1e-2, 1e-2),
    "int8": (1e-4, 1e-4), "int4": (2e-2, 2e-2), "int3": (6e-2, 6e-2), "int2": (0.3, 0.3),
    "ratio=2": (1e-2, 1e-2), "ratio=4": (6e-2, 6e-2),
    "ratio=8": (0.25, 0.2),  # 8× gives keys a quarter of the bits: values are the sensitive side
    "ratio=16": (0.5, 0.5), "ratio=32": (0.8, 0.8),
}


def test_every_setting_has_a_tolerance():
    assert set(SETTINGS) <= set(TOLERANCE)


@pytest.mark.parametrize("setting", SETTINGS)
def test_precision_tolerance(setting):
    tol_k, tol_v = TOLERANCE[setting]
    k, v = _kv(2)
    _, _, kh, vh, _ = _roundtrip(setting, k, v)
    assert _rel(kh, k) <= tol_k, _rel(kh, k)
    assert _rel(vh, v) <= tol_v, _rel(vh, v)


@pytest.mark.parametrize("ratio", [4, 8, 16])
def test_ratio_is_met(ratio):
    k, v = _kv(3, T=1024)
    _, _, _, _, nb = _roundtrip(f"ratio={ratio}", k, v, parts=4)
    raw = 2 * k.numel() * 2
    assert raw / nb >= ratio * 0.99, raw / nb


def test_sinks_are_kept_exactly():
    k, v = _kv(4)
    _, _, kh, vh, _ = _roundtrip("ratio=8", k, v)
    assert torch.allclose(kh[:, 0], k[:, 0].half().float()) and torch.allclose(vh[:, 0], v[:, 0].half().float())


def test_batched_pca_matches_eigh():
    X = torch.randn(5, 100, 16)
    mean, ev, U = C.batched_pca(X)
    for i in range(5):
        Xc = (X[i] - X[i].mean(0)).double()
        s = torch.linalg.svdvals(Xc) ** 2 / 100
        assert torch.allclose(ev[i].double(), s, rtol=1e-4, atol=1e-6)
        # orthonormal and diagonalizing
        assert torch.allclose(U[i].T @ U[i], torch.eye(16), atol=1e-5)


def test_settings_for_names():
    assert C.settings_for("exact").k_fmt == "fp32"
    assert C.settings_for("8").name == C.settings_for("ratio=8").name == C.settings_for(8).name
    s = C.settings_for("ratio=6")
    assert s.budget == "state" and s.even_groups   # every byte counted exactly: no margin
    assert math.isclose(s.k_bits + s.v_bits, 32 / 6)
    per_layer = C.at_ratio(C.settings_for(6, budget="layer"), 6)
    assert math.isclose(per_layer.k_bits + per_layer.v_bits, 32 / 6 * RATIO_FILL)
    assert C.settings_for("ratio=8", outliers=3).outliers == 3
    with pytest.raises(ValueError):
        C.settings_for("nonsense")


def test_shape_checks():
    k, v = _kv(T=64)
    lc = C.fit_layer(k, v, "ratio=4")
    with pytest.raises(ValueError):
        C.encode(lc, k[:2], v[:2])
    with pytest.raises(ValueError):
        C.encode(lc, k, v, positions=torch.arange(3))


@pytest.mark.parametrize("fmt,tol", [("int8", 0.02), ("int4", 0.3), ("int3", 0.6), ("int2", 1.6),
                                     ("fp8", 0.3), ("fp16", 2e-3), ("bf16", 0.03), ("fp32", 0)])
@pytest.mark.parametrize("axis", [-1, -2])
def test_quantize_formats(fmt, tol, axis):
    x = torch.randn(3, 100, 64, generator=torch.Generator().manual_seed(5))
    q = quantize(x, fmt, group_size=32, axis=axis)
    y = dequantize(q)
    assert y.shape == x.shape
    assert (y - x).abs().max().item() <= tol
    for mode in ("mse",):
        if fmt.startswith("int") and fmt != "int8":
            y2 = dequantize(quantize(x, fmt, group_size=32, axis=axis, range_mode=mode))
            assert (y2 - x).pow(2).mean() <= (y - x).pow(2).mean() * 1.01


# --- a regenerator's basis (rpca) --------------------------------------------------------------

def _regenerator(seeds=(10, 11, 12)):
    from kite.upcycle.codec.regenerator import RegeneratorFit

    fit = RegeneratorFit(n_layers=1)
    for seed in seeds:
        k, v = _kv(seed)
        fit.add([k], [v])
    return fit.finish({"model_fingerprint": "kite-fp1:test"})


@pytest.mark.parametrize("ratio", [4, 8, 16])
def test_a_regenerator_basis_keeps_the_ratio_and_beats_the_documents_own_at_equal_bytes(ratio):
    """Same distribution as the calibration: the calibrated basis costs no bytes in the state, so the
    bits go to coefficients; the sides it codes store no basis."""
    reg = _regenerator()
    k, v = _kv(2)
    lc_doc, _, kd, vd, nb_doc = _roundtrip(f"ratio={ratio}", k, v)
    s = C.settings_for(f"ratio={ratio}")
    lc = C.fit_layer(k, v, s, regenerator={side: reg.side(0, side) for side in "kv"})
    modes = {lc.meta[side]["mode"] for side in "kv"}
    assert "rpca" in modes
    assert not any(n.startswith(f"{side}.basis") for side in "kv" if lc.meta[side]["mode"] == "rpca"
                   for n in lc.tensors)
    parts = [C.encode(lc, k[:, a:b], v[:, a:b], torch.arange(a, b)) for a, b in ((0, T // 2), (T // 2, T))]
    nb = C.nbytes(lc) + C.nbytes(parts)
    raw = 2 * k.numel() * 2
    assert raw / nb >= ratio * 0.99
    kh = torch.cat([C.decode(lc, p)[0] for p in parts], dim=1)
    vh = torch.cat([C.decode(lc, p)[1] for p in parts], dim=1)
    assert _rel(kh, k) + _rel(vh, v) <= _rel(kd, k) + _rel(vd, v)


def test_an_rpca_side_does_not_decode_without_its_regenerator():
    reg = _regenerator()
    k, v = _kv(2)
    lc = C.fit_layer(k, v, "ratio=8", regenerator={side: reg.side(0, side) for side in "kv"})
    part = C.encode(lc, k, v, torch.arange(T))
    bare = C.from_bytes(C.to_bytes(lc), C.LayerCodec)           # as read back from a state
    with pytest.raises(ValueError, match="regenerator"):
        C.decode(bare, part)
    C.attach_regenerator(bare, {side: reg.side(0, side)[2] for side in "kv"})
    a, b = C.decode(lc, part), C.decode(bare, part)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
