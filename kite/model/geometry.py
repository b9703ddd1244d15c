"""A model's KV geometry, read from its config: what the cache holds per token."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True, slots=True)
class Geometry:
    """Architecture facts a state must agree with to be loaded into a model."""

    architecture: str
    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context_length: int
    rope: dict[str, Any] = field(default_factory=dict)

    def kv_bytes_per_token(self, dtype: str = "fp16") -> float:
        """Raw K+V bytes one token occupies in the cache across all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def kv_compatible(self, other: "Geometry") -> bool:
        """Same cache shape and the same RoPE: a state of one can be placed into the other."""
        keys = ("n_layers", "n_kv_heads", "head_dim", "rope")
        return all(getattr(self, k) == getattr(other, k) for k in keys)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Geometry":
        return cls(**data)


def rope_settings(config: Any) -> dict[str, Any]:
    """RoPE parameters as plain JSON (theta, type and scaling fields)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    out = {k: v for k, v in dict(params).items() if isinstance(v, (int, float, str, bool, type(None)))}
    if "rope_theta" not in out and hasattr(config, "rope_theta"):
        out["rope_theta"] = config.rope_theta
    return dict(sorted(out.items()))


def geometry_from_config(config: Any) -> Geometry:
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    archs = getattr(config, "architectures", None) or [type(config).__name__.replace("Config", "ForCausalLM")]
    return Geometry(
        architecture=archs[0],
        model_type=config.model_type,
        n_layers=config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        context_length=getattr(config, "max_position_embeddings", 0) or 0,
        rope=rope_settings(config),
    )
