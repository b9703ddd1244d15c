"""The nibble-lanes form on tiny random tensors: its lane allocation and encoder (kite.upcycle.codec.lanes),
its decoder, the torch reference of its attention, stacking and byte accounting."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

from kite.kernels import lanes as L
from kite.upcycle.codec import lanes as E


def _kv(H: int = 2, T: int = 300, d: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values with a falling spectrum and an offset (as real heads have)."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(H, d, d, generator=g) * (0.8 ** torch.arange(d))[None, :, None]
    k = torch.randn(H, T, d, generator=g) @ A + 2.0
    v = torch.randn(H, T, d, generator=g) @ A - 1.0
    return k, v


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# allocate_lanes

@pytest.mark.parametrize("lanes", [1, 5, 16, 31, 32])
def test_allocation_spends_exactly_the_lanes_at_most_two_a_component(lanes):
    var = torch.rand(3, 16, generator=torch.Generator().manual_seed(lanes)) * 10
    n = E.allocate_lanes(var, lanes)
    assert n.shape == (3, 16) and n.dtype == torch.int64
    assert (n.sum(-1) == lanes).all()
    assert n.min() >= 0 and n.max() <= E.MAX_LANES


def test_allocation_gives_more_lanes_to_more_variance():
    var = torch.tensor([[0.01, 100.0, 1.0, 10.0, 0.1, 1000.0]])
    n = E.allocate_lanes(var, 5)[0]
    order = var[0].argsort(descending=True)
    assert (n[order][:-1] >= n[order][1:]).all(), n     # non-increasing along falling variance
    assert n[5] == 2 and n[0] == 0


def test_allocation_fills_the_top_components_once_before_any_second_lane():
    """A first lane takes ~256x the error a second one does: equal variances get one lane each first."""
    n = E.allocate_lanes(torch.ones(1, 8), 8)[0]
    assert (n == 1).all()
    n = E.allocate_lanes(torch.ones(1, 8), 12)[0]
    assert sorted(n.tolist()) == [1, 1, 1, 1, 2, 2, 2, 2]


@pytest.mark.parametrize("lanes", [0, -2, 33])
def test_allocation_refuses_lanes_out_of_range(lanes):
    with pytest.raises(ValueError, match="lanes must be in 1..32"):
        E.allocate_lanes(torch.ones(16), lanes)


# encode / decode

def test_encode_shapes_follow_the_layout():
    k, v = _kv(H=2, T=300, d=16)
    x = E.encode(k, v, 16, 8, group=64, sinks=2)
    assert x.states == 1 and x.rows == 320 and x.group == 64          # 298 coded rows padded to 5 groups
    assert x.k_codes.shape == (1, 2, 320, 8) and x.k_codes.dtype == torch.uint8
    assert x.v_codes.shape == (1, 2, 5, 4, 64)                         # lane-major within each group
    # rows in quad order (0, 2, 1, 3 of each four): row 70 is group 1's row 6, stored 5th
    assert L.quad_order(8).tolist() == [0, 2, 1, 3, 4, 6, 5, 7] and L.quad_order(6).tolist() == [0, 2, 1, 3, 4, 5]
    assert torch.equal(L.row_codes(x, "v")[0, 1, 70], x.v_codes[0, 1, 1, :, 5])
    assert torch.equal(L.row_codes(x, "v")[0, 1, 68], x.v_codes[0, 1, 1, :, 4])
    assert x.k_weight.shape == (1, 2, 5, 16) and x.v_weight.shape == (1, 2, 5, 8)
    assert x.k_const.shape == (1, 2, 5, 16) and x.k_basis.shape == (1, 2, 16, 16) and x.v_basis.shape == (1, 2, 8, 16)
    assert x.length.tolist() == [298] and x.raw_k.shape == (1, 2, 2, 16)
    assert L.decode(x, "k").shape == (1, 2, 2 + 320, 16)


@pytest.mark.parametrize("clip", E.CLIPS)
def test_round_trip_error_falls_with_more_lanes(clip):
    k, v = _kv(T=400, d=16)
    errs = []
    for lanes in (4, 8, 16, 32):
        x = E.encode(k, v, lanes, group=128, clip=clip)
        n = 1 + int(x.length[0])
        errs.append((_rel(L.decode(x, "k")[0, :, :n], k), _rel(L.decode(x, "v")[0, :, :n], v)))
    for side in range(2):
        e = [x[side] for x in errs]
        assert all(a > b for a, b in zip(e, e[1:])), e
    assert errs[-1][0] < 0.01 and errs[-1][1] < 0.01                       # 8 bits a component


def test_lanes_of_the_full_rank_at_8_bits_round_trip_within_half_a_step():
    """2d lanes (every component at 8 bits, min/max ranges): each coefficient within half its step,
    so a row within half the sum of its group's steps (the basis is orthonormal)."""
    k, v = _kv(T=256, d=8)
    x = E.encode(k, v, 16, group=64, sinks=1, clip="minmax")
    assert (E.allocate_lanes(torch.ones(8), 16) == 2).all()
    err = (L.decode(x, "k")[0, :, 1:256] - k[:, 1:]).abs().amax(-1)            # [H, 255]
    steps = x.k_weight[0][..., :8]                                             # low nibbles: the steps [H, G, 8]
    bound = 0.5 * steps.sum(-1).repeat_interleave(64, dim=1)[:, :255]
    assert (err <= bound + 1e-5).all()
    assert _rel(L.decode(x, "k")[0, :, :256], k) < 5e-3


