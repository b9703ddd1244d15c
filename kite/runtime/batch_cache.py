"""The KV cache of a batch of sequences that each carry their own loaded state.

One preallocated buffer per layer, [rows, H_kv, capacity, d], on the model's device and dtype.
A row belongs to one sequence: in each layer it holds that sequence's prefix for the layer
(a `KVPrefix` may give every layer a different number of tokens, even none) followed by its live
tokens, contiguous from slot 0; `lengths[layer, row]` says how many slots are filled. Rows and
capacity grow on demand up to `max_rows` and a KV byte budget, which a scheduler reads
(`bytes_in_use`, `bytes_reserved`, `bytes_for`) to decide what to admit.

The HF model takes this object as its cache: inside a forward opened with `open_step`, each
attention layer calls `update(k, v, layer_idx)`, which writes each row's new keys and values into
that row's own next slots of the layer and hands back the rows' buffers. Which slot each new token
may see differs per row and per layer; the `BatchStep` that `open_step` returns says which (each
new token's limit, a mask made per layer when the attention needs one), and the forward passes it to
KITE's attention (kite.runtime.attention.BATCH_KWARG).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kite.errors import KiteError
from kite.runtime.resident import ResidentPrefix
from kite.runtime.row_memory import RowMemory

_ALIGN = 64   # capacity grows in whole blocks of slots (fewer regrowths, steadier shapes)


def round_capacity(slots: int) -> int:
    """`slots` rounded up to whole blocks of capacity."""
    return -(-slots // _ALIGN) * _ALIGN


class BatchFull(KiteError):
    """No room for another sequence now: every row is taken, or its KV would pass the byte budget.
    A scheduler keeps the request waiting and tries again after a sequence leaves."""


@dataclass
class BatchStep:
    """One forward over some rows of a `BatchKVCache`: where each row's new tokens go and what
    each of them may see.

    rows: the cache rows, in batch order. new_tokens[b]: how many real tokens row b feeds (the
    batch is right-padded to the longest; padded positions are neither written nor seen).
    """

    rows: list[int]
    new_tokens: list[int]
    lengths: torch.Tensor        # [layers, B] filled slots before the step (CPU, int64)
    kv_lengths: list[int]        # per layer: the slots the attention reads (longest row after the step)
    limits: torch.Tensor         # [layers, B, q] on the device: new token j of row b sees the slots below limits[l, b, j]
    row_index: torch.Tensor      # [B] `rows` on the device
    write_rows: torch.Tensor     # [N] cache row of each real new token (N = sum(new_tokens))
    write_slots: torch.Tensor    # [layers, N] its slot in each layer
    real: torch.Tensor | None    # [B, q] bool: which (row, j) are real tokens; None when all are
    row_range: tuple[int, int] | None   # (first, end) when `rows` is a consecutive run: views, no copies
    memories: dict[int, RowMemory] = field(default_factory=dict)   # batch index -> its older tokens
    beside: dict[int, ResidentPrefix] = field(default_factory=dict)   # batch index -> its state held beside its slots
    plans: dict = field(default_factory=dict)   # what those states' forms build per layer and rows, kept by the cache

    def held(self, layer: int, dtype: torch.dtype, device) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The older tokens of the rows that keep some apart (kite.runtime.row_memory), by batch
        index: ([H, n, d], [H, n, d]) post-RoPE, visible to every new token of that row."""
        out = {}
        for b, memory in self.memories.items():
            kv = memory.held(layer, dtype, device)
            if kv is not None:
                out[b] = kv
        return out

    @property
    def query_length(self) -> int:
        return int(self.limits.shape[-1])

    def mask(self, layer: int, kv_length: int) -> torch.Tensor:
        """[B, 1, q, kv_length] bool: slot k of row b is visible to its new token j iff
        k < lengths[layer, b] + j + 1 (a padded j sees what the row's last real token sees); made
        for the layer when asked (a 16K-token prompt's masks of every layer at once took gigabytes)."""
        slots = torch.arange(kv_length, device=self.limits.device)
        return (slots[None, None, None, :] < self.limits[layer][:, None, :, None])

    def causal_rows(self) -> bool:
        """Whether each row's new tokens see exactly the row's own slots before them and each other
        causally (no row keeps tokens apart or holds its state beside its slots): attention then runs
        a row at a time, causal from the bottom-right corner, with no mask built."""
        return not self.memories and not self.beside

    def placeholder_mask(self) -> torch.Tensor:
        """A 4-D attention_mask for the model's forward: transformers hands a 4-D mask on as it is
        instead of building its own causal one (which assumes every row and layer has the same
        length); KITE's attention ignores it and takes `mask(layer)` instead."""
        return torch.zeros((len(self.rows), 1, self.query_length, 0), dtype=torch.bool,
                           device=self.limits.device)


