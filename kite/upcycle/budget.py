"""Memory-budgeted long context: a KV cache that upcycles its oldest tokens instead of dropping them.

:class:`BudgetCache` is a transformers ``Cache`` whose every layer holds

* the first ``sink_tokens`` tokens raw (attention sinks: most of the attention lands on them, and
  any error on them is multiplied);
* the most recent tokens raw (post-RoPE, at the model's dtype), at most ``budget_tokens`` raw
  tokens in all, sinks included;
* everything older as **compressed blocks** of ``block_tokens`` tokens: pre-RoPE keys and values
  encoded by the `.upc` codec (:mod:`kite.upcycle.codec`), held as its compact tensors.

When a forward pushes the raw tokens past the budget, the oldest raw blocks are rotated back to
pre-RoPE, encoded and their raw KV freed. The codec's shared per-layer part (means, PCA bases, bit
allocation) is fitted once per layer, on the raw tokens present at the first compression, and
serves every later block of that layer.

During attention each layer decodes its blocks *transiently* -- dequantize, re-apply RoPE at every
token's original position, cast to the model's dtype -- and hands ``[sinks, decoded blocks, raw
window, new tokens]`` to the attention function; the decoded tensors are dropped when the layer is
done. Nothing is evicted: every token keeps taking part in attention at its position, so the
sequence length, the causal mask and the positions are exactly those of a full cache. What it costs
is compute (every forward decodes every block of every layer) and a transient peak of one layer's
decoded KV. ``keep_decoded=True`` keeps the decoded blocks between forwards (faster decoding,
but then the blocks cost their decoded size in memory too; :meth:`BudgetCache.stats` counts it).

:class:`WindowCache` is the dropping baseline at the same memory (StreamingLLM: the sinks plus the
most recent tokens; older tokens are gone, the kept ones keep their positions).

Byte accounting (:meth:`BudgetCache.stats`): every byte of the compressed blocks and of the
per-layer codec parts as stored (:func:`kite.upcycle.codec.nbytes`: tensors + headers), plus the
raw tokens counted at 16 bits per element (the bf16 / fp16 KV a GPU holds), against all tokens'
KV at 16 bits. ``held_raw_bytes`` is what the raw tokens take at the model's actual dtype (fp32 on
the CPU by default).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kite.errors import BadInput, KiteError
from kite.runtime.row_memory import RowMemory
from kite.upcycle import codec as C
from kite.upcycle.load.selection import SINK_TOKENS
from kite.upcycle.rope import apply_rope, remove_rope, rope_cos_sin, rotary_module

__all__ = ["BudgetSettings", "BudgetCache", "BudgetRow", "WindowCache", "budget_cache", "check_budget",
           "DEFAULT_CODEC", "DEFAULT_BLOCK_TOKENS", "SINK_TOKENS", "min_budget", "kv_bytes_per_token"]

DEFAULT_BLOCK_TOKENS = 256
DEFAULT_CODEC = "ratio=8"


def kv_bytes_per_token(config, bytes_per_elem: int = 2) -> int:
    """Raw KV bytes of one token over all layers (keys + values) at `bytes_per_elem` per element."""
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * n_kv * head_dim * bytes_per_elem


def min_budget(block_tokens: int = DEFAULT_BLOCK_TOKENS, sink_tokens: int = SINK_TOKENS) -> int:
    """The smallest budget: the sinks plus one block (the raw tokens of a block are what is compressed)."""
    return sink_tokens + block_tokens


@dataclass(frozen=True)
class BudgetSettings:
    """What a budgeted cache keeps raw and how it compresses the rest."""

    budget_tokens: int
    codec: str = DEFAULT_CODEC          # a kite.upcycle.codec.settings_for spec: ratio=R, int4, exact, ...
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    sink_tokens: int = SINK_TOKENS
    keep_decoded: bool = False
    # tokens the codec's shared part (bases) is budgeted over; 0: the model's context length. The
    # shared part is fitted once and serves every later block, so ``ratio=R`` makes blocks of ~1/R
    # of their raw bytes and the shared part is paid on top, once per layer.
    amortize_tokens: int = 0

    def codec_settings(self) -> C.CodecSettings:
        # the codec's own fp16 sink is not needed (the sinks stay raw here); its fixed costs are
        # budgeted per block
        try:
            return C.settings_for(self.codec, sink_tokens=0, part_tokens=self.block_tokens)
        except ValueError as exc:
            raise BadInput(f"--kv-budget-codec {self.codec!r}: {exc}") from None

    def to_dict(self) -> dict:
        return asdict(self)


def check_budget(settings: BudgetSettings, context_length: int | None = None) -> BudgetSettings:
    """Raise BadInput (one line) for a budget that cannot work; return the settings otherwise."""
    s = settings
    if s.block_tokens < 16:
        raise BadInput(f"--kv-budget-block {s.block_tokens}: at least 16 tokens")
    if s.sink_tokens < 0:
        raise BadInput(f"sink tokens {s.sink_tokens}: must be >= 0")
    lo = min_budget(s.block_tokens, s.sink_tokens)
    if s.budget_tokens < lo:
        raise BadInput(f"--kv-budget-tokens {s.budget_tokens}: at least {lo} (the {s.sink_tokens} sink tokens "
                       f"+ a block of {s.block_tokens})")
    if context_length and s.budget_tokens >= context_length:
        raise BadInput(f"--kv-budget-tokens {s.budget_tokens}: must be below the model's context of "
                       f"{context_length} tokens (a budget that large never compresses anything)")
    s.codec_settings()  # a bad codec spec fails here
    return s


@dataclass
class _Block:
    start: int                 # position of its first token
    n: int                     # tokens
    part: C.EncodedPart
    nbytes: int
    decoded: tuple[torch.Tensor, torch.Tensor] | None = None   # keep_decoded only


@dataclass
class _Counters:
    encode_ms: float = 0.0
    decode_ms: float = 0.0
    fit_ms: float = 0.0
    decodes: int = 0


class CodedBlocks:
    """One layer's tokens upcycled out of a budgeted cache: the codec's shared part, fitted on the
    raw tokens present at the first compression, and the blocks coded with it (oldest first)."""

    def __init__(self, coder: "BlockCoder"):
        self.coder = coder
        self.blocks: list[_Block] = []
        self.layer_codec: C.LayerCodec | None = None
        self.codec_nbytes = 0

    @property
    def compressed_tokens(self) -> int:
        return sum(b.n for b in self.blocks)

    def offer(self, keys: torch.Tensor, values: torch.Tensor, n_sink: int) -> int:
        """``keys``/``values`` [H, W, d] post-RoPE: the layer's raw tokens after its ``n_sink`` sinks,
        oldest first (their positions follow the sinks and the blocks already coded). While the raw
        tokens, sinks included, pass the budget, code the oldest whole block; returns how many tokens
        were taken (a multiple of ``block_tokens``: the caller frees them)."""
        s = self.coder.settings
        W, taken = int(keys.shape[-2]), 0
        while n_sink + W - taken > s.budget_tokens and W - taken >= s.block_tokens:
            if self.layer_codec is None:
                self._fit(keys, values, n_sink)
            start = n_sink + self.compressed_tokens   # position of the oldest raw non-sink token
            n = s.block_tokens
            t0 = time.perf_counter()
            k_post = keys[:, taken:taken + n, :].float()
            positions = torch.arange(start, start + n)
            cos, sin = self.coder.cos_sin(positions, k_post.device)
            part = C.encode(self.layer_codec, remove_rope(k_post, cos, sin).cpu(),
                            values[:, taken:taken + n, :].float().cpu(), positions=positions)
            self.blocks.append(_Block(start, n, part, C.nbytes(part)))
            taken += n
            self._drop_basis_cache()
            self.coder.counters.encode_ms += (time.perf_counter() - t0) * 1e3
        return taken

    def _fit(self, keys: torch.Tensor, values: torch.Tensor, n_sink: int) -> None:
        """Fit the layer's shared codec part on the raw non-sink tokens present now."""
        t0 = time.perf_counter()
        start = n_sink + self.compressed_tokens
        k_post = keys.float()
        positions = torch.arange(start, start + k_post.shape[-2])
        cos, sin = self.coder.cos_sin(positions, k_post.device)
        c = self.coder
        self.layer_codec = C.fit_layer(remove_rope(k_post, cos, sin).cpu(), values.float().cpu(), c.codec,
                                       budget_tokens=max(c.amortize_tokens, k_post.shape[-2]))
        self.codec_nbytes = C.nbytes(self.layer_codec)
        c.counters.fit_ms += (time.perf_counter() - t0) * 1e3

    def _drop_basis_cache(self) -> None:
        # the codec memoizes its dequantized (fp32) basis; keep only the stored form between calls
        if self.layer_codec is not None and not self.coder.settings.keep_decoded:
            self.layer_codec.decoded.clear()

    def decoded(self, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block, decoded and re-rotated at its tokens' positions: ([H, T_c, d]) x 2."""
        t0 = time.perf_counter()
        ks, vs = [], []
        for b in self.blocks:
            if b.decoded is not None:
                ks.append(b.decoded[0])
                vs.append(b.decoded[1])
                continue
            k_pre, v = C.decode(self.layer_codec, b.part)
            cos, sin = self.coder.cos_sin(torch.arange(b.start, b.start + b.n), device)
            k = apply_rope(k_pre.to(device), cos, sin).to(dtype)
            v = v.to(device, dtype)
            if self.coder.settings.keep_decoded:
                b.decoded = (k, v)
            ks.append(k)
            vs.append(v)
        self._drop_basis_cache()
        c = self.coder.counters
        c.decode_ms += (time.perf_counter() - t0) * 1e3
        c.decodes += 1
        return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)