def test_sinks_stay_exact():
    k, v = _kv(T=100)
    x = E.encode(k, v, 8, group=32, sinks=3)
    assert torch.equal(x.raw_k[0], k[:, :3]) and torch.equal(x.raw_v[0], v[:, :3])
    assert torch.equal(L.decode(x, "k")[0, :, :3], k[:, :3])
    assert x.length.tolist() == [97]


def test_a_state_of_only_sinks_decodes_to_finite_rows():
    k, v = _kv(T=1)
    x = E.encode(k, v, 8, group=32, sinks=1)
    assert x.length.tolist() == [0]
    assert torch.isfinite(L.decode(x, "k")).all() and torch.isfinite(L.decode(x, "v")).all()
    out, lse = L.lanes_partial(torch.randn(1, 4, 16), x, 0.25)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_padding_rows_code_zero_and_decode_to_their_groups_constant():
    k, v = _kv(T=100)
    x = E.encode(k, v, 8, group=64, sinks=1)               # 99 coded rows in 2 groups of 64
    assert (x.k_codes[0, :, 99:] == 0).all() and (L.row_codes(x, "v")[0, :, 99:] == 0).all()
    assert torch.allclose(L.decode(x, "k")[0, :, 1 + 99:], x.k_const[0, :, 1:2].expand(-1, 128 - 99, -1))


def test_nibble_packing_low_lane_in_the_low_nibble():
    """byte c holds lane c (low nibble) and lane R/2 + c (high): unpacking and weighting by hand
    rebuilds decode's rows."""
    k, v = _kv(T=64, d=8)
    x = E.encode(k, v, 8, group=64, sinks=0)
    codes = x.k_codes[0].long()                                              # [H, 64, 4]
    nib = torch.cat((codes & 15, codes >> 4), dim=-1).float()               # [H, 64, 8]: lane order
    rows = (nib * x.k_weight[0][:, 0][:, None, :]) @ x.k_basis[0] + x.k_const[0][:, 0][:, None, :]
    assert torch.allclose(rows, L.decode(x, "k")[0], atol=1e-5)
    order = torch.tensor([0, 2, 1, 3] * 16) + torch.arange(64) // 4 * 4    # rows stored 0, 2, 1, 3 of each four
    vcodes = x.v_codes[0, :, 0][..., order].transpose(-1, -2).long()       # [H, 64 rows, 4]: the group's lanes
    nib = torch.cat((vcodes & 15, vcodes >> 4), dim=-1).float()
    rows = (nib * x.v_weight[0][:, 0][:, None, :]) @ x.v_basis[0] + x.v_const[0][:, 0][:, None, :]
    assert torch.allclose(rows, L.decode(x, "v")[0], atol=1e-5)