class BatchKVCache:
    """Per-layer KV buffers for up to `max_rows` sequences (see the module docstring).

    max_bytes: budget for the buffers (K and V of every layer); growth past it raises BatchFull.
    Not thread-safe: one scheduler thread takes rows, frees them and runs the steps. Whatever
    changes the buffers or lengths runs in inference mode: the forwards do, and a tensor made
    there may only be changed there.
    """

    is_compileable = False   # transformers asks: per-row lengths change shapes every step

    def __init__(self, model, max_rows: int, *, max_bytes: int | None = None, capacity: int = _ALIGN):
        if max_rows < 1:
            raise ValueError("max_rows must be at least 1")
        config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
        param = next(model.parameters())
        self.n_layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.device, self.dtype = param.device, param.dtype
        self.max_rows, self.max_bytes = max_rows, max_bytes
        self.slot_bytes = 2 * self.n_layers * self.kv_heads * self.head_dim * param.element_size()
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths = torch.zeros((self.n_layers, 0), dtype=torch.long)
        self.taken: list[bool] = []
        self.beside: dict[int, ResidentPrefix] = {}   # row -> its state, held beside its slots in its own form
        self.plans: dict = {}                         # what those forms build for a step's rows, until rows change
        self._step: BatchStep | None = None
        self._reserve(1, capacity)

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def rows_allocated(self) -> int:
        return len(self.taken)

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2])

    def bytes_reserved(self) -> int:
        """Bytes the buffers occupy now (K and V, every layer)."""
        return self.bytes_for(self.rows_allocated, self.capacity)

    def bytes_in_use(self) -> int:
        """Bytes of the filled slots (prefixes and live tokens of every taken row)."""
        return int(self.lengths.sum()) * self.slot_bytes // self.n_layers

    def bytes_for(self, rows: int, capacity: int) -> int:
        """Bytes buffers of `rows` × `capacity` slots would occupy."""
        return rows * capacity * self.slot_bytes

    def free_rows(self) -> int:
        return self.max_rows - sum(self.taken)

    def next_row(self) -> int | None:
        """The row `take` would give now (the lowest free one), or None when all are taken."""
        for row, taken in enumerate(self.taken):
            if not taken:
                return row
        return self.rows_allocated if self.rows_allocated < self.max_rows else None

    def row_lengths(self, row: int) -> list[int]:
        return self.lengths[:, row].tolist()

    # -- rows ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def take(self, prefix: ResidentPrefix | None = None) -> int:
        """A free row for a new sequence, seeded with `prefix` (kite.runtime.resident: a KVPrefix's
        layer l fills slots 0…P_l-1; a prefix held `beside` stays in its own form beside the row, whose
        slots then hold only live tokens); raises BatchFull when there is none or its prefix passes
        the budget."""
        if self._step is not None:
            raise RuntimeError("rows change between steps, not during one")
        row = self.next_row()
        if row is None:
            raise BatchFull(f"all {self.max_rows} rows of the batch are taken")
        counts = [0] * self.n_layers
        if prefix is not None:
            if prefix.n_layers != self.n_layers:
                raise ValueError(f"prefix has {prefix.n_layers} layers, the model {self.n_layers}")
            counts = prefix.slot_tokens()
        self._reserve(row + 1, max(counts))
        for layer, n in enumerate(counts):
            if n:
                k, v = prefix.slot_kv(layer)
                self.keys[layer][row, :, :n] = k.to(self.device, self.dtype)
                self.values[layer][row, :, :n] = v.to(self.device, self.dtype)
        self.lengths[:, row] = torch.tensor(counts, dtype=torch.long)
        self.taken[row] = True
        if prefix is not None and prefix.beside:
            self.beside[row] = prefix
        self.plans.clear()
        return row

    @torch.inference_mode()
    def free_many(self, rows: list[int]) -> dict[int, int]:
        """The sequences in `rows` left (in one step, as a batch's often do): their rows are free for
        the next ones (slots not cleared: lengths say what is filled, and a new sequence overwrites them).

        The taken rows stay packed at the bottom: each remaining row above the packed ones moves down
        into a freed row below them, the highest into the lowest (its filled slots copied once, every
        move of a layer in one copy); {old index: new index} of the rows that moved, for the caller to
        follow their sequences there. A row that leaves never moves. Packed rows make a step's rows one
        slice of the buffers; rows with gaps would be gathered, a copy of every row's keys and values
        in every layer of every step (21-34 ms a step for 8 rows of ~870 slots of the embedded model
        on 2 cores: benchmarks/batch_step_threads.py), where a move copies one row once."""
        if self._step is not None:
            raise RuntimeError("rows change between steps, not during one")
        gone = set(rows)
        for row in gone:
            if not self.taken[row]:
                raise ValueError(f"row {row} is not taken")
        for row in gone:
            self.taken[row] = False
        self.lengths[:, sorted(gone)] = 0
        kept = [r for r, taken in enumerate(self.taken) if taken]
        holes = [r for r in range(len(kept)) if not self.taken[r]]          # ascending
        movers = [r for r in reversed(kept) if r >= len(kept)]               # descending
        moves = dict(zip(movers, holes))
        if moves:
            src, dst = list(moves), list(moves.values())
            n = int(self.lengths[:, src].max())
            if n:
                s = torch.tensor(src, device=self.device)
                d = torch.tensor(dst, device=self.device)
                for store in (self.keys, self.values):
                    for buf in store:
                        buf[d, :, :n] = buf[s, :, :n]
            self.lengths[:, dst] = self.lengths[:, src]
            self.lengths[:, src] = 0
            for old, new in moves.items():
                self.taken[new], self.taken[old] = True, False
        held = False
        for row in gone:
            held |= self.beside.pop(row, None) is not None
        for old, new in moves.items():
            if old in self.beside:
                self.beside[new] = self.beside.pop(old)
        if held or moves:
            self.plans.clear()
        return moves

    @torch.inference_mode()
    def drop_slots(self, row: int, layer: int, start: int, n: int) -> None:
        """Remove slots start…start+n-1 of `row` in `layer` (their tokens went to the row's memory):
        the later slots move down, positions unchanged (RoPE is already in the keys)."""
        if self._step is not None:
            raise RuntimeError("rows change between steps, not during one")
        end = int(self.lengths[layer, row])
        if n <= 0 or start < 0 or start + n > end:
            raise ValueError(f"slots {start}..{start + n - 1} of a row holding {end}")
        for store in (self.keys, self.values):
            buf = store[layer]
            buf[row, :, start:end - n] = buf[row, :, start + n:end].clone()
        self.lengths[layer, row] = end - n

    def reserve(self, rows: int, slots: int) -> None:
        """Make the buffers at least ``rows`` × ``slots`` now (BatchFull past the budget)."""
        if self._step is not None:
            raise RuntimeError("the buffers change between steps, not during one")
        self._reserve(min(rows, self.max_rows), slots)

    def reserve_for(self, slots: int) -> None:
        """Make the capacity at least ``slots`` before a step whose rows will fill that many (growing
        within the budget; BatchFull past it)."""
        if self._step is not None:
            raise RuntimeError("the buffers change between steps, not during one")
        self._reserve(self.rows_allocated, slots)

    @torch.inference_mode()
    def _reserve(self, rows: int, capacity: int) -> None:
        """Make the buffers at least `rows` × `capacity` (growing by doubling, within the budget)."""
        have_rows = self.rows_allocated
        have_cap = self.capacity if self.keys else 0
        if rows <= have_rows and capacity <= have_cap:
            return
        need_rows, need_cap = max(rows, have_rows), max(have_cap, round_capacity(capacity))
        new_rows = need_rows if rows <= have_rows else min(self.max_rows, max(rows, 2 * have_rows))
        new_cap = need_cap if capacity <= have_cap else round_capacity(max(capacity, 2 * have_cap))
        if self.max_bytes is not None and self.bytes_for(new_rows, new_cap) > self.max_bytes:
            # give up the doubling before refusing: grow to what is needed, or as far as the budget allows
            if self.bytes_for(need_rows, need_cap) > self.max_bytes:
                raise BatchFull(f"KV for {need_rows} rows × {need_cap} tokens "
                                f"({self.bytes_for(need_rows, need_cap) / 2**20:.1f} MiB) passes the budget of "
                                f"{self.max_bytes / 2**20:.1f} MiB")
            fit_cap = self.max_bytes // (need_rows * self.slot_bytes) // _ALIGN * _ALIGN
            new_rows, new_cap = need_rows, max(need_cap, min(new_cap, fit_cap))
        shape = (new_rows, self.kv_heads, new_cap, self.head_dim)
        for store in (self.keys, self.values):
            for layer in range(self.n_layers):
                # zeros, not empty: a masked slot still enters q·k, and garbage NaN would leak through
                grown = torch.zeros(shape, device=self.device, dtype=self.dtype)
                if store and len(store) > layer:
                    grown[:have_rows, :, :have_cap] = store[layer]
                    store[layer] = grown
                else:
                    store.append(grown)
        self.lengths = torch.cat([self.lengths, torch.zeros((self.n_layers, new_rows - have_rows),
                                                            dtype=torch.long)], dim=1)
        self.taken += [False] * (new_rows - have_rows)

    # -- one forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def open_step(self, rows: list[int], new_tokens: list[int],
                  memories: dict[int, RowMemory] | None = None) -> BatchStep:
        """Prepare a forward in which row rows[b] feeds new_tokens[b] ≥ 1 tokens; grows the
        capacity first when a row would overflow. `memories`: batch index -> what that row keeps
        apart (attended with its slots). Close it with `close_step` after the forward."""
        if self._step is not None:
            raise RuntimeError("a step is already open")
        if not rows or len(rows) != len(new_tokens) or min(new_tokens) < 1:
            raise ValueError("every row of a step feeds at least one token")
        if not all(self.taken[r] for r in rows):
            raise ValueError("a step may only feed taken rows")
        idx = torch.tensor(rows, dtype=torch.long)
        n = torch.tensor(new_tokens, dtype=torch.long)
        before = self.lengths[:, idx]                                   # [L, B]
        after = before + n
        self._reserve(self.rows_allocated, int(after.max()))
        q = int(n.max())
        j = torch.arange(q)
        # a padded position j ≥ n_b sees what the row's last real token sees: no empty softmax row
        seen = torch.minimum(j[None, :], n[:, None] - 1)                 # [B, q]
        limit = before[:, :, None] + seen[None] + 1                      # [L, B, q]
        real = j[None, :] < n[:, None]                                   # [B, q]
        slots = (before[:, :, None] + j[None, None, :])[:, real]         # [L, N]
        first, end = rows[0], rows[-1] + 1
        step = BatchStep(
            rows=list(rows), new_tokens=list(new_tokens), lengths=before,
            kv_lengths=after.max(dim=1).values.tolist(),
            limits=limit.to(self.device),
            row_index=idx.to(self.device),
            write_rows=idx[:, None].expand(-1, q)[real].to(self.device),
            write_slots=slots.to(self.device),
            real=None if bool(real.all()) else real.to(self.device),
            row_range=(first, end) if rows == list(range(first, end)) else None,
            memories=dict(memories or {}),
            beside={b: self.beside[r] for b, r in enumerate(rows) if r in self.beside},
            plans=self.plans)
        self._step = step
        return step

    @torch.inference_mode()
    def close_step(self, commit: bool = True) -> None:
        """End the open step; `commit` (after a forward that ran) counts its tokens as filled."""
        step, self._step = self._step, None
        if step is not None and commit:
            self.advance(step.rows, step.new_tokens)

    def advance(self, rows: list[int], new_tokens) -> None:
        """Count ``new_tokens[b]`` more filled slots in every layer of row ``rows[b]`` (a forward wrote
        them). In numpy on the lengths' memory: no torch call (kite.runtime.kernel_step, KernelStep.logits)."""
        self.lengths.numpy()[:, np.asarray(rows)] += np.asarray(new_tokens, dtype=np.int64)

    # -- what transformers calls ---------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the step's new keys/values [B, H_kv, q, d] into each row's next slots of layer
        `layer_idx`; returns the rows' keys and values [B, H_kv, kv_length, d] for the attention."""
        step = self._step
        if step is None:
            raise RuntimeError("BatchKVCache is fed through kite.runtime.batch_decode.forward_rows")
        kv = step.kv_lengths[layer_idx]
        out = []
        for buffer, new in ((self.keys[layer_idx], key_states), (self.values[layer_idx], value_states)):
            new = new.transpose(1, 2)                                    # [B, q, H, d]
            new = new.reshape(-1, *new.shape[2:]) if step.real is None else new[step.real]
            buffer.transpose(1, 2)[step.write_rows, step.write_slots[layer_idx]] = new.to(buffer.dtype)
            if step.row_range is not None:
                out.append(buffer[step.row_range[0]:step.row_range[1], :, :kv])
            else:
                out.append(buffer[step.row_index, :, :kv])
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The longest filled length of layer `layer_idx` among the taken rows."""
        return int(self.lengths[layer_idx].max()) if self.rows_allocated else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        step = self._step
        kv = step.kv_lengths[layer_idx] if step is not None else self.get_seq_length(layer_idx) + query_length
        return kv, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)
