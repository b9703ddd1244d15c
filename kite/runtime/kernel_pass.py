"""A pass over short prompts with nothing before them, written out on KITE's kernels (a GPU).

YOCO reads each query before it decides: one forward over the query alone, for the entropy of the
next-token distribution at each token and the hidden states the tagger reads. Through transformers'
forward that pass costs a 7B model ~23 ms on an H200 for a 20-token query, most of it the Python
around the layers, against ~3 ms of weights to read. This is the same forward as
kite.runtime.kernel_step's (the fused layers' projections, one-kernel RMSNorm with the residual add,
one RoPE kernel, one SiLU product), with causal attention over the prompt itself (right-padded rows:
a row's own tokens never see its padding).

:func:`hidden_pass` answers None where it does not apply (CPU, fp32, the fused layers not installed:
kite.runtime.kernel_step.why_not); the caller then runs transformers' forward.

Launched layer by layer, the pass still spends most of its time in Python, and in a server the batch
thread's every kernel launch waits for the GIL behind the HTTP side: a burst's pass over 15 questions
took 130 ms on the H200, where 64 questions alone take 29 ms eagerly (benchmarks/batch_step_gpu.py's
query-pass profile). Queries of at most GRAPH_TOKENS tokens once padded
to a bucket of rows and of length (up to 64 questions of 32 tokens) replay a CUDA graph of the pass
instead, captured the first time their buckets come or all at once by :func:`warm` (kept on the model,
one memory pool): the queries fill the first rows and columns of its static input, the rest is
padding no row's own tokens see (right padding, causal attention; padding rows are rows of their own).
More questions than one graph holds replay graphs chunk by chunk of rows (a burst of 106 questions of
up to 32 tokens: two replays); only queries longer than the longest length bucket run eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kite.runtime.kernel_step import norm_input, why_not

GRAPHS = True          # False: every pass runs eagerly (benchmarks and tests compare both)
GRAPH_TOKENS = 2048    # rows x length at most, once padded to their buckets, for a pass from a graph
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LENGTH_BUCKETS = (8, 16, 32, 64, 128)


def applies(model) -> bool:
    """Whether :func:`hidden_pass` runs ``model`` (a GPU, fp16/bf16, the fused layers installed)."""
    try:
        return why_not(model) is None
    except (AttributeError, TypeError):
        return False


def hidden_pass(model, ids: torch.Tensor, wanted: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
    """(the final normed hidden states [B, T, D], {index: hidden states [B, T, D]}) of right-padded
    prompts ``ids`` [B, T], numbered as transformers' ``hidden_states``: 0 the embeddings, ``i`` the
    input of decoder layer ``i``, the number of layers the final normed output. None where the pass
    does not apply (:func:`applies`)."""
    if not applies(model):
        return None
    chunks = _chunks(*ids.shape) if GRAPHS else None
    if chunks is None:
        return kernel_hidden(model, ids, wanted)
    key = tuple(sorted(wanted))
    if len(chunks) == 1:
        return _graph(model, *chunks[0][1], key).run(ids)
    # more rows than one graph holds: a replay per chunk of rows, each copied out before the next
    # replay (a chunk may replay the same graph), then joined
    lasts, kepts = [], []
    for (a, b), shape in chunks:
        last, kept = _graph(model, *shape, key).run(ids[a:b])
        lasts.append(last.clone())
        kepts.append({k: v.clone() for k, v in kept.items()})
    return torch.cat(lasts), {k: torch.cat([kept[k] for kept in kepts]) for k in kepts[0]}


def warm(model, wanted: tuple[int, ...] = ()) -> int:
    """Capture the pass of every bucket of rows and length a graph holds, keeping ``wanted`` layers,
    now rather than in a request's decision; how many graphs the model holds for them (0 where the
    pass does not apply or graphs are off)."""
    if not (GRAPHS and applies(model)):
        return 0
    key = tuple(sorted(wanted))
    shapes = [(B, T) for B in ROW_BUCKETS for T in LENGTH_BUCKETS if B * T <= GRAPH_TOKENS]
    for B, T in shapes:
        _graph(model, B, T, key)
    return len(shapes)


def _chunks(B: int, T: int) -> list[tuple[tuple[int, int], tuple[int, int]]] | None:
    """How a pass of B rows of T tokens replays: [((first row, end row), (rows, length) buckets)],
    B cut into runs of as many rows as one graph of T's length bucket holds; None (eager) where no
    length bucket takes T."""
    length = next((t for t in LENGTH_BUCKETS if t >= T), None)
    if length is None or B < 1:
        return None
    most = max(b for b in ROW_BUCKETS if b * length <= GRAPH_TOKENS)      # rows one graph of that length holds
    return [((a, min(a + most, B)), (next(b for b in ROW_BUCKETS if b >= min(most, B - a)), length))
            for a in range(0, B, most)]


def _graph(model, B: int, T: int, wanted: tuple[int, ...]) -> _PassGraph:
    graphs = model.__dict__.setdefault("_kite_pass_graphs", {})
    graph = graphs.get((B, T, wanted))
    if graph is None:
        pool = model.__dict__.setdefault("_kite_pass_pool", torch.cuda.graph_pool_handle())
        graph = graphs[(B, T, wanted)] = _PassGraph(model, B, T, wanted, pool)
    return graph


class _PassGraph:
    """The pass over B rows of T tokens, captured; :meth:`run` copies the ids in and replays it."""

    @torch.inference_mode()
    def __init__(self, model, B: int, T: int, wanted: tuple[int, ...], pool):
        device = next(model.parameters()).device
        self.ids = torch.zeros(B, T, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            kernel_hidden(model, self.ids, wanted)        # compiles the kernels outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.last, self.kept = kernel_hidden(model, self.ids, wanted)

    @torch.inference_mode()
    def run(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The pass over ``ids`` [b, t] (b, t within the graph's): views of the graph's outputs, valid
        until its next replay."""
        b, t = ids.shape
        self.ids.zero_()
        self.ids[:b, :t].copy_(ids, non_blocking=True)
        self.graph.replay()
        return self.last[:b, :t], {k: v[:b, :t] for k, v in self.kept.items()}


