"""Tokens a batch row keeps outside the batch's buffers, still attended: the interface between the
batched decoder and a memory-budgeted sequence (kite.upcycle.budget.BudgetRow codes them in blocks).

After every forward the decoder offers each layer's raw tokens past the row's sinks to the row's
memory; what it takes leaves the row's slots. At every forward the memory hands back, per layer,
what it holds as keys and values (post-RoPE, at their original positions), which every new token
of the row sees besides the row's own slots. Attention does not depend on the order of the keys,
so holding the oldest tokens apart changes nothing but where they are kept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class RowMemory(ABC):
    """Where a row's older tokens go (see the module doc)."""

    sink_tokens: int    # the row's first slots, never offered
    prefill_chunk: int  # prompt tokens fed per step (the memory takes tokens between forwards)
    max_slots: int      # the most slots the row needs, a forward's new tokens included

    @abstractmethod
    def offer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        """The layer's raw tokens after the sinks, [H, W, d] post-RoPE, oldest first: take the oldest
        that the memory keeps from here on; returns how many (they leave the row's slots)."""

    @abstractmethod
    def held(self, layer: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What the memory holds of ``layer`` as ([H, n, d], [H, n, d]) post-RoPE keys and values at
        ``dtype`` on ``device``, or None while it holds nothing."""

    @abstractmethod
    def observe(self, *, seen: int, raw_tokens: list[int], held_raw_bytes: int) -> None:
        """What the row holds after a forward and the offers: ``seen`` tokens fed in all, its slots
        per layer (``raw_tokens``), their bytes at the buffer's dtype (for the memory's report)."""
