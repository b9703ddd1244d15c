"""What a batch row holds of its loaded state: a :class:`ResidentPrefix`.

A resident form (kite.upcycle's registry, ``kite serve --resident``) turns a loaded state into one of
these; the batch (kite.runtime.batch_cache, kite.runtime.attention) reads it through this interface
only, whatever the form:

- ``slot_tokens()`` / ``slot_kv(layer)``: what the row's own KV slots start with (a raw prefix,
  :class:`KVPrefix`: every token, layer by layer; a prefix held beside the row: nothing,
  its slots hold the live tokens only);
- ``beside``: whether the state is attended beside the row's slots, from its own form: then
  ``attend(q, prefixes, layer, scale, plans)`` gives the attention of the rows' queries over their
  states as a part (output, log-sum-exp) that kite.kernels.partials.merge joins with the slots'
  part in one softmax;
- ``nbytes()``: the bytes it holds on its device; ``holds(layer)``, ``tokens_per_layer()``,
  ``next_position``, ``reader``: as a KVPrefix's.

``as_kv()``: the keys and values it stands for, as a KVPrefix. :class:`KVPrefix` is the raw form;
:class:`LanesPrefix` holds a state in nibble lanes (kite.kernels.lanes), read by the lanes decode
kernel on a GPU and by its torch reference elsewhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch


class ResidentPrefix(ABC):
    """A loaded state as a batch row holds it (the module docstring says what each member means).
    A form implements the abstract members; ``attend`` only when it is held ``beside`` the slots."""

    beside: ClassVar[bool] = False
    next_position: int
    reader: bool

    @property
    @abstractmethod
    def n_layers(self) -> int: ...

    @abstractmethod
    def tokens_per_layer(self) -> list[int]: ...

    @abstractmethod
    def nbytes(self) -> int: ...

    def holds(self, layer: int) -> bool:
        """Whether ``layer`` holds any of the state's tokens."""
        return self.tokens_per_layer()[layer] > 0

    def slot_tokens(self) -> list[int]:
        """Tokens the row's slots start with, per layer."""
        return [0] * self.n_layers

    def slot_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values [H, n, d] the row's slots of ``layer`` start with (None: none)."""
        return None

    @abstractmethod
    def as_kv(self) -> KVPrefix:
        """The keys and values this prefix stands for, as the batch attends them (sinks and decoded
        rows for a coded form), as a KVPrefix: what a test checks the form's attention against."""

    @classmethod
    def attend(cls, q: torch.Tensor, prefixes: list, layer: int, scale: float,
               plans: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q [n, Hq, q_len, d] (row i's queries after ``prefixes[i]``, every one of its
        tokens visible) over layer ``layer`` of each row's state: (out [n, Hq, q_len, d], lse
        [n, Hq, q_len]) float32. ``plans``: what the form builds once per layer and set of rows (kept
        by the batch cache until its rows change). Only for forms attended ``beside`` the slots."""
        raise TypeError(f"{cls.__name__} is attended in the row's slots, not beside them")


@dataclass
class KVPrefix(ResidentPrefix):
    """Post-RoPE keys and values to place in front of the live tokens, layer by layer: the raw
    resident form (a batch row's slots start with them).

    keys[l] / values[l]: [H_kv, P_l, d] (P_l may differ per layer, 0 for a layer left out).
    `next_position` is where the first live token sits: the document's length, whatever was
    loaded (invariant 2: loaded tokens keep their positions; absent ones leave a gap).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    next_position: int
    reader: bool = False   # made for the model's reader adapter: generation switches it on after it

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    def tokens_per_layer(self) -> list[int]:
        return [int(k.shape[-2]) for k in self.keys]

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in zip(self.keys, self.values))

    def slot_tokens(self) -> list[int]:
        return self.tokens_per_layer()

    def slot_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.keys[layer], self.values[layer]

    def as_kv(self) -> KVPrefix:
        return self


