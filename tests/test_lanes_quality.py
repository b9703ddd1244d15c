"""benchmarks/lanes_quality.py: its lanes variants and the prefix it builds from a document's layers
(tiny random tensors in place of the embedded model's)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from benchmarks.lanes_quality import lanes_prefix, lanes_variants, worst_first
from kite.kernels import lanes as L


def test_lanes_variants_spend_4d_over_r_lanes_a_row():
    v = lanes_variants(64, 4, [128, 256], ["minmax", "mse"], [256], [16], worst=[8])
    assert [x[0] for x in v] == ["lanes_g128_minmax", "lanes_g128_mse", "lanes_g256_minmax", "lanes_g256_mse",
                                 "lanes_k32v64_g256_minmax", "lanes_k64v32_g256_minmax", "lanes_g128_minmax_s16",
                                 "lanes_g128_minmax_w8"]
    assert v[0][1:] == (64, 64, 128, "minmax", 1, False) and v[-2][1:] == (64, 64, 128, "minmax", 16, False)
    assert v[-1][1:] == (64, 64, 128, "minmax", 8, True)
    assert {x[1:3] for x in lanes_variants(64, 8, [512], ["mse"], [])} == {(32, 32)}


def test_lanes_prefix_gives_every_layer_back_at_its_length_with_its_bytes():
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(2, 150, 16, generator=g) for _ in range(3)]
    values = [torch.randn(2, 150, 16, generator=g) for _ in range(3)]
    doc = SimpleNamespace(keys_post=keys, cap=SimpleNamespace(values=values))
    k, v, b = lanes_prefix(doc, 32, 16, 64, "minmax")
    assert [t.shape for t in k + v] == [(2, 150, 16)] * 6
    for a, want in zip(k, keys):
        assert torch.equal(a[:, 0], want[:, 0])                                       # the sink
        assert float((a - want).norm() / want.norm()) < 0.01                          # 8 bits a component
    one = L.encode(keys[0], values[0], 32, 16, group=64)
    assert b["state_bytes"] == 3 * one.nbytes()
    # 32 key lanes on 16 components: every component has 2 lanes, so half the key basis rows repeat
    assert b["state_bytes"] - b["state_bytes_unique_basis"] == 3 * 2 * 16 * 16 * 2
    assert b["state_bytes_fp16_tables"] < b["state_bytes"]


def test_worst_first_keeps_token_0_and_the_worst_coded_tokens_exact_in_document_order():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 200, 16, generator=g)
    v = torch.randn(2, 200, 16, generator=g)
    order = worst_first(k, v, 8, 8, 64, "minmax", 4)
    assert order.shape == (2, 200) and (order.sort(dim=1).values == torch.arange(200)).all()
    assert (order[:, 0] == 0).all() and (order[:, 4:].diff(dim=1) > 0).all()      # the rest in document order
    first = L.encode(k, v, 8, 8, group=64, sinks=1)
    err = sum((L.decode(first, s)[0, :, :200] - t).pow(2).sum(-1) / t.pow(2).sum(-1).mean(-1, keepdim=True)
              for s, t in (("k", k), ("v", v)))
    for h in range(2):
        assert err[h, order[h, 1:4]].min() >= err[h, order[h, 4:]].max()
    order = worst_first(k, v, 16, 16, 64, "minmax", 4)
    doc = SimpleNamespace(keys_post=[k], cap=SimpleNamespace(values=[v]))
    keys, values, _ = lanes_prefix(doc, 16, 16, 64, "minmax", sinks=4, worst=True)
    for h in range(2):
        for t in order[h, :4].tolist():
            assert torch.equal(keys[0][h, t], k[h, t]) and torch.equal(values[0][h, t], v[h, t])
    assert float((keys[0] - k).norm() / k.norm()) < 0.15                                # the rest: coded, in place
