"""KITE's attention function, registered with transformers' AttentionInterface as "kite".

transformers builds one causal mask from layer 0's cache length, which assumes every layer holds
the same number of past tokens. A loaded state can give each layer a different prefix (clusters
or layers left out), so this function makes its own mask when the one it is handed does not fit:
every cached token precedes the new ones (positions are kept), so the right mask is causal
aligned to the bottom-right corner.

On a GPU a short query after a long cached prefix (a first forward over a loaded state, a decode
step) goes to the split-KV kernel (kite.kernels.split_attention_triton): the keys split across thread
blocks and merged by log-sum-exp, where one fused kernel would leave most of the GPU idle. A longer
one (a state's recomputed tail, a document's next chunk) attends through torch's lower-right causal
bias: flash attention, with no mask built. Where on a GPU that plain causal rule is the whole mask,
the mask function registered with it (:func:`plain_causal_mask`) builds none.

Batched decoding (kite.runtime.batch_decode) goes further: every row of the batch holds its own
state, so the visible slots differ per row and per layer. Its forward passes a
`kite.runtime.batch_cache.BatchStep` under the keyword BATCH_KWARG, which transformers hands on to
this function untouched; the step's per-(row, layer) mask replaces whatever mask came with the call.
A step feeding a row a prompt (CAUSAL_ROWS_MIN_QUERY tokens or more, no row keeping tokens apart or
a state beside its slots) attends a row at a time, causal from the bottom-right corner, with no mask
(flash attention on a GPU): a 16K-token prompt's masks took 7.5 GB for Qwen2-7B's 28 layers, and
its prefill through them 2.8 s on an H200, 9.3x the prefill's floor.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

NAME = "kite"
BATCH_KWARG = "kite_batch"   # the model forward's keyword for a BatchStep
# A short query after a long cached prefix (a first forward over a loaded state, a decode step) runs
# the split-KV kernel on a GPU; False keeps the fused sdpa path everywhere (benchmarks compare both).
SPLIT_KV = True
SPLIT_MIN_KEYS = 1024
# On a GPU a longer query after cached tokens (a state's recomputed tail, a long prompt over a loaded
# state) attends through torch's lower-right causal bias (flash attention, no mask built); False
# folds it through a dense bottom-right mask as before (benchmarks compare both: a 256-token tail after
# 16K tokens at Qwen2-7B geometry on an H100, 37.0 ms against 44.2, gpu_speed_h100_20261206_c6b10a6_tail.json)
LOWER_RIGHT = True
# a batch step feeding at least this many tokens to a row (a prompt's prefill) attends a row at a time,
# causal from the bottom-right corner (flash attention on a GPU), instead of through a mask per row
CAUSAL_ROWS_MIN_QUERY = 128
# on a CPU, a step whose rows' own keys are at most (1 - this) of the padded batch's attends a row at
# a time over its own keys only (ragged_rows: rows after a long state beside short prompts)
RAGGED_SAVING = 0.25
_registered = False
_triton: bool | None = None
_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def masked_sdpa(query, key, value, **kw) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with a boolean mask (or none); on a GPU with cuDNN's fused
    attention left out. torch 2.11 chose cuDNN for the masked prefills of a document's chunks on the H200, and
    those calls took 100 ms of host time in 180 calls for 7.4 ms of GPU work (a profile of a training
    state's stages, 2026-12-04); memory-efficient attention took the same calls in 37 ms of host time
    for 15 ms of GPU work. (Unmasked and causal calls keep torch's choice: not measured.)"""
    if not query.is_cuda:
        return F.scaled_dot_product_attention(query, key, value, **kw)
    with sdpa_kernel(_NOT_CUDNN):
        return F.scaled_dot_product_attention(query, key, value, **kw)


