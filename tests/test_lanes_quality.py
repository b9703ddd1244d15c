"""kite.upcycle.lanes_study (benchmarks/lanes_quality.py): its lanes variants and the prefix it
builds from a document's layers (tiny random tensors in place of the embedded model's)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kite.kernels import lanes as L
from kite.upcycle.codec import lanes as E
from kite.upcycle.study import lanes_cells, lanes_prefix, lanes_variants, worst_first


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
    one = E.encode(keys[0], values[0], 32, 16, group=64)
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
    first = E.encode(k, v, 8, 8, group=64, sinks=1)
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


def test_lanes_cells_code_the_given_kv_in_lanes_when_given_and_the_documents_otherwise():
    g = torch.Generator().manual_seed(2)
    keys = [torch.randn(2, 100, 16, generator=g) for _ in range(2)]
    values = [torch.randn(2, 100, 16, generator=g) for _ in range(2)]
    other_k = [k + 0.3 * torch.randn(k.shape, generator=g) for k in keys]          # a codec's decoded KV
    other_v = [v + 0.3 * torch.randn(v.shape, generator=g) for v in values]
    seen = []

    def score(k, v):
        seen.append((k, v))
        return {"ppl_other": 2.0, "ppl_full": 1.5, "kl_mean": 0.1, "kl_median": 0.05, "kl_max": 1.0, "top1": 0.9}

    doc = SimpleNamespace(keys_post=keys, cap=SimpleNamespace(values=values), raw_bytes=10_000, score=score)
    variants = lanes_variants(16, 4, [64], ["minmax"], [], [4])
    plain = lanes_cells(doc, variants)
    on_top = lanes_cells(doc, variants, other_k, other_v, prefix="joint+")
    assert list(plain) == ["lanes_g64_minmax", "lanes_g64_minmax_s4"]
    assert list(on_top) == ["joint+lanes_g64_minmax", "joint+lanes_g64_minmax_s4"]
    # the lanes of the given KV keep its sinks exact, not the document's
    k_top = seen[3][0]
    assert torch.equal(k_top[0][:, :4], other_k[0][:, :4]) and not torch.equal(k_top[0][:, :4], keys[0][:, :4])
    assert torch.equal(seen[1][0][0][:, :4], keys[0][:, :4])
    c = on_top["joint+lanes_g64_minmax"]
    assert c["ppl_delta"] == 0.5 and c["state_bytes"] == plain["lanes_g64_minmax"]["state_bytes"]
    # errors against the document's KV include the codec's; the lanes' own are against the given KV
    assert c["key_rel_error_mean"] > 2 * c["lanes_key_rel_error_mean"] > 0
    assert "lanes_key_rel_error_mean" not in plain["lanes_g64_minmax"]
