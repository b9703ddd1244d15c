"""Fewer, fused kernels in a Llama-family model's forward on a GPU (inference only).

A first forward of a short query over a loaded state reads the weights once; what it spends beyond
that is mostly small kernels: transformers' RMSNorm is ~6 launches a call, RoPE ~10 a layer, the
MLP's activation and product 2, the residual adds 2. ``fuse_forward(model)`` installs, on each decoder
layer of a Llama / Qwen2 / Mistral model (plain or under peft), forwards that call:

- one RMSNorm kernel per norm, the attention's residual add fused into the second norm
  (kite.kernels.fused_norm_triton);
- the q / k / v projections as one matrix product and the MLP's gate / up as one, where they are
  plain ``nn.Linear``: their weights are concatenated once and each projection's ``weight`` (and
  ``bias``) becomes a view into the concatenation, so the model holds one copy, ``state_dict`` and
  ``load_state_dict`` keep working, and the originals are freed;
- RoPE of q and k (and v's copy into the same layout) in one kernel (kite.kernels.rope_triton);
- ``silu(gate) * up`` in one kernel (kite.kernels.silu_mul_triton).

The attention itself is still the model's configured implementation (KITE's, with its split-KV
kernel on a GPU). Each fused forward runs transformers' own with autograd on (training) and with
``ENABLED`` False (the benchmarks' A/B switch). Where a projection carries hooks (captures that read
q_proj's output), is wrapped by an adapter (peft LoRA), or no longer views the concatenation
(``model.to`` since), the projections run as their own modules, the rest stays fused; a norm with
hooks runs as its module. Install after the model is on its device and dtype.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ENABLED = True    # False: every installed forward runs transformers' own (side-by-side benchmarks)
CONCATENATED = True   # False: the fused forwards run the separate q/k/v and gate/up products (benchmarks)
FAMILIES = ("llama", "qwen2", "mistral")
_log = logging.getLogger("kite.model")


@dataclass
class Fused:
    """What ``fuse_forward`` installed: layers fused, and how many of their attention / MLP blocks
    got one concatenated projection (the others keep their separate products)."""

    layers: int = 0
    qkv_concatenated: int = 0
    gate_up_concatenated: int = 0


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fuse_forward(model, *, on_cpu: bool = False) -> Fused | None:
    """Install the fused forwards on ``model`` (idempotent). None where they do not apply: not a
    Llama-family model with a SiLU MLP, a head_dim whose half is not a power of 2 (the RoPE kernel's
    block), not fp16 / bf16 on a GPU (``on_cpu``: also CPU models, which then need Triton's
    interpreter; for tests), or Triton missing."""
    config = getattr(model, "config", None)
    param = next(model.parameters(), None)
    if config is None or param is None or getattr(config, "model_type", None) not in FAMILIES:
        return None
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return None
    if not on_cpu and (param.device.type != "cuda" or param.dtype not in (torch.float16, torch.bfloat16)):
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1):
        return None      # the RoPE kernel takes a head's halves as one power-of-2 block
    if not available():
        _log.warning("Triton is not installed: the model's forward keeps transformers' unfused kernels")
        return None
    done = Fused()
    for module in model.modules():
        if not _is_decoder_layer(module):
            continue
        if getattr(module, "_kite_fused", False):
            done.layers += 1
            continue
        attn, mlp = module.self_attn, module.mlp
        attn._kite_qkv = _concatenate(attn, ("q_proj", "k_proj", "v_proj"))
        mlp._kite_gate_up = _concatenate(mlp, ("gate_proj", "up_proj"))
        attn._kite_sliding = getattr(attn, "sliding_window", None) if config.model_type == "qwen2" else \
            getattr(config, "sliding_window", None) if config.model_type == "mistral" else None
        attn._kite_fallback = getattr(sys.modules[type(attn).__module__], "eager_attention_forward", None)
        # transformers 5.2x names the attention's cache ``cache`` (and passes its keywords to update);
        # earlier 5.x ``past_key_values``
        attn._kite_cache_arg = "cache" if "cache" in inspect.signature(type(attn).forward).parameters \
            else "past_key_values"
        attn.forward = types.MethodType(_attention_forward, attn)
        mlp.forward = types.MethodType(_mlp_forward, mlp)
        attn.kite_qkv = types.MethodType(_project_qkv, attn)        # also read by kite.runtime.kernel_step
        mlp.kite_gate_up = types.MethodType(_project_gate_up, mlp)
        module.forward = types.MethodType(_layer_forward, module)
        module._kite_fused = True
        done.layers += 1
        done.qkv_concatenated += attn._kite_qkv is not None
        done.gate_up_concatenated += mlp._kite_gate_up is not None
    for module in model.modules():   # the final norm (and any other norm not inside a layer)
        if _is_rms_norm(module) and not getattr(module, "_kite_fused", False):
            module.forward = types.MethodType(_norm_forward, module)
            module._kite_fused = True
    return done if done.layers else None


def _is_decoder_layer(m) -> bool:
    attn, mlp = getattr(m, "self_attn", None), getattr(m, "mlp", None)
    return (attn is not None and mlp is not None and all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj"))
            and _is_rms_norm(getattr(m, "input_layernorm", None))
            and _is_rms_norm(getattr(m, "post_attention_layernorm", None)))


def _is_rms_norm(m) -> bool:
    return (isinstance(m, nn.Module) and type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")
            and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 1)


def _concatenate(parent, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
    """One weight (and bias) for the plain ``nn.Linear`` projections ``names`` of ``parent``; each
    projection's parameters become views into it. None where they are not all plain, alike Linears."""
    mods = [getattr(parent, n) for n in names]
    if any(type(m) is not nn.Linear for m in mods):
        return None
    w0 = mods[0].weight
    if any(m.weight.dtype != w0.dtype or m.weight.device != w0.device or m.weight.shape[1] != w0.shape[1]
           or (m.bias is None) != (mods[0].bias is None) for m in mods):
        return None
    with torch.no_grad():
        weight = torch.cat([m.weight for m in mods])
        bias = torch.cat([m.bias for m in mods]) if mods[0].bias is not None else None
        sizes, start = [m.weight.shape[0] for m in mods], 0
        for m, n in zip(mods, sizes):
            m.weight = nn.Parameter(weight[start:start + n], requires_grad=m.weight.requires_grad)
            if bias is not None:
                m.bias = nn.Parameter(bias[start:start + n], requires_grad=m.bias.requires_grad)
            start += n
    return weight, bias, sizes