def kite_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B, Hq, q, d], key/value [B, Hkv, k, d] → ([B, q, Hq, d], None)."""
    batch = kwargs.get(BATCH_KWARG)
    if batch is not None:
        if query.shape[-2] >= CAUSAL_ROWS_MIN_QUERY and batch.causal_rows():
            return causal_rows(query, key, value, batch, module.layer_idx, scaling), None
        if query.shape[-2] == 1 and not query.is_cuda and batch.causal_rows():
            out = decode_rows(query, key, value, batch.limits[module.layer_idx][:, 0], scaling)
            if out is not None:
                return out, None
        held = batch.held(module.layer_idx, key.dtype, key.device) if batch.memories else None
        mask = batch.mask(module.layer_idx, key.shape[-2])
        need = _ragged(query, key, batch, module.layer_idx)
        if need is not None:
            return ragged_rows(query, key, value, mask, need, scaling), None
        out, _ = batch_attention(query, key, value, mask, scaling, held)
        if batch.beside:
            beside_rows(out, query, key, value, mask, scaling, batch, module.layer_idx)
        return out, None
    q_len, k_len = query.shape[-2], key.shape[-2]
    mask = attention_mask
    if mask is not None:
        if mask.shape[-1] < k_len or mask.shape[-2] != q_len:
            mask = None  # made for another layer's length: build our own below
        else:
            # made for a longer prefix (layer 0's): its last k_len columns are this layer's (the
            # new tokens come last, every cached one before them); its first k_len would give a
            # layer with a shorter prefix a mask with no causal part
            mask = mask[..., -k_len:]
    # (never where autograd reaches through the attention, a reader adapter's training: the kernel has
    # no backward, and the query projections' LoRA would get no gradient)
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if not grad and _splits_keys(query, key, mask, dropout):
        # a short query after a long cached prefix on a GPU: the keys split across thread blocks
        from kite.kernels.split_attention_triton import split_kv_attention

        return split_kv_attention(query, key, value, mask, scaling), None
    is_causal = False
    if mask is None and q_len > 1 and q_len != k_len and LOWER_RIGHT and query.is_cuda and not grad:
        return lower_right_sdpa(query, key, value, scaling, dropout).transpose(1, 2).contiguous(), None
    if mask is None and q_len > 1:
        if q_len == k_len:
            is_causal = True
        else:
            # bottom-right causal, shaped [1, 1, q, k] as a model's own masks are: GQA queries fold
            # below (no copies of the KV heads, and cuDNN's fused kernel left out)
            offset = k_len - q_len
            rows = torch.arange(q_len, device=query.device).unsqueeze(1)
            cols = torch.arange(k_len, device=query.device).unsqueeze(0)
            mask = (cols <= rows + offset)[None, None]
    if (mask is not None and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1 and not dropout
            and key.shape[1] != query.shape[1]):
        # a query after cached tokens (a loaded state): the query heads of a KV head folded into the
        # query length, so the fused kernels read each KV head once instead of copies per query head
        mask = mask.expand(query.shape[0], 1, q_len, k_len)
        return _folded_attention(query, key, value, mask, scaling), None
    if key.shape[1] != query.shape[1]:
        rep = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal,
                                         dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def batch_attention(query, key, value, mask, scaling=None, held=None):
    """Attention of a batch step: query [B, Hq, q, d], key/value [B, Hkv, k, d] (views of the batch
    cache), mask [B, 1, q, k] bool → ([B, q, Hq, d], None). ``held``: batch index -> ([Hkv, n, d],
    [Hkv, n, d]), tokens that row keeps apart (kite.runtime.row_memory), seen by all its new tokens.

    The query heads that share a KV head are folded into the query length ([B, Hkv, rep·q, d]), so
    the keys and values are read where they lie instead of being copied once per query head.
    """
    out = _folded_attention(query, key, value, mask, scaling)
    for b, (hk, hv) in (held or {}).items():
        # the row's own attention over [held, its slots]: one softmax over both
        n = hk.shape[-2]
        seen = torch.ones((1, 1, mask.shape[-2], n), dtype=torch.bool, device=mask.device)
        row = _folded_attention(query[b:b + 1], torch.cat([hk[None], key[b:b + 1]], dim=-2),
                                torch.cat([hv[None], value[b:b + 1]], dim=-2),
                                torch.cat([seen, mask[b:b + 1]], dim=-1), scaling)
        out[b] = row[0]
    return out, None


def _ragged(query, key, batch, layer: int) -> list[int] | None:
    """On a CPU, each row's keys to read (its last new token's visible slots) when reading only those,
    a row at a time, skips at least RAGGED_SAVING of the batch's padded keys: rows after a long state
    beside rows of a short prompt. None: one batched call reads them all (a GPU, rows of like
    lengths, rows that keep tokens apart or hold their state beside their slots)."""
    if query.is_cuda or not batch.causal_rows() or query.shape[0] < 2:
        return None
    need = batch.limits[layer].amax(dim=1).tolist()
    return need if sum(need) <= (1.0 - RAGGED_SAVING) * len(need) * key.shape[-2] else None


def decode_rows(query, key, value, visible: torch.Tensor, scaling=None) -> torch.Tensor | None:
    """A CPU batch's decode step (one new token a row) through the native runtime: row b over its first
    ``visible[b]`` slots of ``key``/``value`` [B, Hkv, k, d] (views of the batch cache), every (row, KV
    head) one task of the thread team, a row's sums the same whatever rows are beside it → [B, 1, Hq, d];
    None where the runtime is not built or the tensors are not float32 with contiguous head dimensions
    (the caller then attends as before)."""
    from kite.kernels import native

    lib = native.cpu()
    if (lib is None or query.dtype != torch.float32 or key.dtype != torch.float32 or value.dtype != torch.float32
            or key.stride(-1) != 1 or value.stride(-1) != 1):
        return None
    B, hq, _, d = query.shape
    lens = visible.to(torch.int64).contiguous()
    if int(lens.max()) > min(key.shape[-2], value.shape[-2]):
        raise ValueError(f"a row sees {int(lens.max())} slots of the {key.shape[-2]} given")
    q = query.reshape(B, hq, d).contiguous()
    out = torch.empty(B, hq, d, dtype=torch.float32)
    scale = d ** -0.5 if scaling is None else scaling
    native.check(lib.kite_decode_attention(q.data_ptr(), key.data_ptr(), value.data_ptr(), *key.stride()[:3],
                                           *value.stride()[:3], lens.data_ptr(), out.data_ptr(), B, hq, key.shape[1],
                                           d, scale, torch.get_num_threads()), "decode_attention")
    return out.view(B, 1, hq, d)


def ragged_rows(query, key, value, mask, need: list[int], scaling=None) -> torch.Tensor:
    """A batch step's attention a row at a time, row b over its first ``need[b]`` slots only (``mask``
    [B, 1, q, k] as for :func:`batch_attention`; the same result, the padding not read) → [B, q, Hq, d]."""
    B, hq, q, d = query.shape
    out = query.new_empty(B, q, hq, d)
    for b, n in enumerate(need):
        n = max(1, int(n))
        # one new token a row (a decode step) sees every one of its first n slots: no mask to build
        out[b] = _folded_attention(query[b:b + 1], key[b:b + 1, :, :n], value[b:b + 1, :, :n],
                                   None if q == 1 else mask[b:b + 1, ..., :n], scaling)[0]
    return out


def causal_rows(query, key, value, batch, layer: int, scaling=None) -> torch.Tensor:
    """A batch step's attention a row at a time: row b's ``n_b`` new tokens over its ``lengths[layer, b]``
    slots before them and each other, causal from the bottom-right corner (torch's lower-right causal
    bias: flash attention where it runs, no mask built); query [B, Hq, q, d], key/value [B, Hkv, k, d]
    → [B, q, Hq, d]. A padded position's output is zero: its keys are not written and its logits dropped."""
    B, hq, q, d = query.shape
    out = query.new_zeros(B, q, hq, d)
    for b, n in enumerate(batch.new_tokens):
        k = int(batch.lengths[layer, b]) + n
        o = lower_right_sdpa(query[b:b + 1, :, :n], key[b:b + 1, :, :k], value[b:b + 1, :, :k], scaling)
        out[b, :n] = o[0].transpose(0, 1)
    return out


