"""A batch step's forward on a GPU, written out on KITE's kernels and replayed from CUDA graphs.

The batch engine (kite.runtime.batch_decode) feeds its rows through transformers' forward with a
mask per layer and row, built on the host every step; on a GPU that step ran 5.7-12x off its byte
floor at 32 rows after 16K-token prefixes. Here the same forward of a Llama-family model (Llama,
Qwen2, Mistral) is written out layer by layer on the kernels `kite generate` uses (one-kernel
RMSNorm with the residual add, q/k/v and gate/up as one product each through the projections the
fused layers install, kite.model.fused, one SiLU product) and two batch kernels that use the
cache's buffers where they lie:

- kite.kernels.rope_triton.rope_store rotates the queries and keys and writes each row's new keys
  and values into its next slots;
- kite.kernels.split_attention_triton attends each sequence over its own buffer row up to its own
  length in each layer, the keys split across thread blocks; a row whose state is held beside its
  slots (kite.runtime.resident, e.g. lanes) gets that state's part merged in one softmax.

Rows, lengths and slots are device tensors, so a decode step (one token a row) is the same launches
whatever the rows hold: :class:`KernelStep` captures it once per bucket of batch sizes (1, 2, 4, 8,
then steps of 8 ...) and replays it, padding the batch to its bucket with rows that read and write
nothing. A decode step whose rows all hold their states in lanes is captured too: what the lanes
kernel reads of each row's state is kept in device tables by cache row (:class:`LanesRows`) and
gathered by the step's rows inside the graph. A prefill of a few rows (at most PREFILL_ROWS, a
question a row), held in their slots or all in lanes, is captured per bucket of rows and of query
length, up to the final hidden states (the head runs after the replay: a graph keeps no [rows,
tokens, vocab] logits); larger prefills, and steps mixing rows in lanes with raw ones, run the same
forward eagerly. A graph is captured again when the cache's buffers are reallocated (they grow),
when the lanes tables must be read for more groups, and per reader-adapter setting (the adapter is
a switch the capture bakes in).

``KernelStep.build`` answers None where this does not apply (CPU, fp32, the fused layers not installed:
another family or no Triton; a head size the kernels do not take); the engine then keeps transformers'
forward.

A graphed decode step can be replayed again before the host has its tokens (:meth:`KernelStep.again`):
each row is fed the argmax of its logits there, on the device, one position further, and the host
reads the first step's tokens while the second runs. The engine (kite.runtime.batch_decode) does so
between decode steps of the same greedy rows, so the GPU does not wait for the host's part of a step
(docs/serving.md: on the H200 at 32 rows 11.93 ms a step one at a time, 11.58 ms ahead).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kite.runtime.batch_cache import BatchKVCache

MAX_QUERY = 64        # tokens a row feeds in one step through the kernels (longer prompts: transformers')
# a step's query length padded up to one of these: a step is captured per bucket, and the attention's
# folded rows take a tile per power of two of them, so a few lengths stand for all; padded tokens
# write nothing and are dropped (split_kv_attention: they see what the row's last token sees)
QUERY_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GRAPHS = True         # False: decode steps run eagerly too (benchmarks compare both)
AHEAD = True          # False: a decode step is not launched before the host has the last one's tokens (A/B)
PREFILL_ROWS = 4      # prefills of at most this many rows (held in their slots) replay graphs: what one client waits for
SPLITS: int | None = None   # chunks the attention cuts each row's keys into (None: the kernel's plan; benchmarks sweep)
_log = logging.getLogger("kite.runtime")


def query_bucket(tokens: int) -> int:
    """The query length a step of ``tokens`` tokens a row (at most MAX_QUERY) runs at."""
    return next(b for b in QUERY_BUCKETS if b >= tokens)


def buckets(max_rows: int) -> list[int]:
    """Batch sizes a decode graph is captured for: 1, 2, 4, 8, then every 8 up to ``max_rows``."""
    out = [b for b in (1, 2, 4) if b < max_rows]
    out += list(range(8, max_rows, 8))
    return out + [max_rows]


def why_not(model) -> str | None:
    """Why the kernel step does not apply to ``model`` (None: it does)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    param = next(base.parameters(), None)
    if param is None or param.device.type != "cuda":
        return "not on a GPU"
    if param.dtype not in (torch.float16, torch.bfloat16):
        return f"{param.dtype} weights (the kernels take fp16 / bf16)"
    inner = getattr(base, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "not a decoder stack KITE knows"
    if not all(getattr(block, "_kite_fused", False) for block in inner.layers):
        return "the fused layers are not installed (kite.model.fused: a Llama-family model with Triton)"
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if d not in (32, 64, 128) or config.num_attention_heads % config.num_key_value_heads:
        return f"head size {d} (the kernels take 32, 64 or 128)"
    return None


class KernelForward:
    """The written-out forward of ``model`` over a BatchKVCache's buffers (see the module docstring)."""

    def __init__(self, model, cache: BatchKVCache):
        self.model, self.cache = model, cache
        self.lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.inner = self.lm.model

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                 starts: torch.Tensor, counts: torch.Tensor, beside: dict | None = None,
                 splits: int | None = None, lanes=None, head: bool = True) -> torch.Tensor:
        """Logits [B, q, vocab] (fp32) of ``ids`` [B, q] at positions ``pos`` [B, q] (``head`` False:
        the final normed hidden states [B, q, D], for :meth:`logits_of`); sequence b feeds
        ``counts[b]`` real tokens into buffer row ``rows[b]``, layer l's from slot ``starts[l, b]`` on,
        and attends its first ``lens[l, b]`` slots (int32 device tensors: rows, counts [B]; lens,
        starts [layers, B]). ``beside``: (form, batch indices on the device, their prefixes, plans) of
        the rows whose state is held beside their slots. ``lanes``: every row's state is held in lanes
        beside its slots, read through ``lanes(layer, q)`` -> (out [B, Hq, 1, d], lse [B, Hq, 1]) (a
        captured step's :class:`LanesRows`)."""
        from kite.kernels.fused_norm_triton import rms_norm
        from kite.kernels.rope_triton import rope_store
        from kite.kernels.silu_mul_triton import silu_mul
        from kite.kernels.split_attention_triton import split_kv_attention

        B, T = ids.shape
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, pos)
        keys, values = self.cache.keys, self.cache.values
        mlp_out = None     # the last layer's MLP output: added to the residual by the next norm's kernel
        for layer, block in enumerate(self.inner.layers):
            attn, mlp = block.self_attn, block.mlp
            h, x = norm_input(h, mlp_out, block.input_layernorm)
            # the fused layers' projections (kite.model.fused); the new keys and values go to their slots
            q = rope_store(*attn.kite_qkv(x), cos, sin, keys[layer], values[layer], rows, starts[layer], counts)
            if lanes is not None:
                out, lse = split_kv_attention(q, keys[layer], values[layer], None, attn.scaling, rows=rows,
                                              lengths=lens[layer], starts=starts[layer], splits=splits,
                                              return_lse=True)
                out = _merge_lanes(out, lse, *lanes(layer, q, attn.scaling))
            elif beside:
                out, lse = split_kv_attention(q, keys[layer], values[layer], None, attn.scaling, rows=rows,
                                              lengths=lens[layer], starts=starts[layer], splits=splits,
                                              return_lse=True)
                _merge_beside(out, lse, q, layer, attn.scaling, beside)
            else:
                out = split_kv_attention(q, keys[layer], values[layer], None, attn.scaling, rows=rows,
                                         lengths=lens[layer], starts=starts[layer], splits=splits)
            a = attn.o_proj(out.reshape(B, T, -1))
            h, x = rms_norm(a, block.post_attention_layernorm.weight, block.post_attention_layernorm.variance_epsilon,
                            residual=h)
            mlp_out = mlp.down_proj(silu_mul(*mlp.kite_gate_up(x)))
        _, h = norm_input(h, mlp_out, self.inner.norm)
        return self.logits_of(h) if head else h

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm.lm_head(h).float()


