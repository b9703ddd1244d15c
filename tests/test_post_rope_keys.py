"""kite.upcycle.key_coding codes keys pre- and post-RoPE with the codec's own functions: both
paths must give back the keys the model's cache holds (post-RoPE: as decoded; pre-RoPE: after RoPE)."""

from __future__ import annotations

import pytest
import torch

from kite.upcycle.study import coded_keys, variance_fractions
from kite.runtime.cache import cache_layers, new_cache
from kite.runtime.generate import forward_tokens
from kite.upcycle import codec, rope_cos_sin, tokenize_document
from kite.upcycle.capture import capture
from tests.tiny_models import CORPUS


@pytest.fixture(scope="module")
def tiny_cache(tiny_models):
    from kite.model import load_model

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    ids, _ = tokenize_document(lm.tokenizer, CORPUS)
    ids = ids[:300]
    with torch.inference_mode():
        cache = new_cache(lm.model)
        forward_tokens(lm.model, ids, cache, 0)
        cached_keys = [k[0].float().clone() for k, _ in cache_layers(cache)]
        cap = capture(lm, "", ids=ids)
    cos, sin = rope_cos_sin(lm.model, torch.arange(len(ids)))
    return cap, cached_keys, cos, sin


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("where", ["pre", "post", "post_rmean"])
def test_exact_codec_gives_back_the_cache_keys(tiny_cache, where, one_thread):
    cap, cached, cos, sin = tiny_cache
    keys, values, _ = coded_keys(cap.keys_pre, cap.values, cos, sin, codec.settings_for("exact"), where, 64)
    for k, c, v, v0 in zip(keys, cached, values, cap.values):
        assert (k - c).abs().max() < 1e-5
        assert torch.equal(v, v0)


@pytest.mark.parametrize("where", ["pre", "post", "post_rmean"])
def test_high_bit_pca_round_trips_to_the_cache_keys(tiny_cache, where, one_thread):
    """Every component at 8 bits, min-max ranges, fp32 basis: the per-head PCA path (the one the
    benchmark measures) leaves the keys attention reads within 1 % of the cache's."""
    cap, cached, cos, sin = tiny_cache
    s = codec.settings_for(2, joint_heads=False, k_bits=16, v_bits=16, basis_fmt="fp32", range_mode="minmax",
                           group_size=64)
    keys, _, _ = coded_keys(cap.keys_pre, cap.values, cos, sin, s, where, 64)
    for k, c in zip(keys, cached):
        assert _rel(k, c) < 0.01


def test_pre_and_post_states_cost_the_same_bytes(tiny_cache, one_thread):
    cap, _, cos, sin = tiny_cache
    s = codec.settings_for(4, joint_heads=False)
    got = {w: coded_keys(cap.keys_pre, cap.values, cos, sin, s, w, 64)[2] for w in ("pre", "post", "post_rmean")}
    assert abs(got["post"] / got["pre"] - 1) < 0.01
    assert abs(got["post_rmean"] / got["pre"] - 1) < 0.01


def test_variance_fractions_grow_to_one():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 200, 16, generator=g) * torch.linspace(3, 0.1, 16) + 5
    f = variance_fractions(keys, [1, 4, 16])
    assert 0 < f["top1"] < f["top4"] < f["top16"] == pytest.approx(1.0)
    assert 0.5 < f["mean_energy_share"] < 1