def beside_rows(out, query, key, value, mask, scaling, batch, layer: int) -> None:
    """Rows whose state is held beside their slots (``batch.beside``: batch index -> a
    kite.runtime.resident.ResidentPrefix): their output ``out[b]`` [q, Hq, d] becomes one softmax over
    the state (its form's ``attend``, rows of one form together) and the row's own slots (``mask``)."""
    from kite.kernels.partials import merge, raw_partial

    rows = [b for b in sorted(batch.beside) if batch.beside[b].holds(layer)]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    for form in sorted({type(batch.beside[b]) for b in rows}, key=lambda t: t.__name__):
        these = [b for b in rows if type(batch.beside[b]) is form]
        idx = torch.tensor(these, device=query.device)
        q = query[idx]                                                       # [n, Hq, q, d]
        raw = raw_partial(q, key[idx], value[idx], scaling, mask[idx])       # the rows' own slots
        o, lse = form.attend(q, [batch.beside[b] for b in these], layer, scaling, batch.plans)
        merged, _ = merge([(o, lse), raw])                                   # [n, Hq, q, d]
        out[idx] = merged.transpose(1, 2).to(out.dtype)


def _splits_keys(query, key, mask, dropout) -> bool:
    """Whether a query goes to the split-KV kernel (kite.kernels.split_attention_triton): on a GPU, in
    fp16 / bf16, a query whose folded rows (query heads of a KV head x tokens) fit one tile after at least
    SPLIT_MIN_KEYS keys, with no mask (the bottom-right causal rule) or a boolean one shared by the heads."""
    global _triton
    q_len, d = query.shape[-2], query.shape[-1]
    rows = q_len * (query.shape[1] // key.shape[1])
    if not (SPLIT_KV and query.is_cuda and not dropout and query.dtype in (torch.float16, torch.bfloat16)
            and key.dtype == query.dtype and d in (16, 32, 64, 128) and rows <= 128
            and key.shape[-2] >= max(SPLIT_MIN_KEYS, 8 * q_len) and query.shape[1] % key.shape[1] == 0):
        return False
    if mask is not None and not (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
                                 and mask.shape[0] in (1, query.shape[0])):
        return False
    if _triton is None:
        try:
            import triton  # noqa: F401
            _triton = True
        except ImportError:
            _triton = False
            logging.getLogger("kite.runtime").warning(
                "Triton is not installed: attention after a long cache runs the fused sdpa kernel, not the "
                "split-KV one (pip install triton for the faster first forward)")
    return _triton


def lower_right_sdpa(query, key, value, scaling=None, dropout: float = 0.0) -> torch.Tensor:
    """query [B, Hq, q, d] after the cached keys [B, Hkv, k, d]: causal from the bottom-right corner
    through torch's lower-right causal bias (flash attention where it runs, no mask built, the KV heads
    shared without copies) → [B, Hq, q, d]."""
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(query.shape[-2], key.shape[-2]),
                                          dropout_p=dropout, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])