def test_mse_clipping_never_raises_the_squared_error_of_heavy_tails():
    """Student-t coefficients (rare large ones): the clipped grid codes them with less error."""
    g = torch.Generator().manual_seed(3)
    H, T, d = 2, 512, 16
    k = torch.distributions.StudentT(2.5).sample((H, T, d)) * torch.linspace(4, 0.5, d)
    v = torch.randn(H, T, d, generator=g)
    err = {}
    for clip in E.CLIPS:
        x = E.encode(k, v, 16, group=128, sinks=0, clip=clip)
        err[clip] = _rel(L.decode(x, "k")[0, :, :T], k)
    assert err["mse"] < err["minmax"], err


@pytest.mark.parametrize("kw,match", [
    ({"k_lanes": 12}, "k_lanes must be a power of 2"),
    ({"k_lanes": 1}, "k_lanes must be a power of 2"),
    ({"k_lanes": 64}, "k_lanes must be a power of 2 in 2..32"),
    ({"k_lanes": 8, "v_lanes": 6}, "v_lanes must be a power of 2"),
    ({"k_lanes": 8, "group": 0}, "group must be >= 1"),
    ({"k_lanes": 8, "clip": "p99"}, "clip must be one of"),
])
def test_encode_refuses_bad_settings(kw, match):
    k, v = _kv(T=20)
    with pytest.raises(ValueError, match=match):
        E.encode(k, v, **kw)


def test_decode_refuses_an_unknown_side():
    k, v = _kv(T=20)
    with pytest.raises(ValueError, match="side must be"):
        L.decode(E.encode(k, v, 8, group=8), "q")


# attention over stacked states

def test_partial_masks_each_states_padding_rows():
    """States of different lengths stacked: each query attends to its own coded rows only, as plain
    attention over the decoded rows truncated to that state's length."""
    H, d, group = 2, 16, 32
    xs = [E.encode(*_kv(H=H, T=T, d=d, seed=T), 8, 16, group=group, sinks=1) for T in (130, 40, 97)]
    x = L.stack(xs)
    assert x.length.tolist() == [129, 39, 96] and x.rows == 160
    q = torch.randn(3, 2 * H, d, generator=torch.Generator().manual_seed(5)) * 3
    scale = 1 / math.sqrt(d)
    out, lse = L.lanes_partial_torch(q, x, scale)
    for n, one in enumerate(xs):
        T = int(one.length[0])
        k, v = L.decode(one, "k")[0, :, 1:1 + T], L.decode(one, "v")[0, :, 1:1 + T]   # [H, T, d]
        qh = q[n].view(H, 2, d)
        s = qh @ k.transpose(-1, -2) * scale
        want = torch.softmax(s, -1) @ v
        assert torch.allclose(out[n], want.reshape(2 * H, d), atol=1e-5)
        assert torch.allclose(lse[n], torch.logsumexp(s, -1).reshape(2 * H), atol=1e-5)


def test_stacked_states_decode_as_they_did_alone():
    xs = [E.encode(*_kv(T=T, seed=T), 8, group=32, sinks=1) for T in (70, 200)]
    x = L.stack(xs)
    for n, one in enumerate(xs):
        rows = 1 + int(one.length[0])
        for side in "kv":
            assert torch.allclose(L.decode(x, side)[n, :, :rows], L.decode(one, side)[0, :, :rows])


def test_stack_refuses_what_it_cannot_stack():
    k, v = _kv(T=64)
    with pytest.raises(ValueError, match="nothing to stack"):
        L.stack([])
    with pytest.raises(ValueError, match="different group sizes"):
        L.stack([E.encode(k, v, 8, group=32), E.encode(k, v, 8, group=16)])
    with pytest.raises(ValueError, match="different numbers of sinks"):
        L.stack([E.encode(k, v, 8, group=32, sinks=1), E.encode(k, v, 8, group=32, sinks=2)])


