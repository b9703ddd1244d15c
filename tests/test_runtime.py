"""The runtime: KITE's attention equals sdpa; per-layer prefixes keep positions; generation."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from kite.cli.main import app
from kite.runtime.cache import KVPrefix, cache_layers, new_cache
from kite.runtime.generate import cache_kwarg, encode_prompt, forward_tokens, generate
from tests.conftest import parse_json

runner = CliRunner()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm(request, tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models[request.param]), device="cpu")


def _ids(lm, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, lm.geometry.vocab_size, (n,), generator=g).tolist()


def test_kite_attention_matches_sdpa(lm):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(lm.folder, attn_implementation="sdpa").eval()
    ids = torch.tensor([_ids(lm, 40)])
    with torch.no_grad():
        assert torch.allclose(lm.model(ids).logits, ref(ids).logits, atol=1e-5)


def test_full_prefix_reuse_is_exact(lm):
    """Prefill doc, reuse its KV as a prefix, then the query: same logits as doc+query at once."""
    doc, query = _ids(lm, 50, 1), _ids(lm, 7, 2)
    full = forward_tokens(lm.model, doc + query, new_cache(lm.model), 0)[-len(query):]
    cache = new_cache(lm.model)
    forward_tokens(lm.model, doc, cache, 0)
    prefix = KVPrefix([k[0] for k, _ in cache_layers(cache)], [v[0] for _, v in cache_layers(cache)], len(doc))
    reused = forward_tokens(lm.model, query, new_cache(lm.model, prefix), prefix.next_position)
    assert (full - reused).abs().max() <= 1e-4


def test_a_reserved_cache_writes_in_place_and_gives_the_same_keys_and_logits(lm):
    """A cache reserving the document's length: a chunked prefill writes each chunk into the layer's
    buffers (its tensors are views of them), with the keys, values and logits of a growing cache;
    past the reservation, or after its tensors are replaced, a layer grows as transformers' does."""
    doc = _ids(lm, 48, 3)
    grown, reserved = new_cache(lm.model), new_cache(lm.model, reserve=len(doc))
    for start in range(0, len(doc), 16):
        a = forward_tokens(lm.model, doc[start:start + 16], grown, start)
        b = forward_tokens(lm.model, doc[start:start + 16], reserved, start)
        assert torch.equal(a, b)
    for (k, v), (rk, rv), layer in zip(cache_layers(grown), cache_layers(reserved), reserved.layers):
        assert torch.equal(k, rk) and torch.equal(v, rv) and rk.shape[-2] == len(doc)
        assert rk.data_ptr() == layer.buffers[0].data_ptr() and rv.data_ptr() == layer.buffers[1].data_ptr()
    more = _ids(lm, 5, 4)                          # past the reservation: grown by concatenation
    assert torch.equal(forward_tokens(lm.model, more, grown, len(doc)),
                       forward_tokens(lm.model, more, reserved, len(doc)))
    assert all(layer.buffers is None for layer in reserved.layers)
    assert all(torch.equal(k, rk) for (k, _), (rk, _) in zip(cache_layers(grown), cache_layers(reserved)))
    cropped = new_cache(lm.model, reserve=len(doc))
    forward_tokens(lm.model, doc[:32], cropped, 0)
    cropped.crop(-8)                                # tensors replaced by views: still the buffers
    forward_tokens(lm.model, doc[24:32], cropped, 24)
    cropped.reorder_cache(torch.tensor([0]))        # tensors replaced by copies: grown from here

    def first_32():
        return new_cache(lm.model, KVPrefix([k[0, :, :32] for k, _ in cache_layers(grown)],
                                            [v[0, :, :32] for _, v in cache_layers(grown)], 32))

    assert torch.equal(forward_tokens(lm.model, doc[32:], cropped, 32), forward_tokens(lm.model, doc[32:], first_32(), 32))
    assert all(layer.buffers is None for layer in cropped.layers)
    with torch.inference_mode():                    # buffers made under inference mode, room left in them
        later = new_cache(lm.model, reserve=len(doc))
        forward_tokens(lm.model, doc[:32], later, 0)
    with torch.no_grad():                           # appended to outside it: grown, not written in place
        out = lm.model(input_ids=torch.tensor([doc[32:]]), position_ids=torch.arange(32, len(doc))[None],
                       use_cache=True, **{cache_kwarg(lm.model): later}).logits[0].float()
    assert torch.allclose(out, forward_tokens(lm.model, doc[32:], first_32(), 32), atol=1e-5)
    assert all(layer.buffers is None for layer in later.layers)


