"""A batch step's forward on a GPU, written out on KITE's kernels and replayed from CUDA graphs.

The batch engine (kite.runtime.batch_decode) feeds its rows through transformers' forward with a
mask per layer and row, built on the host every step; on a GPU that step ran 5.7-12x off its byte
floor at 32 rows after 16K-token prefixes. Here the same forward of a Llama-family model (Llama,
Qwen2, Mistral) is written out layer by layer on the kernels `kite generate` uses (one-kernel
RMSNorm with the residual add, q/k/v and gate/up as one product each through the projections the
fused layers install, kite.model.fused, one RoPE kernel, one SiLU product) and two batch kernels that read the cache's buffers where they lie:

- kite.kernels.kv_store_triton writes each row's new keys and values into its next slots;
- kite.kernels.split_attention_triton attends each sequence over its own buffer row up to its own
  length in each layer, the keys split across thread blocks; a row whose state is held beside its
  slots (kite.runtime.resident, e.g. lanes) gets that state's part merged in one softmax.

Rows, lengths and slots are device tensors, so a decode step (one token a row) is the same launches
whatever the rows hold: :class:`KernelStep` captures it once per bucket of batch sizes (1, 2, 4, 8,
then steps of 8 ...) and replays it, padding the batch to its bucket with rows that read and write
nothing. A step with rows held beside their slots, or a prefill (several tokens a row), runs the
same forward eagerly. A graph is captured again when the cache's buffers are reallocated (they
grow) and per reader-adapter setting (the adapter is a switch the capture bakes in).

``KernelStep.build`` answers None where this does not apply (CPU, fp32, the fused layers not installed:
another family or no Triton; a head size the kernels do not take); the engine then keeps transformers'
forward.
"""

from __future__ import annotations

import logging

import torch

from kite.runtime.batch_cache import BatchKVCache

MAX_QUERY = 64        # tokens a row feeds in one step through the kernels (longer prompts: transformers')
GRAPHS = True         # False: decode steps run eagerly too (benchmarks compare both)
SPLITS: int | None = None   # chunks the attention cuts each row's keys into (None: the kernel's plan; benchmarks sweep)
_log = logging.getLogger("kite.runtime")


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
                 splits: int | None = None) -> torch.Tensor:
        """Logits [B, q, vocab] (fp32) of ``ids`` [B, q] at positions ``pos`` [B, q]; sequence b feeds
        ``counts[b]`` real tokens into buffer row ``rows[b]``, layer l's from slot ``starts[l, b]`` on,
        and attends its first ``lens[l, b]`` slots (int32 device tensors: rows, counts [B]; lens,
        starts [layers, B]). ``beside``: (form, batch indices on the device, their prefixes, plans) of
        the rows whose state is held beside their slots."""
        from kite.kernels.fused_norm_triton import rms_norm
        from kite.kernels.kv_store_triton import store_kv
        from kite.kernels.rope_triton import rope_qkv
        from kite.kernels.silu_mul_triton import silu_mul
        from kite.kernels.split_attention_triton import split_kv_attention

        B, T = ids.shape
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, pos)
        keys, values = self.cache.keys, self.cache.values
        for layer, block in enumerate(self.inner.layers):
            attn, mlp = block.self_attn, block.mlp
            x = rms_norm(h, block.input_layernorm.weight, block.input_layernorm.variance_epsilon)
            q, k, v = rope_qkv(*attn.kite_qkv(x), cos, sin)    # the fused layers' projections (kite.model.fused)
            store_kv(k, v, keys[layer], values[layer], rows, starts[layer], counts)
            if beside:
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
            h = h + mlp.down_proj(silu_mul(*mlp.kite_gate_up(x)))
        h = rms_norm(h, self.inner.norm.weight, self.inner.norm.variance_epsilon)
        return self.lm.lm_head(h).float()


def _merge_beside(out, lse, q, layer: int, scale: float, beside) -> None:
    """Rows whose state is held beside their slots: ``out[idx]`` [n, q, Hq, d] becomes one softmax over
    the state (its form's ``attend``) and the row's slots (``out``, ``lse`` [B, Hq, q])."""
    from kite.kernels.partials import merge

    for form, idx, prefixes, plans in beside:
        held = [i for i, p in enumerate(prefixes) if p.holds(layer)]
        if not held:
            continue
        if len(held) < len(prefixes):
            idx, prefixes = idx[held], [prefixes[i] for i in held]
        o, s = form.attend(q[idx], prefixes, layer, scale, plans)                     # [n, Hq, q, d], [n, Hq, q]
        merged, _ = merge([(o, s), (out[idx].transpose(1, 2).float(), lse[idx])])
        out[idx] = merged.transpose(1, 2).to(out.dtype)


