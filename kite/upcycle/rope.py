"""RoPE helpers for storing keys before RoPE and re-applying it at load time.

The KV cache of a Llama-family model holds keys *after* rotary position embedding.  Keys are far
more compressible before RoPE (the rotation smears their low-rank structure over position), and
RoPE is a per-pair rotation, so the pre-RoPE key of a cached token is its cached key rotated back
by its own position.

The cos/sin tables come from the model's own rotary embedding module (``model.model.rotary_emb``
in transformers 5.x), so every ``rope_type`` it supports (default, linear, llama3, yarn, ...) and
its ``attention_scaling`` are honoured.  In transformers' convention

    k_rot = k * cos + rotate_half(k) * sin

with cos = cos(theta) * s and sin = sin(theta) * s for an attention scaling s.  Per rotated pair this
is s times a rotation, so the inverse is

    k = (k_rot * cos - rotate_half(k_rot) * sin) / (cos**2 + sin**2)

which is exact for any s (and divides out the tiny fp32 error of cos**2 + sin**2 != 1).
"""

from __future__ import annotations

import torch

__all__ = ["rotary_module", "rope_cos_sin", "rotate_half", "apply_rope", "remove_rope"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (x1, x2) -> (-x2, x1) over the last dimension's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_module(model_or_config):
    """The rotary embedding module of a model, or a fresh one built from a config.

    Accepts a ``*ForCausalLM`` (``model.model.rotary_emb``), a base model (``model.rotary_emb``),
    a rotary module itself, or a ``PretrainedConfig`` (the model class's rotary embedding is built
    for it; Llama's is used for model types without their own).
    """
    obj = model_or_config
    if hasattr(obj, "get_base_model"):   # a peft model (a reader adapter): the model it wraps
        obj = obj.get_base_model()
    if hasattr(obj, "inv_freq") and callable(obj):
        return obj
    inner = getattr(obj, "model", None)
    if inner is not None and hasattr(inner, "rotary_emb"):
        return inner.rotary_emb
    if hasattr(obj, "rotary_emb"):
        return obj.rotary_emb
    # A config: build the model type's rotary embedding.
    model_type = getattr(obj, "model_type", None)
    if model_type is None:
        raise TypeError(f"cannot find a rotary embedding in {type(obj).__name__}")
    import importlib

    cls = None
    try:
        mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        for name in dir(mod):
            if name.endswith("RotaryEmbedding") and name.lower().startswith(model_type.replace("_", "")):
                cls = getattr(mod, name)
                break
    except ImportError:
        cls = None
    if cls is None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as cls  # noqa: N813
    return cls(config=obj)


@torch.no_grad()
def rope_cos_sin(model_or_config, positions, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, head_dim] for 1-D ``positions`` (token positions, int).

    Computed by the model's own rotary module in fp32 (then cast to ``dtype``).
    """
    rot = rotary_module(model_or_config)
    pos = torch.as_tensor(positions, dtype=torch.long)
    if pos.dim() != 1:
        raise ValueError("positions must be 1-D")
    if device is None:
        device = rot.inv_freq.device
    pos = pos.to(device)
    x = torch.zeros(1, dtype=torch.float32, device=device)
    cos, sin = rot(x, pos[None, :])
    return cos[0].to(dtype), sin[0].to(dtype)


def _bcast(t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # cos/sin [T, d] against k [..., T, d]
    return t.to(device=k.device, dtype=k.dtype)


def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pre-RoPE keys ``k`` [..., T, d] to their positions (cos, sin: [T, d])."""
    cos, sin = _bcast(cos, k), _bcast(sin, k)
    return k * cos + rotate_half(k) * sin


def remove_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`apply_rope`: rotate cached keys ``k`` [..., T, d] back to position 0.

    Per half: out1 = k1 c + k2 s, out2 = k2 c - k1 s with c, s = cos, sin / (cos^2 + sin^2) on the
    small [T, d] tables, written in place: two passes over the keys instead of six."""
    cos, sin = _bcast(cos, k), _bcast(sin, k)
    norm = cos * cos + sin * sin
    c, s = cos / norm, sin / norm
    h = k.shape[-1] // 2
    out = torch.empty_like(k, memory_format=torch.contiguous_format)
    k1, k2 = k[..., :h], k[..., h:]
    torch.mul(k1, c[..., :h], out=out[..., :h]).addcmul_(k2, s[..., :h])
    torch.mul(k2, c[..., h:], out=out[..., h:]).addcmul_(k1, s[..., h:], value=-1)
    return out