def test_absent_tokens_keep_positions(lm):
    """Dropping doc tokens from the prefix equals masking them out of a full forward (sdpa)."""
    from transformers import AutoModelForCausalLM

    doc, query = _ids(lm, 30, 3), _ids(lm, 5, 4)
    keep = [i for i in range(len(doc)) if i % 3 != 1]
    cache = new_cache(lm.model)
    forward_tokens(lm.model, doc, cache, 0)
    layers = cache_layers(cache)
    prefix = KVPrefix([k[0][:, keep] for k, _ in layers], [v[0][:, keep] for _, v in layers], len(doc))
    got = forward_tokens(lm.model, query, new_cache(lm.model, prefix), len(doc))
    # Reference: HF's own sdpa path over the full doc cache, with a 4-D mask hiding the dropped
    # tokens from the query; the query sits at positions len(doc)...
    ref_model = AutoModelForCausalLM.from_pretrained(lm.folder, attn_implementation="sdpa").eval()
    ref_cache = new_cache(ref_model)
    with torch.no_grad():
        ref_model(input_ids=torch.tensor([doc]), past_key_values=ref_cache)
        n, q = len(doc), len(query)
        mask = torch.zeros(1, 1, q, n + q, dtype=torch.bool)
        mask[..., keep] = True
        mask[0, 0, :, n:] = torch.tril(torch.ones(q, q, dtype=torch.bool))
        pos = torch.arange(n, n + q).unsqueeze(0)
        ref = ref_model(input_ids=torch.tensor([query]), position_ids=pos, attention_mask=mask,
                        past_key_values=ref_cache).logits[0]
    assert (got - ref).abs().max() <= 1e-4
    # And it differs from the full prefix: the dropped tokens mattered.
    full_prefix = KVPrefix([k[0] for k, _ in layers], [v[0] for _, v in layers], len(doc))
    full = forward_tokens(lm.model, query, new_cache(lm.model, full_prefix), len(doc))
    assert (full - got).abs().max() > 1e-3


def test_layers_may_hold_different_prefixes(lm):
    """Layer 0 holds the whole doc, the others none: runs, and matches a per-layer reference."""
    doc, query = _ids(lm, 20, 5), _ids(lm, 4, 6)
    cache = new_cache(lm.model)
    forward_tokens(lm.model, doc, cache, 0)
    layers = cache_layers(cache)
    keys = [layers[0][0][0]] + [k[0][:, :0] for k, _ in layers[1:]]
    values = [layers[0][1][0]] + [v[0][:, :0] for _, v in layers[1:]]
    prefix = KVPrefix(keys, values, len(doc))
    assert prefix.tokens_per_layer() == [20] + [0] * (lm.geometry.n_layers - 1)
    logits = forward_tokens(lm.model, query, new_cache(lm.model, prefix), len(doc))
    assert logits.shape == (len(query), lm.geometry.vocab_size) and torch.isfinite(logits).all()
    # Decode one more token: the mask stays right as lengths grow unevenly.
    c = new_cache(lm.model, prefix)
    forward_tokens(lm.model, query, c, len(doc))
    step = forward_tokens(lm.model, [query[0]], c, len(doc) + len(query))
    assert torch.isfinite(step).all()


def test_generate_greedy_is_deterministic_and_streams(lm):
    ids = encode_prompt(lm.tokenizer, "The parties agree", chat=False)
    pieces: list[str] = []
    a = generate(lm, ids, max_new_tokens=8, on_text=pieces.append, stop_ids=set())
    b = generate(lm, ids, max_new_tokens=8, stop_ids=set())
    assert a.text == b.text and a.new_tokens == 8 and a.stop_reason == "length"
    assert "".join(pieces) == a.text
    assert a.ttft_ms > 0 and a.total_ms >= a.ttft_ms


