"""Memory-budgeted long context: the budgeted cache, its CLI and server options."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from kite.cli.main import app
from kite.errors import BadInput
from kite.runtime.cache import cache_layers, new_cache
from kite.runtime.generate import forward_tokens, generate
from kite.upcycle import codec as C
from kite.upcycle.budget import (BudgetCache, BudgetSettings, WindowCache, budget_cache, check_budget,
                                 kv_bytes_per_token)
from tests.conftest import parse_json

runner = CliRunner()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm(request, tiny_models):
    from kite.model import load_model

    torch.set_num_threads(1)
    return load_model(str(tiny_models[request.param]), device="cpu")


def _ids(lm, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, lm.geometry.vocab_size, (n,), generator=g).tolist()


def _run(model, ids, cache, chunk=32):
    return torch.cat([forward_tokens(model, ids[s:s + chunk], cache, s) for s in range(0, len(ids), chunk)])


def _budget(lm, tokens, codec="ratio=8", block=32, **kw):
    return BudgetCache(lm.model, BudgetSettings(budget_tokens=tokens, codec=codec, block_tokens=block, **kw))


def test_budget_past_the_document_equals_the_plain_cache(lm):
    ids = _ids(lm, 200)
    full = _run(lm.model, ids, new_cache(lm.model))
    cache = _budget(lm, 300)
    got = _run(lm.model, ids, cache)
    assert torch.equal(full, got)
    st = cache.stats()
    assert st["compressed_tokens"] == 0 and st["raw_tokens"] == 200 and st["ratio_to_raw"] == 1.0


def test_crop_and_beam_reordering_are_refused_with_a_reason(lm):
    from kite.errors import KiteError

    cache = _budget(lm, 100)
    _run(lm.model, _ids(lm, 150), cache)
    with pytest.raises(KiteError, match="cannot be cropped"):
        cache.crop(10)
    for op in (cache.reorder_cache, cache.batch_select_indices, cache.batch_repeat_interleave):
        with pytest.raises(KiteError, match="one sequence"):
            op(torch.tensor([0]))


def test_lossless_codec_matches_the_full_cache_and_keeps_positions(lm):
    """With the exact (fp32) codec every compressed token comes back at its own position: the
    decoded keys equal the full cache's, and the logits match the full cache's."""
    ids = _ids(lm, 300, 1)
    full_cache = new_cache(lm.model)
    full = _run(lm.model, ids, full_cache)
    cache = _budget(lm, 100, codec="exact")
    got = _run(lm.model, ids, cache)
    assert (full - got).abs().max() <= 1e-4
    layer = cache.layers[0]
    assert layer.get_seq_length() == 300 and layer.raw_tokens <= 100
    assert layer.compressed_tokens == 300 - layer.raw_tokens and layer.compressed_tokens % 32 == 0
    k_full, v_full = cache_layers(full_cache)[0]
    dk, dv = (t[None] for t in layer.coded.decoded(torch.float32, "cpu"))
    span = slice(4, 4 + layer.compressed_tokens)  # after the 4 raw sinks
    assert (dk - k_full[..., span, :]).abs().max() <= 1e-4
    assert torch.equal(dv, v_full[..., span, :])
    assert [b.start for b in layer.blocks] == list(range(4, 4 + layer.compressed_tokens, 32))
    assert torch.equal(layer.keys[..., :4, :], k_full[..., :4, :])  # sinks stay raw


def test_lossy_budget_holds_its_budget_and_counts_every_byte(lm):
    ids = _ids(lm, 400, 2)
    full = _run(lm.model, ids, new_cache(lm.model))
    cache = _budget(lm, 100, codec="ratio=8")
    got = _run(lm.model, ids, cache)
    assert torch.isfinite(got).all()
    # lossy, but far closer to the full cache than to nothing
    assert (full.softmax(-1) - got.softmax(-1)).abs().sum(-1).mean() < 0.5
    st = cache.stats()
    layers = cache.layers
    assert st["tokens"] == 400 and st["raw_tokens"] <= 100
    assert st["compressed_bytes"] == sum(len(C.to_bytes(b.part.k)) + len(C.to_bytes(b.part.v))
                                         for lay in layers for b in lay.blocks)
    assert st["codec_bytes"] == sum(len(C.to_bytes(lay.layer_codec)) for lay in layers)
    per_token = kv_bytes_per_token(lm.model.config, 2)
    assert st["raw_bytes"] == st["raw_tokens"] * per_token
    assert st["kv_bytes"] == st["compressed_bytes"] + st["codec_bytes"] + st["raw_bytes"]
    assert st["raw_kv_bytes"] == 400 * per_token and st["kv_bytes"] < st["raw_kv_bytes"]
    assert st["decoded_cache_bytes"] == 0
    assert all(not lay.layer_codec.decoded for lay in layers)  # no fp32 basis left behind


def test_keep_decoded_gives_the_same_logits_and_counts_its_memory(lm):
    ids = _ids(lm, 260, 3)
    a = _run(lm.model, ids, _budget(lm, 100))
    cache = _budget(lm, 100, keep_decoded=True)
    b = _run(lm.model, ids, cache)
    assert torch.equal(a, b)
    assert cache.stats()["decoded_cache_bytes"] > 0


def test_generation_runs_with_a_budget(lm):
    prompt = _ids(lm, 180, 4)
    cache = _budget(lm, 100)
    result = generate(lm, prompt, max_new_tokens=12, stop_ids=set(), cache=cache, prefill_chunk=32)
    assert result.new_tokens == 12
    st = cache.stats()
    assert st["tokens"] == 180 + 11 and st["compressed_tokens"] > 0 and st["raw_tokens"] <= 100
    # chunked prefill with a plain cache changes nothing
    plain = generate(lm, prompt, max_new_tokens=12, stop_ids=set())
    chunked = generate(lm, prompt, max_new_tokens=12, stop_ids=set(), prefill_chunk=32)
    assert plain.text == chunked.text
    assert math.isclose(plain.prompt_nll_bits, chunked.prompt_nll_bits, abs_tol=1e-3)


def test_window_cache_drops_but_keeps_positions(lm):
    ids = _ids(lm, 200, 5)
    full = _run(lm.model, ids, new_cache(lm.model))
    assert torch.equal(_run(lm.model, ids, WindowCache(lm.model, 300)), full)
    w = WindowCache(lm.model, 60)
    got = _run(lm.model, ids, w)
    assert w.stats()["raw_tokens"] == 64 and w.stats()["tokens"] == 200
    assert torch.allclose(got[:64], full[:64], atol=1e-5)  # before anything was dropped


def test_bad_budgets_are_refused(lm):
    with pytest.raises(BadInput, match="at least 36"):
        check_budget(BudgetSettings(budget_tokens=20, block_tokens=32))
    with pytest.raises(BadInput, match="below the model's context of 512"):
        budget_cache(lm, 512)
    with pytest.raises(BadInput, match="unknown codec"):
        check_budget(BudgetSettings(budget_tokens=400, codec="zip"))
    with pytest.raises(BadInput, match="at least 16"):
        check_budget(BudgetSettings(budget_tokens=400, block_tokens=4))
    cache = _budget(lm, 100)
    with pytest.raises(ValueError, match="one sequence"):
        cache.update(torch.zeros(2, 2, 3, 16), torch.zeros(2, 2, 3, 16), 0)


# -- CLI ------------------------------------------------------------------------------------------

def _one_line_error(result, needle):
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and needle in lines[0], result.output


@pytest.mark.parametrize("args,needle", [
    (["--kv-budget-tokens", "10"], "at least 260"),
    (["--kv-budget-tokens", "512"], "below the model's context of 512"),
    (["--kv-budget-tokens", "300", "--upc", "x.upc"], "cannot be combined with --upc"),
    (["--kv-budget-codec", "int4"], "give it too"),
    (["--kv-budget-tokens", "300", "--kv-budget-codec", "zip"], "unknown codec"),
    (["--kv-budget-tokens", "300", "--kv-budget-block", "8"], "at least 16"),
])
def test_cli_bad_budget(tiny_models, args, needle):
    r = runner.invoke(app, ["generate", "-m", str(tiny_models["llama"]), "--prompt", "The parties agree",
                            *args])
    _one_line_error(r, needle)


def test_cli_serve_refuses_budget_settings_without_a_budget(tiny_models, tmp_path):
    """Checked before the rules, the model or the port: one line, exit 2."""
    r = runner.invoke(app, ["serve", "-m", str(tiny_models["llama"]), "--kv-budget-block", "64",
                            "--state-dir", str(tmp_path)])
    _one_line_error(r, "give it too")


def test_cli_generate_with_a_budget_reports_bytes(tiny_models):
    prompt = "The parties agree that the supplier shall deliver the goods. " * 18
    r = runner.invoke(app, ["generate", "-m", str(tiny_models["llama"]), "--prompt", prompt, "--max-new-tokens",
                            "4", "--kv-budget-tokens", "100", "--kv-budget-block", "32", "--json"])
    assert r.exit_code == 0, r.output
    out = parse_json(r.output)
    kb = out["kv_budget"]
    assert kb["budget_tokens"] == 100 and kb["codec"] == "ratio=8" and kb["compressed_tokens"] > 0
    assert kb["kv_bytes"] < kb["raw_kv_bytes"] and 0 < kb["ratio_to_raw"] < 1
    r = runner.invoke(app, ["generate", "-m", str(tiny_models["llama"]), "--prompt", "x", "--json"])
    assert r.exit_code == 0 and parse_json(r.output)["kv_budget"] is None


# -- server ---------------------------------------------------------------------------------------

def test_serve_settings_check_the_budget(tmp_path):
    from kite.serve import ServeSettings

    with pytest.raises(BadInput, match="at least 260"):
        ServeSettings(state_dir=tmp_path, rules_path=tmp_path / "r.yaml", kv_budget_tokens=100)
    s = ServeSettings(state_dir=tmp_path, rules_path=tmp_path / "r.yaml", kv_budget_tokens=100, kv_budget_block=32)
    assert s.budget_settings().budget_tokens == 100
    with pytest.raises(BadInput, match="below the model's context"):
        s.budget_settings(context_length=64)
    assert ServeSettings(state_dir=tmp_path, rules_path=tmp_path / "r.yaml").budget_settings() is None


def test_server_completions_with_a_budget_decode_together(lm, tmp_path):
    """Three budgeted completions at once: they share the batch, each its older tokens coded, and
    each gets what generate() gives it with a BudgetCache alone (text and budget report)."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from kite.serve import ServeSettings, create_app
    from kite.upcycle import open_pipeline

    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: default\n    condition: true\n    action:\n      load_all_clusters: true\n")
    settings = ServeSettings(state_dir=tmp_path / "states", rules_path=rules, kv_budget_tokens=100,
                             kv_budget_block=32)
    prompts = [f"Clause {i}: the parties agree that the supplier shall deliver the goods. " * (8 + 2 * i)
               for i in range(3)]
    alone = []
    for p in prompts:
        cache = BudgetCache(lm.model, settings.budget_settings())
        ids = lm.tokenizer(p)["input_ids"]
        alone.append((generate(lm, ids, cache=cache, prefill_chunk=32, max_new_tokens=6), cache.stats()))
    with TestClient(create_app(open_pipeline(lm=lm, tagger=False), settings)) as client:
        def ask(p):
            return client.post("/v1/completions", json={"prompt": p, "max_tokens": 6})
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(ask, prompts))
    for r, (want, want_stats) in zip(replies, alone):
        assert r.status_code == 200, r.text
        body = r.json()
        kb = body["kite"]["kv_budget"]
        assert kb["applied"] is True and kb["batched"] is True
        assert kb["compressed_tokens"] > 0 and kb["kv_bytes"] < kb["raw_kv_bytes"]
        assert (kb["tokens"], kb["compressed_tokens"], kb["kv_bytes"]) == (
            want_stats["tokens"], want_stats["compressed_tokens"], want_stats["kv_bytes"])
        assert body["choices"][0]["text"] == want.text


@pytest.mark.slow
def test_embedded_budget_costs_little_ppl(embedded):
    """GPL-3's first 768 tokens on SmolLM2 with 260 raw tokens and ratio=8 blocks: PPL within 2%."""
    torch.set_num_threads(1)
    text = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()
    ids = embedded.tokenizer(text, add_special_tokens=False)["input_ids"][:768]
    targets = torch.tensor(ids[1:])

    def ppl(cache):
        logits = _run(embedded.model, ids, cache, chunk=128)[:-1]
        return float(torch.exp(torch.nn.functional.cross_entropy(logits, targets)))

    full = ppl(new_cache(embedded.model))
    cache = budget_cache(embedded, 260, codec="ratio=8", block_tokens=128)
    got = ppl(cache)
    st = cache.stats()
    assert st["compressed_tokens"] >= 512 and st["ratio_to_raw"] < 0.55
    assert got <= full * 1.02, (full, got)