class KernelStep:
    """Steps of a BatchDecoder on the kernels: :meth:`logits` for any step it takes (see
    :meth:`takes`), decode steps of rows held in their slots replayed from CUDA graphs."""

    def __init__(self, model, cache: BatchKVCache):
        self.forward = KernelForward(model, cache)
        self.cache = cache
        self.device = cache.device
        self.buckets = buckets(cache.max_rows)
        self.graphed = cache.device.type == "cuda"      # a CPU (Triton's interpreter, in tests) runs eagerly
        self._graphs: dict[tuple[int, bool], _Graph] = {}
        self._pool = None
        self._buffers = None
        self.captures = 0
        self.replays = 0

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
               beside: dict | None = None, reader_on: bool = False) -> list[torch.Tensor]:
        """Feed row rows[b] its tokens[b] at positions[b]…; each row's logits [len(tokens[b]), vocab]
        (fp32), as kite.runtime.batch_decode.forward_rows gives them; the cache's lengths advance."""
        cache = self.cache
        counts = [len(t) for t in tokens]
        idx = torch.tensor(rows, dtype=torch.long)
        before = cache.lengths[:, idx]                                   # [L, B]
        cache.reserve_for(int((before + torch.tensor(counts)[None]).max()))
        if max(counts) == 1 and not beside and GRAPHS and self.graphed:
            out = self._replay(rows, [t[0] for t in tokens], positions, before, reader_on)
        else:
            out = self._eager(rows, tokens, positions, before, counts, beside)
        cache.advance(rows, counts)
        return [out[b, :n] for b, n in enumerate(counts)]

    def _eager(self, rows, tokens, positions, before, counts, beside) -> torch.Tensor:
        dev = self.device
        T = max(counts)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        for b, t in enumerate(tokens):
            ids[b, :len(t)] = torch.tensor(t)
        pos = torch.tensor(positions, dtype=torch.long)[:, None] + torch.arange(T)[None]
        n = torch.tensor(counts, dtype=torch.int32)
        groups = None
        if beside:
            groups = []
            for form in sorted({type(p) for p in beside.values()}, key=lambda t: t.__name__):
                these = [b for b in sorted(beside) if type(beside[b]) is form]
                groups.append((form, torch.tensor(these, device=dev), [beside[b] for b in these], self.cache.plans))
        return self.forward(ids.to(dev), pos.to(dev), torch.tensor(rows, dtype=torch.int32, device=dev),
                            (before + n[None]).to(dev, torch.int32), before.to(dev, torch.int32), n.to(dev),
                            beside=groups, splits=SPLITS)

    # -- CUDA graphs of decode steps -------------------------------------------------------------
    def _replay(self, rows, tokens, positions, before, reader_on) -> torch.Tensor:
        B = len(rows)
        bucket = next(b for b in self.buckets if b >= B)
        buffers = (self.cache.keys[0].data_ptr(), self.cache.capacity, self.cache.rows_allocated)
        if buffers != self._buffers:          # reallocated: every graph read the old buffers
            self._graphs.clear()
            self._pool = None                 # a pool whose graphs are all gone is not captured into again
            self._buffers = buffers
        graph = self._graphs.get((bucket, reader_on))
        if graph is None:
            graph = self._graphs[(bucket, reader_on)] = _Graph(self.forward, bucket, self.cache.n_layers,
                                                                self.device, self._pool_handle())
            self.captures += 1
        self.replays += 1
        return graph.run(rows, tokens, positions, before)

    def _pool_handle(self):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool


class _Graph:
    """One decode step of ``bucket`` rows captured: static inputs, copied in before each replay."""

    def __init__(self, forward: KernelForward, bucket: int, n_layers: int, device, pool):
        self.bucket = bucket
        self.host = torch.zeros(4 + 2 * n_layers, bucket, dtype=torch.int64).pin_memory()
        self.inputs = torch.zeros(4 + 2 * n_layers, bucket, dtype=torch.int64, device=device)
        ids, pos = self.inputs[0:1].T, self.inputs[1:2].T                # [bucket, 1] views
        self.rows32 = torch.zeros(bucket, dtype=torch.int32, device=device)
        self.small = torch.zeros(1 + 2 * n_layers, bucket, dtype=torch.int32, device=device)   # counts, lens, starts
        L = n_layers

        def step():
            self.rows32.copy_(self.inputs[2])
            self.small.copy_(self.inputs[3:])
            return forward(ids, pos, self.rows32, self.small[1:1 + L], self.small[1 + L:], self.small[0], splits=SPLITS)

        self.inputs.zero_()      # counts 0: a row that writes and reads nothing (capture writes no KV)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()                # compiles the kernels outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = step()

    def run(self, rows, tokens, positions, before) -> torch.Tensor:
        B, L = len(rows), before.shape[0]
        h = self.host
        h.zero_()
        h[0, :B] = torch.tensor(tokens)
        h[1, :B] = torch.tensor(positions)
        h[2, :B] = torch.tensor(rows)
        h[3, :B] = 1
        h[4:4 + L, :B] = before + 1
        h[4 + L:, :B] = before
        self.inputs.copy_(h, non_blocking=True)
        self.graph.replay()
        return self.out[:B]