def reserved_and_growing(lm, monkeypatch, prefix_tokens: int, new: int):
    """generate() after a prefix of ``prefix_tokens`` random tokens, over its reserving cache and over a
    cache growing by concatenation (``new_cache`` without ``reserve``): the two results."""
    import kite.runtime.generate as gen

    doc = _ids(lm, prefix_tokens, 1)
    cache = new_cache(lm.model)
    forward_tokens(lm.model, doc, cache, 0)
    prefix = KVPrefix([k[0] for k, _ in cache_layers(cache)], [v[0] for _, v in cache_layers(cache)], len(doc))
    ids = encode_prompt(lm.tokenizer, "The parties agree", chat=False)
    reserved = generate(lm, ids, max_new_tokens=new, prefix=prefix, stop_ids=set())
    with monkeypatch.context() as m:
        m.setattr(gen, "new_cache", lambda model, prefix=None, reserve=0: new_cache(model, prefix))
        growing = generate(lm, ids, max_new_tokens=new, prefix=prefix, stop_ids=set())
    return reserved, growing


def test_a_generation_after_a_prefix_reads_as_over_a_growing_cache(lm, monkeypatch):
    """generate() reserves what it will hold (the prefix, the prompt, the new tokens) and writes each
    token in place: the same tokens and prompt NLL as over a cache growing by concatenation."""
    reserved, growing = reserved_and_growing(lm, monkeypatch, 50, 12)
    assert reserved.text == growing.text and reserved.new_tokens == 12
    assert reserved.prompt_nll_bits == pytest.approx(growing.prompt_nll_bits, abs=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_generation_on_the_gpu_reads_the_reserved_cache_as_a_growing_one(tiny_models, monkeypatch, dtype):
    """On a GPU the decode reads the reserved buffers through views (the split-KV kernel and sdpa take
    them by their strides): the same tokens as over a growing cache on fp32, the same prompt NLL to
    bf16's rounding."""
    from kite.model import load_model

    gpu = load_model(str(tiny_models["llama"]), device="cuda", dtype=dtype)
    reserved, growing = reserved_and_growing(gpu, monkeypatch, 300, 16)
    assert reserved.new_tokens == growing.new_tokens == 16
    if dtype == "fp32":
        assert reserved.text == growing.text
    assert reserved.prompt_nll_bits == pytest.approx(growing.prompt_nll_bits, rel=1e-4 if dtype == "fp32" else 2e-2)


def test_sampling_is_seeded(lm):
    ids = encode_prompt(lm.tokenizer, "The parties agree", chat=False)
    a = generate(lm, ids, max_new_tokens=8, temperature=1.0, seed=7, stop_ids=set())
    b = generate(lm, ids, max_new_tokens=8, temperature=1.0, seed=7, stop_ids=set())
    assert a.text == b.text


def test_generate_cli_json(tiny_models):
    result = runner.invoke(app, ["generate", "--model", str(tiny_models["llama"]), "--prompt", "The parties",
                                 "--max-new-tokens", "5", "--json"])
    assert result.exit_code == 0, result.output
    out = parse_json(result.stdout)
    assert out["prompt_tokens"] > 0 and 0 < out["new_tokens"] <= 5
    assert {"text", "ttft_ms", "tokens_per_s", "stop_reason"} <= set(out)


def test_generate_cli_chat_and_stdin(tiny_models):
    result = runner.invoke(app, ["generate", "--model", str(tiny_models["llama"]), "--chat",
                                 "--max-new-tokens", "3", "--json"], input="What is the capital?")
    assert result.exit_code == 0, result.output
    assert parse_json(result.stdout)["prompt_tokens"] > 5  # the chat template added tokens


@pytest.mark.parametrize("args,message", [
    (["--prompt", "  "], "empty"),
    (["--prompt", "x", "--prompt-file", "y"], "not both"),
    (["--prompt-file", "/no/such/file"], "no such file"),
    (["--prompt", "x", "--max-new-tokens", "100000"], "context"),
])
def test_generate_bad_input(tiny_models, args, message):
    result = runner.invoke(app, ["generate", "--model", str(tiny_models["llama"]), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_generate_non_utf8_file(tiny_models, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 \xff")
    result = runner.invoke(app, ["generate", "--model", str(tiny_models["llama"]), "--prompt-file", str(bad)])
    assert result.exit_code == 2 and "UTF-8" in result.output