@dataclass
class LanesPrefix(ResidentPrefix):
    """A state held in nibble lanes beside its row: per layer a kite.kernels.lanes.Lanes of one state
    (its coded rows, then its sinks; keys post-RoPE), None where the layer holds nothing."""

    layers: list                 # list[Lanes | None]
    next_position: int
    reader: bool = False
    _tokens: list[int] | None = field(default=None, init=False, repr=False, compare=False)

    beside: ClassVar[bool] = True

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def tokens_per_layer(self) -> list[int]:
        """(Counted once: a layer's coded length lives on its device, and each read of it waits for
        the device; a batch asks at every sequence's end, a server's step ended 152 at once.)"""
        if self._tokens is None:
            lengths = [x.length[:1] for x in self.layers if x is not None]
            coded = iter(torch.cat(lengths).tolist() if lengths else [])      # one transfer, not one a layer
            self._tokens = [0 if x is None else int(next(coded)) + int(x.raw_k.shape[2]) for x in self.layers]
        return list(self._tokens)

    def holds(self, layer: int) -> bool:
        return self.layers[layer] is not None

    def nbytes(self) -> int:
        """Bytes the lanes' tensors occupy on their device, every layer."""
        return sum(t.numel() * t.element_size() for x in self.layers if x is not None
                   for t in (getattr(x, f.name) for f in fields(x)) if torch.is_tensor(t))

    def as_kv(self) -> KVPrefix:
        from kite.kernels import lanes as L

        held = [x for x in self.layers if x is not None]
        none = held[0].raw_k[0, :, :0].float() if held else torch.zeros(0, 0, 0)    # [H, 0, d]
        keys, values = [], []
        for x in self.layers:
            n = 0 if x is None else x.raw_k.shape[2] + int(x.length[0])
            keys.append(L.decode(x, "k")[0, :, :n] if x is not None else none)
            values.append(L.decode(x, "v")[0, :, :n] if x is not None else none)
        return KVPrefix(keys, values, self.next_position, self.reader)

    @classmethod
    def attend(cls, q, prefixes, layer, scale, plans):
        """On a GPU, with lanes of >= 32 a row (head_dim >= 64 at 4 bits): the lanes kernel
        (kite.kernels.lanes_triton, :func:`lanes_kernel_attend`) over a pointer table to the rows'
        states, made once per layer, set of rows and chunks of query tokens a row (kept in ``plans``);
        otherwise the torch reference, row by row."""
        from kite.kernels import lanes as L

        layers = [p.layers[layer] for p in prefixes]
        if q.is_cuda and _kernel_reads(layers):
            return lanes_kernel_attend(q, layers, scale, plans, (cls.__name__, layer, tuple(id(p) for p in prefixes)))
        parts = [L.lanes_partial(q[i:i + 1], x, scale) for i, x in enumerate(layers)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def lanes_kernel_attend(q: torch.Tensor, layers: list, scale: float, plans: dict, key) -> tuple[torch.Tensor, torch.Tensor]:
    """The lanes kernel's attention of q [n, Hq, T, d] over the states ``layers`` (one kite.kernels.lanes.Lanes
    a row, sinks included): (out [n, Hq, T, d], lse [n, Hq, T]) float32. Every state token precedes every
    query token (no mask): a row's T tokens are read as more query heads of its state, a chunk of them
    an entry of the plan (kite.kernels.lanes_triton.lanes_attend_tokens); the plans are kept in
    ``plans`` under ``key`` and the chunks a state."""
    from kite.kernels.lanes_triton import LanesPlan, lanes_attend_tokens

    def plan_for(chunks: int):
        if (*key, chunks) not in plans:
            plans[(*key, chunks)] = LanesPlan([x for x in layers for _ in range(chunks)])
        return plans[(*key, chunks)]

    return lanes_attend_tokens(q, plan_for, scale, layers[0].k_codes.shape[1])


def _kernel_reads(layers) -> bool:
    try:
        from kite.kernels.lanes_triton import kernel_reads
    except ImportError:     # no Triton: the reference
        return False
    return kernel_reads(layers)
