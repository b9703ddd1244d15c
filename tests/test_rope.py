"""RoPE removal / re-application round trips on tiny random Llama-family models."""

import pytest
import torch

from kite.runtime.generate import cache_kwarg

from kite.upcycle.rope import apply_rope, remove_rope, rope_cos_sin, rotary_module

transformers = pytest.importorskip("transformers")


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **kw)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


MODELS = {
    "llama": lambda: _llama(),
    "qwen2": _qwen2,
    "llama3-scaling": lambda: _llama(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "yarn": lambda: _llama(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128}),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_round_trip_against_model_cache(name):
    from transformers import DynamicCache

    model = MODELS[name]()
    T = 40
    ids = torch.randint(0, 64, (1, T + 5))
    with torch.no_grad():
        full = model(ids).logits[0, T:]
        out = model(ids[:, :T], use_cache=True)
    cache = out.past_key_values
    positions = torch.arange(T)
    cos, sin = rope_cos_sin(model, positions)
    # config path builds the same module
    cos2, sin2 = rope_cos_sin(model.config, positions)
    assert torch.allclose(cos, cos2) and torch.allclose(sin, sin2)
    new = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        k = layer.keys.float()
        pre = remove_rope(k, cos, sin)
        back = apply_rope(pre, cos, sin)
        assert (back - k).abs().max().item() <= 1e-5 * max(1.0, k.abs().max().item())
        new.update(back, layer.values, i)
    with torch.no_grad():
        logits = model(ids[:, T:], position_ids=torch.arange(T, T + 5)[None],
                       **{cache_kwarg(model): new}).logits[0]
    assert (logits - full).abs().max().item() <= 1e-4


def test_pre_rope_key_is_projection():
    """remove_rope recovers k_proj(norm(h)) exactly: the cached key rotated back by its position."""
    model = _llama()
    T = 16
    ids = torch.randint(0, 64, (1, T))
    captured = {}
    attn = model.model.layers[0].self_attn
    h = attn.k_proj.register_forward_hook(lambda m, i, o: captured.setdefault("k", o))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    h.remove()
    hd = model.config.hidden_size // model.config.num_attention_heads
    k_pre = captured["k"].view(1, T, -1, hd).transpose(1, 2)[0]
    cos, sin = rope_cos_sin(model, torch.arange(T))
    got = remove_rope(out.past_key_values.layers[0].keys[0], cos, sin)
    assert (got - k_pre).abs().max().item() <= 1e-6 * max(1.0, k_pre.abs().max().item()) * 10


def test_rotary_module_lookup():
    model = _llama()
    assert rotary_module(model) is model.model.rotary_emb
    assert rotary_module(model.model) is model.model.rotary_emb
    assert rotary_module(model.model.rotary_emb) is model.model.rotary_emb