def _still_views(parent, names: tuple[str, ...], fused) -> bool:
    """The projections still read the concatenation (not moved or replaced since) and carry no hooks."""
    weight, _, sizes = fused
    start = 0
    for n, size in zip(names, sizes):
        m = getattr(parent, n)
        if (type(m) is not nn.Linear or m._forward_hooks or m._forward_pre_hooks
                or m.weight.data_ptr() != weight.data_ptr() + start * weight.stride(0) * weight.element_size()):
            return False
        start += size
    return True


def _active(x: torch.Tensor) -> bool:
    return ENABLED and not torch.is_grad_enabled() and x.dtype in (torch.float16, torch.bfloat16, torch.float32)


def _norm(module, x, residual=None):
    from kite.kernels.fused_norm_triton import rms_norm

    if module._forward_hooks or module._forward_pre_hooks or module.weight.dtype != x.dtype:
        if residual is None:
            return module(x)
        x = residual + x
        return x, module(x)
    return rms_norm(x, module.weight, module.variance_epsilon, residual)


def _norm_forward(self, hidden_states):
    if not _active(hidden_states) or self.weight.dtype != hidden_states.dtype:
        return type(self).forward(self, hidden_states)
    from kite.kernels.fused_norm_triton import rms_norm

    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _layer_forward(self, hidden_states, *args, **kwargs):
    # transformers passes everything but the hidden states by keyword, and the same keywords on to the
    # attention (the cache as ``cache`` or, before 5.2x, ``past_key_values``): handed on untouched
    if args or not _active(hidden_states):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    h = _norm(self.input_layernorm, hidden_states)
    h, _ = self.self_attn(hidden_states=h, **kwargs)
    x, h = _norm(self.post_attention_layernorm, h, residual=hidden_states)
    return x + self.mlp(h)


_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


def _attention_forward(self, hidden_states, *args, **kwargs):
    if args or not _active(hidden_states) or kwargs.get("position_embeddings") is None or self.training:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    cos, sin = kwargs.pop("position_embeddings")
    attention_mask = kwargs.pop("attention_mask", None)
    cache, legacy = kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
    cache = cache if cache is not None else legacy
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kite.kernels.rope_triton import rope_qkv

    B, T, _ = hidden_states.shape
    q, k, v = rope_qkv(*self.kite_qkv(hidden_states), cos, sin)
    if cache is not None:   # as the installed transformers' attention calls it
        k, v = (cache.update(k, v, self.layer_idx, kwargs=kwargs) if self._kite_cache_arg == "cache"
                else cache.update(k, v, self.layer_idx))
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._kite_fallback)
    extra = {"sliding_window": self._kite_sliding} if self.config.model_type in ("qwen2", "mistral") else {}
    out, weights = interface(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **extra, **kwargs)
    out = out.reshape(B, T, -1).contiguous()
    return self.o_proj(out), weights


def _project_qkv(self, x):
    """The attention's q, k, v of ``x`` [B, T, hidden], each [B, T, heads, head_dim]: one product where
    the projections still view their concatenation, else each projection's module (an adapter, hooks)."""
    B, T, _ = x.shape
    d = self.head_dim
    fused = self._kite_qkv
    if fused is not None and CONCATENATED and _still_views(self, _QKV, fused):
        weight, bias, (nq, nk, _) = fused
        qkv = F.linear(x, weight, bias)
        return tuple(qkv[..., a:b].view(B, T, -1, d) for a, b in ((0, nq), (nq, nq + nk), (nq + nk, qkv.shape[-1])))
    return tuple(getattr(self, p)(x).view(B, T, -1, d) for p in _QKV)


def _project_gate_up(self, x):
    """The MLP's gate and up products of ``x``: one product where they still view their concatenation."""
    fused = self._kite_gate_up
    if fused is not None and CONCATENATED and _still_views(self, _GATE_UP, fused):
        weight, bias, (n, _) = fused
        gu = F.linear(x, weight, bias)
        return gu[..., :n], gu[..., n:]
    return self.gate_proj(x), self.up_proj(x)


def _mlp_forward(self, x):
    if not _active(x):
        return type(self).forward(self, x)
    from kite.kernels.silu_mul_triton import silu_mul

    return self.down_proj(silu_mul(*self.kite_gate_up(x)))
