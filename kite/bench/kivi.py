"""KIVI-style int-N quantization of a whole cache at a byte budget.

Keys are quantized per channel (groups of `group_size` tokens), values per token (groups of
`group_size` channels), as KIVI does; the most recent tokens stay in fp16 (KIVI's residual).
The largest N in (8, 4, 3, 2) whose quantized cache fits the budget is taken, and the bytes left
buy fp16 residual tokens. When even int2 of every token does not fit, the oldest tokens are
dropped (and the report says so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kite.runtime.cache import KVPrefix
from kite.upcycle.codec import QTensor, dequantize, quantize, tensors_nbytes

BITS = (8, 4, 3, 2)


@dataclass
class KiviCache:
    bits: int
    quantized: list[tuple[QTensor, QTensor] | None]  # per layer: keys, values of the old tokens
    residual: KVPrefix  # fp16 recent tokens (post-RoPE), every layer
    first_token: int  # tokens before this were dropped (0 normally)
    n_quantized: int
    next_position: int
    nbytes: int
    note: str = ""

    def to_prefix(self) -> KVPrefix:
        """Dequantize: the cache as the model attends to it (this is the per-request load)."""
        keys, values = [], []
        for q, rk, rv in zip(self.quantized, self.residual.keys, self.residual.values):
            if q is None:
                keys.append(rk)
                values.append(rv)
                continue
            k = dequantize(q[0], rk.dtype)
            v = dequantize(q[1], rv.dtype)
            keys.append(torch.cat([k, rk], dim=1))
            values.append(torch.cat([v, rv], dim=1))
        return KVPrefix(keys, values, next_position=self.next_position)


def _quant(k: torch.Tensor, v: torch.Tensor, bits: int, group_size: int) -> tuple[QTensor, QTensor]:
    return (quantize(k.float(), f"int{bits}", group_size=group_size, axis=-2),
            quantize(v.float(), f"int{bits}", group_size=group_size, axis=-1))


def _cost(full: KVPrefix, start: int, n_q: int, bits: int, group_size: int) -> int:
    """Bytes of int-`bits` for tokens [start, start+n_q) plus fp16 for the rest after them."""
    total = 0
    for k, v in zip(full.keys, full.values):
        if n_q > 0:
            qk, qv = _quant(k[:, start:start + n_q], v[:, start:start + n_q], bits, group_size)
            total += tensors_nbytes(qk.tensors) + tensors_nbytes(qv.tensors)
        rest = k.shape[1] - start - n_q
        total += 2 * rest * k.shape[0] * k.shape[2] * 2
    return total


def _layer_cost(full: KVPrefix, start: int, n_q: int, bits: int, group_size: int) -> int:
    # every layer has the same shape: one layer's cost times the number of layers
    one = KVPrefix(full.keys[:1], full.values[:1], full.next_position)
    return _cost(one, start, n_q, bits, group_size) * len(full.keys)


def kivi_at_budget(full: KVPrefix, budget_bytes: int, group_size: int = 32) -> KiviCache:
    """The KIVI cache of `full` that spends at most `budget_bytes` (as close to it as tokens allow)."""
    T = int(full.keys[0].shape[1])
    note = ""
    bits = next((b for b in BITS if _layer_cost(full, 0, T, b, group_size) <= budget_bytes), None)
    start = 0
    if bits is None:
        bits = BITS[-1]
        per_tok = _layer_cost(full, 0, T, bits, group_size) / T
        start = min(T - 1, T - int(budget_bytes // per_tok))
        while start < T - 1 and _layer_cost(full, start, T - start, bits, group_size) > budget_bytes:
            start += max(1, (T - start) // 100)
        note = f"int2 of every token exceeds the budget: the oldest {start} tokens were dropped"
    # fp16 residual from the bytes left: the largest residual r that still fits
    lo, hi = 0, T - start  # residual tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _layer_cost(full, start, T - start - mid, bits, group_size) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    r = lo
    n_q = T - start - r
    quantized, rk, rv = [], [], []
    for k, v in zip(full.keys, full.values):
        quantized.append(_quant(k[:, start:start + n_q], v[:, start:start + n_q], bits, group_size)
                         if n_q > 0 else None)
        rk.append(k[:, start + n_q:].half().to(k.dtype))
        rv.append(v[:, start + n_q:].half().to(v.dtype))
    nbytes = _layer_cost(full, start, n_q, bits, group_size)
    return KiviCache(bits, quantized, KVPrefix(rk, rv, full.next_position), start, n_q,
                     full.next_position, nbytes, note)
