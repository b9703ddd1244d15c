"""The regenerator's per-side choice measured on the model: captured queries, the attention probe,
weighted regenerators from `kite upcycle train`'s calibration, and states coded with them."""

from __future__ import annotations

import re

import pytest
import torch

from kite.upcycle.capture import capture
from kite.upcycle.codec import weights as W
from kite.upcycle.codec.probe import AttentionProbe
from kite.upcycle.codec.regenerator import RegeneratorFit
from tests.tiny_models import CORPUS


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm(request, tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models[request.param]), device="cpu")


def _o_proj_inputs(lm, ids):
    """Each layer's attention output before o_proj, and after, for a plain forward of ``ids``."""
    got: dict[int, tuple] = {}
    hooks = []
    for name, module in lm.model.named_modules():
        m = re.search(r"layers\.(\d+)\.self_attn\.o_proj$", name)
        if m:
            hooks.append(module.register_forward_hook(
                lambda mod, inp, out, layer=int(m.group(1)): got.__setitem__(layer, (inp[0][0], out[0]))))
    with torch.inference_mode():
        lm.model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return got


def test_captured_queries_do_not_depend_on_the_chunking_and_sum_to_their_squares(lm):
    whole = capture(lm, CORPUS, queries=True, query_rows=20)
    chunked = capture(lm, CORPUS, chunk_tokens=7, queries=True, query_rows=20)
    n_q, d = lm.model.config.num_attention_heads, lm.geometry.head_dim
    assert len(whole.query_tail) == lm.geometry.n_layers
    for a, b, sa, sb in zip(whole.query_tail, chunked.query_tail, whole.query_sq, chunked.query_sq):
        assert a.shape == (20, n_q * d)
        assert torch.allclose(a, b, atol=1e-5)
        assert torch.allclose(sa, sb, rtol=1e-5)
    assert capture(lm, CORPUS).query_tail == [] and capture(lm, CORPUS).query_sq == []


def test_the_probe_reproduces_the_models_attention_output_and_prices_a_change(lm):
    """The probe's attention of the last rows over the captured pre-RoPE keys and values is the
    model's own o_proj output for those tokens (RoPE, GQA, scaling and the causal mask as the model
    has them); a side decoded exactly costs nothing, a perturbed one costs more as it grows."""
    rows = 24
    cap = capture(lm, CORPUS, query_rows=rows)
    probe = AttentionProbe(lm, cap.query_tail, cap.n_tokens)
    model_out = _o_proj_inputs(lm, cap.ids)
    for layer in range(lm.geometry.n_layers):
        K, V = cap.keys_pre[layer], cap.values[layer]
        from kite.upcycle.rope import apply_rope

        mine = probe._out(layer, apply_rope(K, probe.cos, probe.sin), V)
        want = model_out[layer][1][-rows:]
        assert torch.allclose(mine, want, atol=1e-4 * float(want.abs().max()) + 1e-5), layer
        cost = probe.metric(layer, K, V)
        assert cost("k", K, K) == 0.0 and cost("v", V, V) == 0.0
        g = torch.Generator().manual_seed(layer)
        noise = torch.randn(K.shape, generator=g)
        small, large = cost("v", V, V + 0.01 * noise), cost("v", V, V + 0.1 * noise)
        assert 0 < small < large
        assert cost("k", K, K + 0.1 * noise) > 0


def test_a_spread_probe_reads_rows_from_the_whole_document_at_their_positions(lm):
    from kite.upcycle.rope import apply_rope

    cap = capture(lm, CORPUS, query_rows=10_000)                     # every token's queries
    assert cap.query_tail[0].shape[0] == cap.n_tokens
    probe = AttentionProbe(lm, cap.query_tail, cap.n_tokens, spread=9)
    assert probe.rows == 9
    rows = torch.linspace(0, cap.n_tokens - 1, 9).round().long()
    model_out = _o_proj_inputs(lm, cap.ids)
    for layer in range(lm.geometry.n_layers):
        K, V = cap.keys_pre[layer], cap.values[layer]
        want = model_out[layer][1][rows]
        mine = probe._out(layer, apply_rope(K, probe.cos, probe.sin), V)
        assert torch.allclose(mine, want, atol=1e-4 * float(want.abs().max()) + 1e-5), layer


def test_kite_upcycle_trains_a_weighted_regenerator_and_its_probe_chosen_states_load(lm, tmp_path):
    from kite.upcycle import CompressSettings, codec_settings, compress_document, load_prefix
    from kite.upcycle.format import StateFile
    from kite.upcycle.train.data import Pair
    from kite.upcycle.train.run import fit_regenerator

    words = CORPUS.split()
    pairs = [Pair(context=" ".join(words[i * 9:i * 9 + 150]), prompt="Q", response=" A", line=i + 1) for i in range(3)]
    assert not fit_regenerator(lm, pairs[:1], codec_settings(8)).weighted      # the default
    reg = fit_regenerator(lm, pairs, codec_settings(8), weighted=True)
    assert reg.weighted and reg.meta["version"] == 2
    geo = lm.geometry
    for layer in range(geo.n_layers):
        for side in "kv":
            w = reg.weights(layer)[side]
            assert w.shape == (1, geo.n_kv_heads * geo.head_dim) and bool((w > 0).all())
    # the key weights: the RoPE pairs of a head share one weight
    wk = reg.weights(0)["k"].reshape(geo.n_kv_heads, geo.head_dim)
    assert torch.equal(wk[:, :geo.head_dim // 2], wk[:, geo.head_dim // 2:])
    assert torch.allclose(reg.weights(1)["v"], W.as_blocks(W.model_value_weights(lm)[1], True).half().float())
    text = CORPUS.replace(". ", ".\n\n", 5)
    settings = CompressSettings(codec=codec_settings(8), n_clusters=3, min_span_tokens=8, max_span_tokens=24)
    for choice in ("probe", None):
        reg.choice = choice
        made = compress_document(lm, text, tmp_path / f"{choice}.upc", settings, regenerator=reg)
        with StateFile(made.path) as sf:
            assert sf.meta["regenerator"]["fingerprint"] == reg.fingerprint
        prefix, _ = load_prefix(made.path, lm, regenerator=reg)
        full = capture(lm, text)
        err = sum(float((a - b).pow(2).sum()) for a, b in zip(prefix.values, full.values))
        assert err < 0.5 * sum(float(b.pow(2).sum()) for b in full.values)
    reg.choice = "probe"
    with pytest.raises(ValueError, match="probe"):
        reg.layer(0)


def test_a_fit_with_queries_of_some_documents_only_is_unweighted():
    fit = RegeneratorFit(n_layers=1)
    x = torch.randn(2, 40, 8)
    fit.add([x], [x], query_sq=[torch.ones(4 * 8)])
    fit.add([x], [x])
    assert not fit.finish({"model_fingerprint": "kite-fp1:t"}, value_weights=[torch.ones(2, 8)]).weighted