def plain_causal_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                      mask_function=None, attention_mask=None, local_size=None, allow_is_causal_skip: bool = True,
                      device="cpu", **kwargs):
    """transformers' mask for "kite" (its AttentionMaskInterface): None where :func:`lower_right_only`
    says the mask is the plain bottom-right causal one that :func:`kite_attention` runs without a
    mask; otherwise transformers' own sdpa mask (which skips the masks it can itself)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    if lower_right_only(q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, local_size,
                        allow_is_causal_skip, device):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, device=device, **kwargs)


def lower_right_only(q_length: int, kv_length: int, q_offset, kv_offset, mask_function, attention_mask, local_size,
                     allow_is_causal_skip: bool, device) -> bool:
    """Whether a mask transformers asks for is what :func:`lower_right_sdpa` applies without one: on a GPU,
    with LOWER_RIGHT, several new tokens after cached ones (a decode step and a prompt alone are
    transformers' own skips), the causal rule alone (nothing added, no window), the new tokens the
    last ones, no padding (not read while a graph is captured or compiled)."""
    from transformers.masking_utils import causal_mask_function
    from transformers.utils import is_tracing

    return (LOWER_RIGHT and torch.device(device).type == "cuda" and 1 < q_length < kv_length and allow_is_causal_skip
            and mask_function is causal_mask_function and local_size is None
            and isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset + q_length == kv_offset + kv_length
            and (attention_mask is None or (not is_tracing(attention_mask) and bool(attention_mask.all()))))


def _folded_attention(query, key, value, mask, scaling=None) -> torch.Tensor:
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    rep = hq // hkv
    if rep > 1:
        query = query.reshape(b, hkv, rep * q, d)   # head h = g·rep + r → group g, row r·q + j
        mask = mask.repeat(1, 1, rep, 1) if mask is not None else None
    out = masked_sdpa(query, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, q, d).transpose(1, 2).contiguous()


def register() -> str:
    """Register "kite" for attention and masks (idempotent); returns the implementation name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(NAME, kite_attention)
        # Standard masks where they fit (padding in batched plain inference keeps working); none where
        # the plain bottom-right causal rule is the whole mask.
        AttentionMaskInterface.register(NAME, plain_causal_mask)
        _registered = True
    return NAME