def norm_input(h: torch.Tensor, delta: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(the residual stream ``h + delta``, its RMSNorm by ``norm``): one kernel (the previous layer's
    MLP output joins the stream inside the next norm, not in an add of its own); ``delta`` None: the
    embeddings, normed as they are."""
    from kite.kernels.fused_norm_triton import rms_norm

    if delta is None:
        return h, rms_norm(h, norm.weight, norm.variance_epsilon)
    return rms_norm(delta, norm.weight, norm.variance_epsilon, residual=h)


def _merge_lanes(out, lse, o, s) -> torch.Tensor:
    """Each row's slots (``out`` [B, q, Hq, d], ``lse`` [B, Hq, q]) and the part of its state held
    beside them (``o`` [B, Hq, q, d], ``s``) in one softmax, written into ``out`` (one kernel:
    kite.kernels.merge_triton)."""
    from kite.kernels.merge_triton import merge_into

    return merge_into(out, lse, o.float(), s.float())


def _merge_beside(out, lse, q, layer: int, scale: float, beside) -> None:
    """Rows whose state is held beside their slots: ``out[idx]`` [n, q, Hq, d] becomes one softmax over
    the state (its form's ``attend``) and the row's slots (``out``, ``lse`` [B, Hq, q])."""
    for form, idx, prefixes, plans in beside:
        held = [i for i, p in enumerate(prefixes) if p.holds(layer)]
        if not held:
            continue
        if len(held) < len(prefixes):
            idx, prefixes = idx[held], [prefixes[i] for i in held]
        o, s = form.attend(q[idx], prefixes, layer, scale, plans)                     # [n, Hq, q, d], [n, Hq, q]
        out[idx] = _merge_lanes(out[idx], lse[idx], o, s)


class KernelStep:
    """Steps of a BatchDecoder on the kernels: :meth:`logits` for any step it takes (see
    :meth:`takes`), decode steps replayed from CUDA graphs (rows held in their slots, or all in lanes)."""

    def __init__(self, model, cache: BatchKVCache):
        self.forward = KernelForward(model, cache)
        self.cache = cache
        self.device = cache.device
        self.buckets = buckets(cache.max_rows)
        self.graphed = cache.device.type == "cuda"      # a CPU (Triton's interpreter, in tests) runs eagerly
        self._graphs: dict[tuple, _Graph] = {}
        self.lanes_rows = LanesRows(cache)
        self._pool = None
        self._buffers = None
        self.warm_all = False        # capture every bucket at once (warm), lanes ones when their tables change
        self._lanes_warmed = None
        self.captures = 0
        self.replays = 0
        self.ahead = 0               # replays launched by again(): fed on the device, not by the host
        self.prefill_compiled = False
        self._last: tuple[_Graph, list[int]] | None = None   # the last step, when it was a graphed decode step

    @classmethod
    def build(cls, model, cache: BatchKVCache) -> KernelStep | None:
        why = why_not(model)
        if why is not None:
            _log.info("batch steps run transformers' forward: %s", why)
            return None
        return cls(model, cache)

    def takes(self, tokens: list[list[int]], memories: bool) -> bool:
        """Whether a step feeding ``tokens`` (one list a row) runs here: no row keeps older tokens in a
        memory (kite.runtime.row_memory), and no row feeds more than MAX_QUERY tokens."""
        return not memories and max(len(t) for t in tokens) <= MAX_QUERY

    @torch.inference_mode()
    def logits(self, rows: list[int], tokens: list[list[int]], positions: list[int],
               beside: dict | None = None, reader_on: bool = False) -> torch.Tensor:
        """Feed row rows[b] its tokens[b] at positions[b]…; the logits [B, T, vocab] (fp32), row b's
        first len(tokens[b]) its own (kite.runtime.batch_decode.forward_rows gives them as a list);
        the cache's lengths advance.

        The host's part of a step is kept to a few torch calls, its bookkeeping in numpy: every
        torch call lets go of the GIL, and with a server's event loop busy on the other thread each
        one could wait a thread switch (5 ms by default) to get it back."""
        cache = self.cache
        self._last = None
        counts = np.asarray([len(t) for t in tokens])
        before = np.ascontiguousarray(cache.lengths.numpy()[:, np.asarray(rows)])    # [L, B], a copy
        cache.reserve_for(int((before + counts).max()))
        most = int(counts.max())
        graphed = most == 1 and GRAPHS and self.graphed
        prefill_graphed = GRAPHS and self.graphed and most > 1 and len(rows) <= PREFILL_ROWS
        # every row's state read from the device tables by cache row, a question's tokens too (each an
        # entry of its row's state)
        all_lanes = bool(beside) and len(beside) == len(rows) and self.lanes_rows.takes(beside.values())
        if all_lanes:
            self.lanes_rows.sync({rows[b]: p for b, p in beside.items()})
        if graphed and (not beside or all_lanes):
            out = self._replay(rows, [t[0] for t in tokens], positions, before, reader_on, lanes=all_lanes)
        elif prefill_graphed and (not beside or all_lanes):
            out = self._replay(rows, tokens, positions, before, reader_on, lanes=all_lanes, T=query_bucket(most))
        else:
            out = self._eager(rows, tokens, positions, torch.from_numpy(before), counts.tolist(),
                              None if all_lanes else beside, all_lanes)
        cache.advance(rows, counts)
        return out

    def _eager(self, rows, tokens, positions, before, counts, beside, lanes: bool = False) -> torch.Tensor:
        dev = self.device
        T = query_bucket(max(counts))
        ids = np.zeros((len(rows), T), dtype=np.int64)
        for b, t in enumerate(tokens):
            ids[b, :len(t)] = t
        ids = torch.from_numpy(ids)
        pos = torch.tensor(positions, dtype=torch.long)[:, None] + torch.arange(T)[None]
        n = torch.tensor(counts, dtype=torch.int32)
        groups = None
        if beside:
            groups = []
            for form in sorted({type(p) for p in beside.values()}, key=lambda t: t.__name__):
                these = [b for b in sorted(beside) if type(beside[b]) is form]
                groups.append((form, torch.tensor(these, device=dev), [beside[b] for b in these], self.cache.plans))
        part = self.lanes_rows.part(torch.tensor(rows, dtype=torch.int64, device=dev)) if lanes else None
        return self.forward(ids.to(dev), pos.to(dev), torch.tensor(rows, dtype=torch.int32, device=dev),
                            (before + n[None]).to(dev, torch.int32), before.to(dev, torch.int32), n.to(dev),
                            beside=groups, splits=SPLITS, lanes=part)

    # -- CUDA graphs of decode steps -------------------------------------------------------------
    def warm(self, lanes_row: int | None = None) -> None:
        """Capture the decode step of every bucket and the few-row prefills now (rows held in their
        slots; with ``lanes_row``, a cache row whose state the lanes tables hold, rows all in lanes),
        and from then on whenever the lanes tables change: a server that reserved its buffers pays
        every capture before its first request, or at its first request in lanes."""
        self.warm_all = True
        if self.graphed and GRAPHS:
            rows = self.cache.rows_allocated      # no step runs more rows than are allocated
            lanes, pad = lanes_row is not None, 0 if lanes_row is None else lanes_row
            for bucket in self.buckets[:next(i for i, b in enumerate(self.buckets) if b >= rows) + 1]:
                self._graph(bucket, False, lanes, pad)
            for bucket in self.prefill_buckets():     # the prefills one client's question runs
                for T in QUERY_BUCKETS[1:]:
                    self._graph(bucket, False, lanes, pad, T)
        if self.graphed and lanes_row is None:
            self.compile_queries()

    def prefill_buckets(self) -> list[int]:
        """Row buckets a prefill graph is captured for (:data:`PREFILL_ROWS` rows at most)."""
        limit = min(PREFILL_ROWS, self.cache.rows_allocated or PREFILL_ROWS)
        return [b for b in self.buckets if b < limit] + [next(b for b in self.buckets if b >= limit)]

    @torch.inference_mode()
    def compile_queries(self) -> None:
        """Run one eager step of each query bucket on a row that writes and reads nothing (count 0): the
        kernels a question of each bucket's length runs compile now, not in a request's prefill. The attention of
        both variants (rows held in their slots, and rows whose state is held beside them, with the
        lse) also runs at one batch size of each chunk count a batch of these rows can plan
        (:meth:`attention_batches`): the merge kernel compiles per power of two of it, and a prefill
        of 28 rows on the H200 paid such a compile (272 ms against 64 ms for 40 rows)."""
        from kite.kernels.split_attention_triton import split_kv_attention

        dev, L = self.device, self.cache.n_layers
        row = torch.zeros(1, dtype=torch.int32, device=dev)            # buffer row 0
        nothing = torch.zeros(L, 1, dtype=torch.int32, device=dev)     # lengths and starts 0 in every layer
        count = torch.zeros(1, dtype=torch.int32, device=dev)          # no token written
        keys, values = self.cache.keys[0], self.cache.values[0]
        for T in QUERY_BUCKETS[1:]:
            ids = torch.zeros(1, T, dtype=torch.long, device=dev)
            pos = torch.arange(T, device=dev)[None]
            self.forward(ids, pos, row, nothing, nothing, count, splits=SPLITS)
            for B in self.attention_batches(T):
                q = torch.zeros(B, self.forward.inner.config.num_attention_heads, T, keys.shape[-1],
                                dtype=keys.dtype, device=dev)
                rows = torch.zeros(B, dtype=torch.int32, device=dev)
                none = torch.zeros(B, dtype=torch.int32, device=dev)
                for lse in (False, True):
                    split_kv_attention(q, keys, values, None, 1.0, rows=rows, lengths=none, starts=none,
                                       splits=SPLITS, return_lse=lse)
        self.prefill_compiled = True

    def attention_batches(self, T: int) -> list[int]:
        """The smallest batch size of each chunk count the attention plans for a step of ``T`` tokens a row
        (up to the rows allocated): one of each is what compiles every variant of its kernels."""
        from kite.kernels.split_attention_triton import compile_variant, row_splits

        config = self.forward.inner.config
        keys = self.cache.keys[0]
        seen, out = set(), []
        for B in range(1, max(1, self.cache.rows_allocated) + 1):
            variant = compile_variant(SPLITS or row_splits(B, config.num_attention_heads, keys.shape[1], T,
                                                           keys.shape[2], keys.device))
            if variant not in seen:
                seen.add(variant)
                out.append(B)
        return out

    def _replay(self, rows, tokens, positions, before, reader_on, lanes: bool = False, T: int = 1) -> torch.Tensor:
        """A captured step's logits: one token a row (``tokens`` ints), or a prefill at query length
        ``T`` (``tokens`` lists, each at most T)."""
        B = len(rows)
        if lanes and self.warm_all and self._lanes_warmed != self.lanes_rows.version:
            self._lanes_warmed = self.lanes_rows.version
            self.warm(lanes_row=rows[0])
        graph = self._graph(next(b for b in self.buckets if b >= B), reader_on, lanes, rows[0], T)
        self.replays += 1
        out = graph.run(rows, tokens, positions, before)
        if T == 1:
            self._last = (graph, list(rows))
        return out if T == 1 else self.forward.logits_of(out)

    def forget_last(self) -> None:
        """A forward ran elsewhere (transformers' forward): the last graphed step is not the last step."""
        self._last = None

    @torch.inference_mode()
    def again(self, rows: list[int]) -> _Graph | None:
        """Launch the last step again, when it was a graphed decode step of ``rows`` (nothing run since), for the
        same rows, each fed the argmax of its logits there (greedy rows) one position further; the
        cache's lengths advance. Returns the graph: its :meth:`_Graph.picks` are the tokens fed (the
        last step's, read without waiting for this one), its ``out`` this step's logits. None (nothing
        launched) when the buffers would have to grow or were reallocated since, or :data:`AHEAD` is off."""
        if self._last is None or not AHEAD or self._last[1] != list(rows):
            return None
        graph = self._last[0]
        cache = self.cache
        lengths = cache.lengths.numpy()[:, np.asarray(rows)]
        if int(lengths.max()) + 1 > cache.capacity or \
                self._buffers != (cache.keys[0].data_ptr(), cache.capacity, cache.rows_allocated):
            return None
        graph.again(len(rows))
        cache.advance(rows, np.ones(len(rows), dtype=np.int64))
        self.replays += 1
        self.ahead += 1
        return graph

    def _graph(self, bucket: int, reader_on: bool, lanes: bool, pad_row: int, T: int = 1) -> _Graph:
        """The captured step of ``bucket`` rows feeding ``T`` tokens each (captured now if it is not
        yet, or if the buffers it read were reallocated)."""
        buffers = (self.cache.keys[0].data_ptr(), self.cache.capacity, self.cache.rows_allocated)
        if buffers != self._buffers:          # reallocated: every graph read the old buffers
            self._graphs.clear()
            self._pool = None                 # a pool whose graphs are all gone is not captured into again
            self._buffers = buffers
        key = (bucket, T, reader_on, self.lanes_rows.version if lanes else None)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _Graph(self.forward, bucket, self.cache.n_layers, self.device,
                                               self._pool_handle(), self.lanes_rows if lanes else None, pad_row, T)
            self.captures += 1
        return graph

    def _pool_handle(self):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool


class _Graph:
    """One step of ``bucket`` rows feeding ``T`` tokens each, captured: static inputs, copied in before
    each replay. T 1 (a decode step) gives logits; a prefill (T > 1) the final hidden states."""

    def __init__(self, forward: KernelForward, bucket: int, n_layers: int, device, pool,
                 lanes: LanesRows | None = None, pad_row: int = 0, T: int = 1):
        self.bucket, self.T = bucket, T
        L = n_layers
        # rows of the inputs: T of token ids, T of positions, the cache rows, then (int32 on the device)
        # the counts, L of lengths, L of starts
        self.host = torch.zeros(2 * T + 2 + 2 * L, bucket, dtype=torch.int64).pin_memory()
        self.host_np = self.host.numpy()
        self.inputs = torch.zeros(2 * T + 2 + 2 * L, bucket, dtype=torch.int64, device=device)
        ids, pos = self.inputs[0:T].T, self.inputs[T:2 * T].T            # [bucket, T] views
        self.rows32 = torch.zeros(bucket, dtype=torch.int32, device=device)
        self.small = torch.zeros(1 + 2 * L, bucket, dtype=torch.int32, device=device)   # counts, lens, starts
        part = None if lanes is None else lanes.part(self.inputs[2 * T])

        def step():
            self.rows32.copy_(self.inputs[2 * T])
            self.small.copy_(self.inputs[2 * T + 1:])
            return forward(ids, pos, self.rows32, self.small[1:1 + L], self.small[1 + L:], self.small[0], splits=SPLITS,
                           lanes=part, head=T == 1)

        if T == 1:             # what again() feeds, copied back to the host
            self.picked = torch.zeros(bucket, dtype=torch.int64).pin_memory()
            self.picked_at = torch.cuda.Event()
        self.inputs.zero_()      # counts 0: a row that writes and reads nothing (capture writes no KV)
        self.inputs[2 * T].fill_(pad_row)   # a row whose tables (lanes) hold a state: what the warm-up reads
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()                # compiles the kernels outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = step()

    def run(self, rows, tokens, positions, before: np.ndarray) -> torch.Tensor:
        """Replay for ``rows`` feeding ``tokens`` (one int a row at T 1, else a list of at most T) at
        ``positions``, each row's layers filled to ``before`` [L, B]: the output's first len(rows) rows.
        The inputs are written in numpy into pinned memory: one torch call copies them over."""
        B, L, T = len(rows), before.shape[0], self.T
        h = self.host_np
        h.fill(0)
        if T == 1:
            counts = 1
            h[0, :B] = tokens
            h[1, :B] = positions
        else:
            counts = np.asarray([len(t) for t in tokens])
            for b, t in enumerate(tokens):
                h[:len(t), b] = t
            h[T:2 * T, :B] = np.asarray(positions)[None] + np.arange(T)[:, None]
        h[2 * T, :B] = rows
        h[2 * T, B:] = rows[0]   # padding reads a real row's tables (lanes) and, with count 0, none of its slots
        h[2 * T + 1, :B] = counts
        h[2 * T + 2:2 * T + 2 + L, :B] = before + counts
        h[2 * T + 2 + L:, :B] = before
        self.inputs.copy_(self.host, non_blocking=True)
        self.graph.replay()
        return self.out[:B]

    def again(self, B: int) -> None:
        """Replay a decode step (T 1) for the same ``B`` rows one token further: each row fed the argmax
        of its logits in the last replay, written into the inputs on the device (and copied to the
        host for :meth:`picks`) before this replay overwrites them; positions, lengths and starts + 1."""
        picks = self.out[:B, 0].argmax(dim=-1)
        self.picked[:B].copy_(picks, non_blocking=True)
        self.picked_at.record()
        self.inputs[0, :B] = picks
        self.inputs[1, :B] += 1
        self.inputs[4:, :B] += 1          # every layer's length and start (rows 4..: T 1)
        self.graph.replay()

    def picks(self, B: int) -> list[int]:
        """The tokens the last :meth:`again` fed, once they are on the host (the replay before it done,
        not that one)."""
        self.picked_at.synchronize()
        return self.picked[:B].tolist()


class LanesRows:
    """What the lanes kernel (kite.kernels.lanes_triton) reads of the state held beside each cache row,
    in device tables by layer and cache row: pointers to the state's tables, its groups, its length
    and its sinks. A row's entries are written when the state it holds changes (:meth:`sync`); a
    captured decode step gathers them by its rows (:meth:`part`), so rows joining and leaving the
    batch change table entries, not the graph. ``version`` changes when the tables are reallocated
    or must be read for more groups (a graph captured before is not replayed then)."""

    def __init__(self, cache: BatchKVCache):
        self.cache = cache
        self.version = 0
        self.held: dict[int, int] = {}        # cache row -> id of the LanesPrefix its entries hold
        self._prefixes: dict[int, object] = {}   # what those entries point into, kept alive
        self.like: list | None = None         # per layer: a one-state plan (heads, lanes, group, basis type)
        self.ngmax = 0
        self.tables: dict[str, torch.Tensor] = {}

    def takes(self, prefixes) -> bool:
        """Whether these rows' states can be read from the tables: lanes the kernel reads, every layer
        held, and (once the tables exist) the same shape as theirs. (Asked every step: what a prefix
        answers is kept on it.)"""
        for p in prefixes:
            shape = _kernel_shape(p)
            if shape is None or (self.like is not None and shape != self._shape):
                return False
        return True

    def sync(self, beside: dict[int, object]) -> None:
        """Write the entries of every cache row (``beside``: row -> its LanesPrefix) whose state changed."""
        for row, prefix in beside.items():
            if self.held.get(row) != id(prefix):
                self._write(row, prefix)

    def _write(self, row: int, prefix) -> None:
        entry = _row_entry(prefix)
        if self.like is None:
            self._allocate(prefix, entry)
        if int(entry["ngs"].max()) > self.ngmax:     # read up to a power of two: fewer recaptures
            self.ngmax = max(16, 1 << (int(entry["ngs"].max()) - 1).bit_length())
            self.version += 1
        for name, value in entry.items():
            self.tables[name][:, row] = value
        self.held[row] = id(prefix)
        self._prefixes[row] = prefix

    def _allocate(self, prefix, entry) -> None:
        R = self.cache.max_rows
        self.like = prefix._kernel_plans
        self._shape = _kernel_shape(prefix)
        self.tables = {name: torch.zeros((v.shape[0], R, *v.shape[1:]), dtype=v.dtype, device=v.device)
                       for name, v in entry.items()}
        self.version += 1

    def part(self, rows: torch.Tensor):
        """``part(layer, q, scale)`` for a forward: the lanes attention of each row's queries (q [B, Hq,
        T, d]; every state token precedes every query token) over its row's state, from the tables
        gathered by ``rows`` (cache rows, int64 on the device): (out [B, Hq, T, d], lse [B, Hq, T]).
        A row's T tokens are read as more query heads of its state, a chunk of them an entry
        (lanes_attend_tokens)."""
        from kite.kernels.lanes_triton import LanesPlan, lanes_attend_tokens

        t, like, ngmax = self.tables, self.like, self.ngmax
        # chunks a row -> every layer's entries, gathered once a forward: at its first layer, since a
        # captured step calls this again for every replay's rows (and its capture runs it twice)
        gathered: dict[int, dict] = {}

        def lanes(layer: int, q: torch.Tensor, scale: float):
            if layer == 0:
                gathered.clear()

            def plan_for(chunks: int):
                if chunks not in gathered:
                    # each row `chunks` times in a row (expand, not repeat_interleave: no device sync, so a
                    # captured prefill can take it)
                    entries = rows if chunks == 1 else rows[:, None].expand(-1, chunks).reshape(-1)
                    gathered[chunks] = {name: v.index_select(1, entries) for name, v in t.items()}
                pick = {name: v[layer] for name, v in gathered[chunks].items()}
                return LanesPlan.gathered(like[layer], pick["ptrs"], pick["ngs"], pick["length"], pick["sinks_k"],
                                          pick["sinks_v"], ngmax)

            return lanes_attend_tokens(q, plan_for, scale, like[layer].H)

        return lanes


def _kernel_shape(prefix) -> tuple | None:
    """What must match for a state to share the lanes tables (None: the lanes kernel does not read
    it: another form, a layer not held, lanes it does not take); kept on the prefix."""
    shape = getattr(prefix, "_kernel_shape", False)
    if shape is not False:
        return shape
    from kite.runtime.resident import LanesPrefix

    try:
        from kite.kernels.lanes_triton import kernel_reads
    except ImportError:
        return None
    shape = None
    if isinstance(prefix, LanesPrefix) and not any(x is None for x in prefix.layers) and kernel_reads(prefix.layers):
        x = prefix.layers[0]
        shape = (x.k_codes.shape[1], x.k_weight.shape[-1], x.v_weight.shape[-1], x.group, x.k_basis.dtype,
                 tuple(x.raw_k.shape[1:]), x.raw_k.dtype, len(prefix.layers))
        prefix._kernel_shape = shape
    return shape


def _row_entry(prefix) -> dict[str, torch.Tensor]:
    """A LanesPrefix's entries for the tables, every layer stacked: made once per prefix (a prefix the
    server's cache hands to many rows is planned once) and kept on it with its one-state plans."""
    entry = getattr(prefix, "_kernel_entry", None)
    if entry is None:
        from kite.kernels.lanes_triton import LanesPlan

        plans = [LanesPlan([x]) for x in prefix.layers]
        entry = {"ptrs": torch.stack([p.ptrs[0] for p in plans]), "ngs": torch.stack([p.ngs[0] for p in plans]),
                 "length": torch.stack([p.length[0] for p in plans]),
                 "sinks_k": torch.stack([p.raw_k[0] for p in plans]), "sinks_v": torch.stack([p.raw_v[0] for p in plans])}
        prefix._kernel_plans, prefix._kernel_entry = plans, entry
    return entry