class BlockCoder:
    """What every layer's :class:`CodedBlocks` of one budgeted sequence share: the settings, the
    codec, the model's RoPE, the timers and the byte accounting."""

    def __init__(self, model, settings: BudgetSettings):
        self.settings = check_budget(settings)
        self.codec = settings.codec_settings()
        config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
        self.n_layers = config.num_hidden_layers
        self._rot = rotary_module(model)
        self.bytes_per_token = kv_bytes_per_token(config, 2)
        self.amortize_tokens = settings.amortize_tokens or getattr(config, "max_position_embeddings", 0) or 0
        self.counters = _Counters()

    def cos_sin(self, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(self._rot, positions)
        return cos.to(device), sin.to(device)

    def stats(self, layers: list[CodedBlocks], *, seen: int, raw_tokens: list[int], held_raw_bytes: int) -> dict:
        """The budget's report (docs/kv-budget.md): ``seen`` tokens in all, ``raw_tokens`` per layer
        (sinks + window), ``held_raw_bytes`` what those take at the model's dtype."""
        compressed = sum(b.nbytes for lay in layers for b in lay.blocks)
        codec_bytes = sum(lay.codec_nbytes for lay in layers)
        per_layer_token = self.bytes_per_token // max(len(layers), 1)
        raw16 = sum(raw_tokens) * per_layer_token
        decoded = sum(t.numel() * t.element_size() for lay in layers for b in lay.blocks if b.decoded
                      for t in b.decoded)
        full = seen * self.bytes_per_token
        kv = compressed + codec_bytes + raw16
        s, c = self.settings, self.counters
        return {
            "budget_tokens": s.budget_tokens, "block_tokens": s.block_tokens, "sink_tokens": s.sink_tokens,
            "codec": self.codec.name, "keep_decoded": s.keep_decoded,
            "tokens": seen, "raw_tokens": raw_tokens[0] if raw_tokens else 0,
            "compressed_tokens": layers[0].compressed_tokens if layers else 0,
            "blocks_per_layer": len(layers[0].blocks) if layers else 0,
            "kv_bytes": kv, "compressed_bytes": compressed, "codec_bytes": codec_bytes, "raw_bytes": raw16,
            "raw_kv_bytes": full, "ratio_to_raw": round(kv / full, 4) if full else None,
            "held_raw_bytes": held_raw_bytes, "decoded_cache_bytes": decoded,
            "timings_ms": {"fit": round(c.fit_ms, 1), "encode": round(c.encode_ms, 1),
                           "decode": round(c.decode_ms, 1)},
        }


class BudgetLayer(DynamicLayer):
    """One layer of a :class:`BudgetCache`: raw sinks + raw window in ``keys``/``values``, older
    tokens as compressed blocks (``coded``). ``keys``/``values`` hold the raw tokens only;
    ``get_seq_length`` is every token seen (the compressed ones still take part in attention)."""

    is_croppable = False

    def __init__(self, owner: "BudgetCache"):
        super().__init__()
        self.owner = owner
        self.seen = 0
        self.coded = CodedBlocks(owner.coder)

    # -- bookkeeping --------------------------------------------------------------------------
    @property
    def n_sink(self) -> int:
        return min(self.owner.settings.sink_tokens, self.seen)

    @property
    def blocks(self) -> list[_Block]:
        return self.coded.blocks

    @property
    def layer_codec(self) -> C.LayerCodec | None:
        return self.coded.layer_codec

    @property
    def compressed_tokens(self) -> int:
        return self.coded.compressed_tokens

    @property
    def raw_tokens(self) -> int:
        return 0 if not self.is_initialized else int(self.keys.shape[-2])

    def get_seq_length(self) -> int:
        return self.seen

    def reset(self) -> None:
        super().reset()
        self.seen = 0
        self.coded = CodedBlocks(self.owner.coder)

    # What a budgeted cache refuses by design: its old tokens are coded in blocks (nothing to
    # crop back to) and it holds one sequence (no beams, no batch reordering).
    def crop(self, tokens_to_remove: int) -> None:
        raise KiteError("a memory-budgeted KV cache cannot be cropped (its old tokens are coded in blocks)")

    def reorder_cache(self, beam_idx) -> None:
        raise KiteError("a memory-budgeted KV cache holds one sequence: no beam search or batch reordering")

    batch_repeat_interleave = batch_select_indices = reorder_cache

    # -- the cache ----------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError(f"a budgeted KV cache holds one sequence, got a batch of {key_states.shape[0]}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        ns = self.n_sink
        if self.blocks:
            dk, dv = self.coded.decoded(key_states.dtype, self.keys.device)
            keys = torch.cat([self.keys[..., :ns, :], dk[None], self.keys[..., ns:, :], key_states], dim=-2)
            values = torch.cat([self.values[..., :ns, :], dv[None], self.values[..., ns:, :], value_states], dim=-2)
        else:
            keys = torch.cat([self.keys, key_states], dim=-2)
            values = torch.cat([self.values, value_states], dim=-2)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.seen += key_states.shape[-2]
        ns = self.n_sink
        taken = self.coded.offer(self.keys[0, :, ns:, :], self.values[0, :, ns:, :], ns)
        if taken:
            self.keys = torch.cat([self.keys[..., :ns, :], self.keys[..., ns + taken:, :]], dim=-2)
            self.values = torch.cat([self.values[..., :ns, :], self.values[..., ns + taken:, :]], dim=-2)
        return keys, values


class BudgetCache(Cache):
    """A KV cache holding at most ``budget_tokens`` raw tokens per layer; older tokens are upcycled
    into codec blocks that keep taking part in attention (see the module doc)."""

    def __init__(self, model, settings: BudgetSettings):
        self.coder = BlockCoder(model, settings)
        self.settings, self.codec = self.coder.settings, self.coder.codec
        super().__init__(layers=[BudgetLayer(self) for _ in range(self.coder.n_layers)])

    @property
    def counters(self) -> _Counters:
        return self.coder.counters

    def cos_sin(self, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.coder.cos_sin(positions, device)

    # -- accounting ---------------------------------------------------------------------------
    def stats(self) -> dict:
        layers: list[BudgetLayer] = self.layers
        held = sum(lay.keys.numel() * lay.keys.element_size() * 2 for lay in layers if lay.is_initialized)
        return self.coder.stats([lay.coded for lay in layers], seen=layers[0].seen if layers else 0,
                                raw_tokens=[lay.raw_tokens for lay in layers], held_raw_bytes=held)


class BudgetRow(RowMemory):
    """The memory budget for one sequence of a batch (kite.runtime.batch_decode): the batch row
    holds the sinks and the raw window, this holds the coded blocks, coded and decoded exactly as a
    :class:`BudgetCache`'s layers do. ``stats()`` reports as :meth:`BudgetCache.stats` does."""

    def __init__(self, model, settings: BudgetSettings):
        self.coder = BlockCoder(model, settings)
        self.settings = self.coder.settings
        self.layers = [CodedBlocks(self.coder) for _ in range(self.coder.n_layers)]
        self.sink_tokens = self.settings.sink_tokens
        self.prefill_chunk = self.settings.block_tokens
        self.max_slots = self.settings.budget_tokens + self.settings.block_tokens
        self._row = {"seen": 0, "raw_tokens": [0] * self.coder.n_layers, "held_raw_bytes": 0}

    def offer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        # offered tokens come after the sinks, so all `sink_tokens` of them are there
        return self.layers[layer].offer(keys, values, self.sink_tokens)

    def held(self, layer: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        coded = self.layers[layer]
        return coded.decoded(dtype, device) if coded.blocks else None

    def observe(self, *, seen: int, raw_tokens: list[int], held_raw_bytes: int) -> None:
        self._row = {"seen": seen, "raw_tokens": list(raw_tokens), "held_raw_bytes": held_raw_bytes}

    def stats(self) -> dict:
        return self.coder.stats(self.layers, **self._row)


def budget_cache(lm_or_model, budget_tokens: int, codec: str = DEFAULT_CODEC,
                 block_tokens: int = DEFAULT_BLOCK_TOKENS, keep_decoded: bool = False) -> BudgetCache:
    """A :class:`BudgetCache` for a loaded model (a kite LoadedModel or a transformers model),
    checked against the model's context length (BadInput when it cannot work)."""
    model = getattr(lm_or_model, "model", lm_or_model)
    settings = BudgetSettings(budget_tokens=budget_tokens, codec=codec, block_tokens=block_tokens,
                              keep_decoded=keep_decoded)
    check_budget(settings, getattr(model.config, "max_position_embeddings", None))
    return BudgetCache(model, settings)


# ------------------------------------------------------------------------------------------------
# the dropping baseline


class WindowLayer(DynamicLayer):
    """Sinks + the most recent tokens; older ones are evicted after each update (positions kept)."""

    is_croppable = False

    def __init__(self, window: int, sinks: int):
        super().__init__()
        self.window, self.sinks, self.seen = window, sinks, 0

    def get_seq_length(self) -> int:
        return int(self.keys.shape[-2]) if self.is_initialized else 0

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        self.seen += key_states.shape[-2]
        n = self.keys.shape[-2]
        if n > self.sinks + self.window:
            s, w = self.sinks, self.window
            self.keys = torch.cat([self.keys[..., :s, :], self.keys[..., n - w:, :]], dim=-2)
            self.values = torch.cat([self.values[..., :s, :], self.values[..., n - w:, :]], dim=-2)
        return keys, values


class WindowCache(Cache):
    """StreamingLLM-style dropping: ``sinks`` first tokens + the last ``window`` tokens per layer."""

    def __init__(self, model, window: int, sinks: int = SINK_TOKENS):
        self._bytes_per_token = kv_bytes_per_token(model.config, 2)
        super().__init__(layers=[WindowLayer(window, sinks) for _ in range(model.config.num_hidden_layers)])

    def stats(self) -> dict:
        lay = self.layers[0]
        held = lay.get_seq_length()
        return {"tokens": lay.seen, "raw_tokens": held, "kv_bytes": held * self._bytes_per_token,
                "raw_kv_bytes": lay.seen * self._bytes_per_token}

