"""A longer query after cached tokens (a state's recomputed tail, a document's next chunk): KITE's mask
function leaves the plain bottom-right causal mask unbuilt, and on a GPU KITE's attention runs it
through torch's lower-right causal bias (flash attention) with the answer of the dense mask."""

from __future__ import annotations

import pytest
import torch

from kite.runtime import attention
from kite.runtime.attention import kite_attention, lower_right_only, plain_causal_mask

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _causal():
    from transformers.masking_utils import causal_mask_function
    return causal_mask_function


def _tiny_qwen2():
    """A random 2-layer Qwen2 on the CPU (4:1 grouping): (config, model)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    return cfg, Qwen2ForCausalLM(cfg).eval()


def _plain(**change) -> bool:
    """lower_right_only for 5 new tokens after 7 cached ones on a GPU, with ``change`` applied."""
    args = dict(q_length=5, kv_length=12, q_offset=7, kv_offset=0, mask_function=_causal(), attention_mask=None,
                local_size=None, allow_is_causal_skip=True, device="cuda")
    return lower_right_only(**{**args, **change})


def test_on_a_gpu_the_plain_causal_mask_after_cached_tokens_is_left_unbuilt():
    assert _plain() and _plain(attention_mask=torch.ones(2, 12, dtype=torch.bool))
    assert plain_causal_mask(1, 5, 12, q_offset=7, mask_function=_causal(), device="cuda") is None


@pytest.mark.parametrize("how", ["padding", "window", "not causal", "query not at the end", "no skip",
                                 "switched off", "the cpu", "one new token", "a prompt alone", "a tensor offset"])
def test_any_other_mask_is_transformers_own(how, monkeypatch):
    from transformers.masking_utils import and_masks, sliding_window_overlay

    change = {"padding": {"attention_mask": torch.tensor([[True] * 12, [False] * 3 + [True] * 9])},
              "window": {"local_size": 4},
              "not causal": {"mask_function": and_masks(_causal(), sliding_window_overlay(4))},
              "query not at the end": {"q_offset": 3},
              "no skip": {"allow_is_causal_skip": False},
              "the cpu": {"device": "cpu"},
              "one new token": {"q_length": 1, "kv_length": 8},
              "a prompt alone": {"q_length": 12, "q_offset": 0},
              "a tensor offset": {"q_offset": torch.tensor(7)}}.get(how, {})
    if how == "switched off":
        monkeypatch.setattr(attention, "LOWER_RIGHT", False)
    assert not _plain(**change)


def test_on_the_cpu_the_mask_is_transformers_sdpa_mask():
    from transformers.masking_utils import sdpa_mask

    args = dict(batch_size=2, q_length=5, kv_length=12, q_offset=7, mask_function=_causal())
    assert torch.equal(plain_causal_mask(**args), sdpa_mask(**args))


def test_a_models_query_after_a_cached_prefix_reads_as_through_transformers_sdpa():
    """A random Qwen2 (4:1 grouping) prefills 300 tokens; a 40-token query over that cache gives the
    logits of transformers' own sdpa attention."""
    from transformers import DynamicCache

    cfg, model = _tiny_qwen2()
    doc, query = torch.randint(256, (1, 300)), torch.randint(256, (1, 40))
    logits = {}
    for impl in ("sdpa", attention.register()):
        model.config._attn_implementation = impl
        with torch.inference_mode():
            cache = DynamicCache(config=cfg)
            model(doc, past_key_values=cache)
            logits[impl] = model(query, past_key_values=cache).logits
    assert torch.allclose(logits["sdpa"], logits[attention.NAME], atol=1e-5, rtol=0)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_on_a_gpu_a_long_query_after_cached_keys_runs_lower_right_as_the_dense_mask(dtype, monkeypatch):
    """256 queries after 3,840 cached keys (7:1 grouping, head_dim 128): the lower-right bias's answer is
    the dense bottom-right mask's (bf16 within its rounding, fp32 closely; relative to the output's
    largest value, a few hundredths with keys of this many)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 28, 256, 128, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(1, 4, 4096, 128, device="cuda", generator=g).to(dtype) for _ in range(2))
    out, _ = kite_attention(None, q, k, v, None, scaling=128 ** -0.5)
    monkeypatch.setattr(attention, "LOWER_RIGHT", False)
    dense, _ = kite_attention(None, q, k, v, None, scaling=128 ** -0.5)
    assert out.shape == dense.shape == (1, 256, 28, 128)
    diff, scale = (out.float() - dense.float()).abs().max().item(), dense.float().abs().max().item()
    assert diff <= (2e-2 if dtype == torch.bfloat16 else 1e-4) * scale, (diff, scale)


@cuda
def test_on_a_gpu_a_recomputed_tail_is_the_dense_masks_tail():
    """A random Qwen2 prefills 3,000 tokens; the KV of a 256-token tail run over that prefix, with the
    lower-right bias and with the dense mask (bf16), agree within bf16's rounding."""
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    cfg._attn_implementation = attention.register()
    model = Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    doc, tail = torch.randint(512, (1, 3000), device="cuda"), torch.randint(512, (1, 256), device="cuda")
    got = {}
    try:
        for lower_right in (True, False):
            attention.LOWER_RIGHT = lower_right
            with torch.inference_mode():
                cache = DynamicCache(config=cfg)
                model(doc, past_key_values=cache)
                out = model(tail, past_key_values=cache)
            got[lower_right] = (out.logits.float(), cache.layers[1].keys[0, :, -256:].float())
    finally:
        attention.LOWER_RIGHT = True
    for a, b in zip(got[True], got[False]):
        assert (a - b).abs().max().item() <= 0.02 * b.abs().max().item()


@cuda
def test_while_a_cuda_graph_is_captured_the_padding_is_not_read():
    """Reading the padding mask's values would break a capture: there the mask is transformers' own."""
    pad = torch.ones(1, 12, dtype=torch.bool, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = plain_causal_mask(1, 5, 12, q_offset=7, mask_function=_causal(), attention_mask=pad, device="cuda")
    assert got is not None and tuple(got.shape) == (1, 1, 5, 12)


def test_transformers_hands_the_mask_function_what_a_gpu_needs_to_skip_the_tails_mask():
    """A model's prompt, then a query after its dynamic cache: transformers passes plain int offsets,
    so on a GPU the query's mask would be left unbuilt (if a later transformers passes tensors, the
    lower-right path turns off, and this test says so)."""
    from transformers import DynamicCache
    from transformers.masking_utils import AttentionMaskInterface

    name = attention.register()
    asked = []

    def spy(*args, **kwargs):
        on_gpu = {k: kwargs[k] for k in ("q_length", "kv_length", "q_offset", "kv_offset")}
        asked.append((kwargs["q_length"], kwargs["kv_length"],
                      lower_right_only(**on_gpu, mask_function=kwargs["mask_function"],
                                       attention_mask=kwargs.get("attention_mask"), local_size=kwargs.get("local_size"),
                                       allow_is_causal_skip=kwargs.get("allow_is_causal_skip", True), device="cuda")))
        return plain_causal_mask(*args, **kwargs)

    cfg, model = _tiny_qwen2()
    model.config._attn_implementation = name
    AttentionMaskInterface.register(name, spy)
    try:
        with torch.inference_mode():
            cache = DynamicCache(config=cfg)
            model(torch.randint(256, (1, 30)), past_key_values=cache)
            model(torch.randint(256, (1, 7)), past_key_values=cache)
    finally:
        AttentionMaskInterface.register(name, plain_causal_mask)
    assert asked == [(30, 30, False), (7, 37, True)]     # the prompt alone: transformers' own skip
