"""A pass over short prompts with nothing before them, written out on KITE's kernels (a GPU).

YOCO reads each query before it decides: one forward over the query alone, for the entropy of the
next-token distribution at each token and the hidden states the tagger reads. Through transformers'
forward that pass costs a 7B model ~23 ms on an H200 for a 20-token query, most of it the Python
around the layers, against ~3 ms of weights to read. This is the same forward as
kite.runtime.kernel_step's (the fused layers' projections, one-kernel RMSNorm with the residual add,
one RoPE kernel, one SiLU product), with causal attention over the prompt itself (right-padded rows:
a row's own tokens never see its padding).

:func:`hidden_pass` answers None where it does not apply (CPU, fp32, the fused layers not installed:
kite.runtime.kernel_step.why_not); the caller then runs transformers' forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kite.runtime.kernel_step import why_not


def applies(model) -> bool:
    """Whether :func:`hidden_pass` runs ``model`` (a GPU, fp16/bf16, the fused layers installed)."""
    try:
        return why_not(model) is None
    except (AttributeError, TypeError):
        return False


def hidden_pass(model, ids: torch.Tensor, wanted: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
    """(the final normed hidden states [B, T, D], {index: hidden states [B, T, D]}) of right-padded
    prompts ``ids`` [B, T], numbered as transformers' ``hidden_states``: 0 the embeddings, ``i`` the
    input of decoder layer ``i``, the number of layers the final normed output. None where the pass
    does not apply (:func:`applies`)."""
    return kernel_hidden(model, ids, wanted) if applies(model) else None


@torch.inference_mode()
def kernel_hidden(model, ids: torch.Tensor, wanted: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """:func:`hidden_pass` without asking whether it applies (the fused layers must be installed;
    on a CPU, through Triton's interpreter in the tests)."""
    from kite.kernels.fused_norm_triton import rms_norm
    from kite.kernels.rope_triton import rope_qkv
    from kite.kernels.silu_mul_triton import silu_mul

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = lm.model
    B, T = ids.shape
    ids = ids.to(lm.device)
    pos = torch.arange(T, device=ids.device).expand(B, T)
    h = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(h, pos)
    n_layers = len(inner.layers)
    kept: dict[int, torch.Tensor] = {}
    for layer, block in enumerate(inner.layers):
        if layer in wanted:
            kept[layer] = h
        attn, mlp = block.self_attn, block.mlp
        x = rms_norm(h, block.input_layernorm.weight, block.input_layernorm.variance_epsilon)
        q, k, v = rope_qkv(*attn.kite_qkv(x), cos, sin)              # [B, H, T, d] each
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling,
                                             enable_gqa=q.shape[1] != k.shape[1])
        a = attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        h, x = rms_norm(a, block.post_attention_layernorm.weight, block.post_attention_layernorm.variance_epsilon,
                        residual=h)
        h = h + mlp.down_proj(silu_mul(*mlp.kite_gate_up(x)))
    h = rms_norm(h, inner.norm.weight, inner.norm.variance_epsilon)
    if n_layers in wanted:
        kept[n_layers] = h
    return h, kept