@torch.inference_mode()
def kernel_hidden(model, ids: torch.Tensor, wanted: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """:func:`hidden_pass` without asking whether it applies (the fused layers must be installed;
    on a CPU, through Triton's interpreter in the tests)."""
    from kite.kernels.fused_norm_triton import rms_norm
    from kite.kernels.rope_triton import rope_qkv
    from kite.kernels.silu_mul_triton import silu_mul

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = lm.model
    B, T = ids.shape
    ids = ids.to(lm.device)
    pos = torch.arange(T, device=ids.device).expand(B, T)
    h = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(h, pos)
    n_layers = len(inner.layers)
    kept: dict[int, torch.Tensor] = {}
    mlp_out = None     # joins the residual stream inside the next norm (kite.runtime.kernel_step)
    for layer, block in enumerate(inner.layers):
        attn, mlp = block.self_attn, block.mlp
        h, x = norm_input(h, mlp_out, block.input_layernorm)
        if layer in wanted:
            kept[layer] = h
        q, k, v = rope_qkv(*attn.kite_qkv(x), cos, sin)              # [B, H, T, d] each
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling,
                                             enable_gqa=q.shape[1] != k.shape[1])
        a = attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        h, x = rms_norm(a, block.post_attention_layernorm.weight, block.post_attention_layernorm.variance_epsilon,
                        residual=h)
        mlp_out = mlp.down_proj(silu_mul(*mlp.kite_gate_up(x)))
    _, h = norm_input(h, mlp_out, inner.norm)
    if n_layers in wanted:
        kept[n_layers] = h
    return h, kept
