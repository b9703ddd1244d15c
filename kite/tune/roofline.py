"""A model's sizes (parameters, weights, KV bytes, FLOPs) from its config, and the roofline of one
request on a GPU, corrected by what this project measured.

The roofline (as `llm-optimizer estimate` and `benchmarks/gpu_speed.py` draw it): a prefill costs
its FLOPs over the GPU's dense bf16 rate; a decode step or a query's forward reads the weights and
the KV once over HBM; a state's load crosses the host link once. Measured figures are slower than
these floors by a factor the planner takes from the H200 runs (kite.tune.gpus.Measured):

- prefill: the floor over a measured efficiency (floor / measured prefill);
- decode step and query forward: a fixed cost per step (what the measured step spends beyond its
  bytes: launches and kernels; the decode step over 42 raw sequences, the query's forward over one
  state, both KITE's path: fused layers, KITE's attention, CUDA-graphed) plus the bytes over HBM
  at the bandwidth a batched attention step reached;
- a state's load: its bytes over the host link at the efficiency the hot-tier load reached;
- compressed states resident on the GPU, as the default joint-head states are held: every decode
  step rebuilds each sequence's layers, a fixed cost per sequence and layer (launch-bound;
  kite.upcycle's rebuild per layer).
- states resident in nibble lanes (``kite serve --resident lanes``): the lanes' bytes over HBM at
  the efficiency the lanes decode kernel reached (its byte floor / its measured time), on top of
  the step's weights and raw rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kite.errors import BadInput
from kite.model.geometry import Geometry, geometry_from_config
from kite.tune.gpus import GpuSpec, Measured

DTYPE_BYTES = 2  # bf16 weights and raw KV: what the planner sizes


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What sizes a dense Llama-family decoder: its KV geometry plus the MLP width and the
    embedding tying. Parameters are counted from these (no weights are read)."""

    geometry: Geometry
    intermediate_size: int
    tie_embeddings: bool
    qkv_bias: bool

    @property
    def layer_params(self) -> int:
        g = self.geometry
        q, kv = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
        attn = g.hidden_size * (q + 2 * kv) + q * g.hidden_size + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * g.hidden_size * self.intermediate_size + 2 * g.hidden_size

    @property
    def body_params(self) -> int:
        """The decoder layers' parameters: what every token's forward multiplies by."""
        return self.geometry.n_layers * self.layer_params

    @property
    def params(self) -> int:
        g = self.geometry
        embed = g.vocab_size * g.hidden_size
        return self.body_params + embed * (1 if self.tie_embeddings else 2) + g.hidden_size

    @property
    def weights_bytes(self) -> int:
        return self.params * DTYPE_BYTES

    @property
    def step_weights_bytes(self) -> int:
        """Weights a decode step reads: the layers and the LM head (the embedding is a gather)."""
        g = self.geometry
        return (self.body_params + g.vocab_size * g.hidden_size + g.hidden_size) * DTYPE_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        return int(self.geometry.kv_bytes_per_token("bf16"))

    def prefill_flops(self, tokens: int) -> float:
        """FLOPs of a prefill of `tokens`: the layers' matmuls, causal attention (QK^T and AV over
        half the square), the LM head for the last token."""
        g = self.geometry
        attn = 2 * 2 * g.n_layers * g.n_heads * g.head_dim * tokens * tokens / 2
        return 2 * self.body_params * tokens + attn + 2 * g.vocab_size * g.hidden_size

    def activation_bytes(self, tokens: int) -> int:
        """The largest transient of a prefill of `tokens` (the MLP's gate and up outputs and a few
        hidden-size buffers): memory the KV budget leaves free."""
        return tokens * (2 * self.intermediate_size + 4 * self.geometry.hidden_size) * DTYPE_BYTES

    def to_dict(self) -> dict:
        return {"geometry": self.geometry.to_dict(), "intermediate_size": self.intermediate_size,
                "tie_word_embeddings": self.tie_embeddings, "qkv_bias": self.qkv_bias, "params": self.params,
                "weights_bytes": self.weights_bytes, "kv_bytes_per_token": self.kv_bytes_per_token}


REQUIRED = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "vocab_size")