# bytes

def test_nbytes_counts_codes_tables_bases_and_sinks():
    H, T, d, group, S = 2, 300, 16, 64, 2
    k, v = _kv(H=H, T=T, d=d)
    x = E.encode(k, v, 16, 8, group=group, sinks=S)
    G = 5
    codes = H * G * group * (16 + 8) // 2
    tables = H * G * ((16 + 8) + 2 * d) * 4
    bases = H * (16 + 8) * d * 2
    sinks = 2 * H * S * d * 2
    assert x.nbytes() == codes + tables + bases + sinks
    assert x.nbytes(basis_bytes=4, table_bytes=2) == codes + tables // 2 + 2 * bases + sinks
    # stacking adds the states' bytes (plus the padding of the shorter one)
    y = E.encode(k[:, :100], v[:, :100], 16, 8, group=group, sinks=S)
    assert L.stack([x, y]).nbytes() == x.nbytes() + y.nbytes() + H * (G - 2) * group * 12 + H * (G - 2) * (24 + 32) * 4


def test_four_bits_an_element_is_about_a_quarter_of_bf16_on_long_states():
    H, T, d = 1, 4096, 16
    k, v = _kv(H=H, T=T, d=d)
    x = E.encode(k, v, d, group=512)
    raw = 2 * H * T * d * 2
    assert 3.5 < raw / x.nbytes() < 4.0


@pytest.mark.parametrize("T,H,d,rk,rv,group,sinks", [(300, 2, 16, 16, 8, 64, 2), (1000, 3, 64, 64, 32, 512, 1),
                                                      (5, 1, 8, 8, 8, 64, 9), (64, 2, 16, 32, 32, 64, 0)])
def test_nbytes_for_is_what_encode_makes(T, H, d, rk, rv, group, sinks):
    """capacity-plan sizes states in lanes by arithmetic: the bytes encode's form holds (bf16 bases)."""
    k, v = _kv(H=H, T=T, d=d)
    x = E.encode(k, v, rk, rv, group=group, sinks=sinks)
    assert E.nbytes_for(T, H, d, rk, rv, group, sinks) == x.nbytes()


def test_encode_layers_is_encode_of_each_layer():
    """One batched eigensolver call for every layer and side (the load path) gives each layer exactly
    what encoding it alone gives; layers of their own lengths; lists that do not pair are refused."""
    layers = [_kv(H=2, T=T, d=16, seed=T) for T in (130, 70, 1)]
    together = E.encode_layers([k for k, _ in layers], [v for _, v in layers], 16, 8, group=32, sinks=2)
    for (k, v), got in zip(layers, together):
        want = E.encode(k, v, 16, 8, group=32, sinks=2)
        for f in fields(L.Lanes):
            a, b = getattr(got, f.name), getattr(want, f.name)
            assert torch.equal(a, b) if torch.is_tensor(a) else a == b, f.name
    with pytest.raises(ValueError, match="2 layers of keys and 1 of values"):
        E.encode_layers([layers[0][0], layers[1][0]], [layers[0][1]], 8)


def test_a_lanes_prefix_counts_its_tokens_per_layer_as_its_decode_holds_them():
    """Layers of different lengths and one that holds nothing: the counts are what ``as_kv`` decodes
    (asked at every sequence's end in a batch, so kept; a caller's copy cannot change them)."""
    from kite.runtime.cache import KVPrefix
    from kite.upcycle import lanes_of

    kvs = [_kv(T=t, seed=t) for t in (300, 70)]
    empty = torch.zeros(2, 0, 16)
    prefix = KVPrefix([kvs[0][0], empty, kvs[1][0]], [kvs[0][1], empty, kvs[1][1]], 300)
    held = lanes_of(prefix, 16, "cpu", group=64)
    assert held.tokens_per_layer() == [300, 0, 70] == [k.shape[1] for k in held.as_kv().keys]
    held.tokens_per_layer().append(5)
    assert held.tokens_per_layer() == [300, 0, 70] and held.holds(2) and not held.holds(1)