def shape_from_config(config: Any, where: str = "the config") -> ModelShape:
    """The shape of a model from its HF config (a transformers config object, or the dict of a
    config.json). BadInput, naming `where`, for anything that is not a dense decoder config."""
    if isinstance(config, dict):
        missing = [k for k in REQUIRED if k not in config]
        if missing:
            raise BadInput(f"{where}: not a model config (no {', '.join(missing)})")
        if not isinstance(config.get("rope_scaling") or {}, dict):
            raise BadInput(f"{where}: rope_scaling must be a mapping, got {config['rope_scaling']!r}")
        config = SimpleNamespace(**{"model_type": "unknown", "architectures": None, **config})
        config.architectures = config.architectures or [f"{config.model_type} (config.json)"]
    for key in REQUIRED:
        value = getattr(config, key, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise BadInput(f"{where}: {key} must be a positive whole number, got {value!r}")
    if any(getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise BadInput(f"{where}: a mixture-of-experts model: the planner sizes dense decoders only")
    kv = getattr(config, "num_key_value_heads", None)
    if kv is not None and (not isinstance(kv, int) or kv <= 0 or config.num_attention_heads % kv):
        raise BadInput(f"{where}: num_key_value_heads {kv!r} does not divide num_attention_heads "
                       f"{config.num_attention_heads}")
    geometry = geometry_from_config(config)
    if not isinstance(geometry.head_dim, int) or geometry.head_dim <= 0:
        raise BadInput(f"{where}: head_dim must be a positive whole number, got {geometry.head_dim!r}")
    qkv_bias = bool(getattr(config, "attention_bias", False)) or getattr(config, "model_type", "") == "qwen2"
    return ModelShape(geometry, config.intermediate_size, bool(getattr(config, "tie_word_embeddings", False)),
                      qkv_bias)


# The geometry every H200 figure was measured at (benchmarks/gpu_speed.py's Qwen2-7B): the
# corrections are ratios at this shape.
QWEN2_7B = ModelShape(
    Geometry(architecture="Qwen2ForCausalLM", model_type="qwen2", n_layers=28, n_heads=28, n_kv_heads=4,
             head_dim=128, hidden_size=3584, vocab_size=152064, context_length=32768),
    intermediate_size=18944, tie_embeddings=False, qkv_bias=True)


@dataclass(frozen=True, slots=True)
class Corrections:
    """The measured slowdowns against the roofline, as numbers the time model applies."""

    prefill_efficiency: float    # floor / measured prefill
    hbm_efficiency: float        # bytes of a batched attention step over HBM / its measured time
    step_fixed_ms: float         # a decode step's time beyond its bytes (launches)
    query_fixed_ms: float        # a query forward's time beyond its bytes
    link_efficiency: float       # a state's load: bytes over the host link / measured
    rebuild_ms: float            # one compressed sequence's layer rebuilt per decode step
    lanes_efficiency: float      # the lanes decode kernel: bytes over HBM / its measured time
    lanes_encode_ms_per_gb: float  # coding a loaded state into lanes, per GB of its raw KV
    compress_ms_per_gb: float    # compressing a document, per GB of its raw KV
    own: bool                    # measured on this GPU (else borrowed from the H200)
    source: str

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def corrections(gpu: GpuSpec, m: Measured, own: bool) -> Corrections:
    """The corrections from the measurements `m`, made at QWEN2_7B on `m.gpu` whose datasheet
    figures are `gpu`'s when `own` (else the H200's table entry)."""
    from kite.tune.gpus import GPUS

    at = gpu if own else GPUS[m.gpu]
    hbm, link = at.hbm_tbps * 1e12, at.host_link_gbps * 1e9
    s, kv_seq = QWEN2_7B, QWEN2_7B.kv_bytes_per_token * m.tokens
    hbm_eff = (m.attention_seqs * kv_seq / hbm) / (m.attention_step_ms / 1e3)
    step_bytes_ms = (s.step_weights_bytes + kv_seq) / (hbm * hbm_eff) * 1e3
    batch_bytes_ms = (s.step_weights_bytes + m.batch_step_seqs * kv_seq) / (hbm * hbm_eff) * 1e3
    prefill_floor = s.prefill_flops(m.tokens + m.query_tokens) / (at.bf16_tflops * 1e12) * 1e3
    return Corrections(
        prefill_efficiency=prefill_floor / m.prefill_ms, hbm_efficiency=hbm_eff,
        step_fixed_ms=max(0.0, m.batch_step_ms - batch_bytes_ms),
        query_fixed_ms=max(0.0, m.query_forward_ms - step_bytes_ms),
        link_efficiency=(m.hot_tier_bytes / link * 1e3) / m.hot_tier_load_ms,
        rebuild_ms=m.resident_step_ms / (m.resident_seqs * s.geometry.n_layers),
        lanes_efficiency=(m.lanes_seqs * m.lanes_kernel_bytes / hbm) / (m.lanes_kernel_ms / 1e3),
        lanes_encode_ms_per_gb=m.lanes_encode_ms / (kv_seq / 1e9),
        compress_ms_per_gb=m.compress_ms / (kv_seq / 1e9), own=own, source=m.source)


@dataclass(frozen=True, slots=True)
class Roofline:
    """Times of one replica (`tp` GPUs of `gpu`, ideal tensor-parallel scaling) for `shape`, each as
    (floor ms, predicted ms)."""

    shape: ModelShape
    gpu: GpuSpec
    fix: Corrections
    tp: int = 1

    @property
    def _hbm(self) -> float:
        return self.gpu.hbm_tbps * 1e12 * self.tp

    def prefill(self, tokens: int) -> tuple[float, float]:
        floor = self.shape.prefill_flops(tokens) / (self.gpu.bf16_tflops * 1e12 * self.tp) * 1e3
        return floor, floor / self.fix.prefill_efficiency

    def decode_step(self, batch: int, kv_bytes_read: float, rebuild_seqs: int = 0,
                    lanes_bytes_read: float = 0.0) -> tuple[float, float]:
        """One decode step of `batch` sequences reading `kv_bytes_read` of raw KV in all; the
        `rebuild_seqs` of them held compressed are rebuilt layer by layer first; `lanes_bytes_read`:
        the bytes of states held in lanes, read by the lanes kernel."""
        nbytes = self.shape.step_weights_bytes + kv_bytes_read
        floor = max((nbytes + lanes_bytes_read) / self._hbm,
                    2 * self.shape.body_params * batch / (self.gpu.bf16_tflops * 1e12 * self.tp))
        mem = nbytes / (self._hbm * self.fix.hbm_efficiency)
        compute = 2 * self.shape.body_params * batch / (self.gpu.bf16_tflops * 1e12 * self.tp
                                                        * self.fix.prefill_efficiency)
        rebuild = rebuild_seqs * self.shape.geometry.n_layers * self.fix.rebuild_ms / self.tp
        lanes = lanes_bytes_read / (self._hbm * self.fix.lanes_efficiency) * 1e3
        return floor * 1e3, max(mem, compute) * 1e3 + self.fix.step_fixed_ms + rebuild + lanes

    def lanes_encode(self, context_tokens: int) -> float:
        """Predicted ms to code a loaded state of `context_tokens` into lanes (scaled by its raw KV
        bytes from the measured one)."""
        return self.fix.lanes_encode_ms_per_gb * self.shape.kv_bytes_per_token * context_tokens / 1e9 / self.tp

    def state_ttft(self, state_bytes: float, context_tokens: int) -> tuple[float, float]:
        """TTFT from a state in pinned host memory: its load over the host link, then the query's
        forward over the context."""
        link = (self.gpu.host_link_gbps or 0) * 1e9 * self.tp
        kv = self.shape.kv_bytes_per_token * context_tokens
        fwd_bytes = self.shape.step_weights_bytes + kv
        floor = (state_bytes / link if link else 0.0) + fwd_bytes / self._hbm
        load = state_bytes / (link * self.fix.link_efficiency) if link else 0.0
        fwd = fwd_bytes / (self._hbm * self.fix.hbm_efficiency)
        return floor * 1e3, (load + fwd) * 1e3 + self.fix.query_fixed_ms

    def compress(self, context_tokens: int) -> float:
        """Predicted ms to compress a document of `context_tokens` (scaled by its raw KV bytes
        from the measured one; no floor of its own)."""
        return self.fix.compress_ms_per_gb * self.shape.kv_bytes_per_token * context_tokens / 1e9 / self.tp
