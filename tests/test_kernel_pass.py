"""YOCO's pass over a query on KITE's kernels (kite.runtime.kernel_pass) gives transformers' hidden
states and the same signals: on the CPU through Triton's interpreter at fp32, on a GPU at bf16."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from kite.testing.triton_interpreter import run_interpreted
from tests.test_kernel_step import tiny_lm

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prompts(lm, lengths, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random prompts of ``lengths``: (ids [B, T], mask [B, T])."""
    from kite.runtime.batch import right_padded

    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(5, lm.geometry.vocab_size, (n,), generator=g).tolist() for n in lengths]
    return right_padded(rows, 0)


def _compare(lm, atol: float) -> None:
    from kite.runtime.kernel_pass import kernel_hidden

    ids, mask = _prompts(lm, [7, 3, 5])
    n = lm.model.config.num_hidden_layers
    want = lm.model(input_ids=ids.to(lm.model.device), attention_mask=mask.to(lm.model.device),
                    output_hidden_states=True, use_cache=False).hidden_states
    last, kept = kernel_hidden(lm.model, ids, (0, 1, n))
    m = mask.bool()
    for h in (0, 1, n):
        err = (kept[h][m].float() - want[h][m].float()).abs().max().item()
        assert err <= atol, (h, err)
    assert torch.equal(last, kept[n])


def check_the_pass_in_the_interpreter() -> None:
    """(Run by run_interpreted.) A tiny Llama at fp32: each row's own tokens' hidden states are
    transformers', padding or not."""
    _compare(tiny_lm("llama", "cpu", torch.float32, layers=2), atol=1e-4)
    print("the same hidden states")


@pytest.mark.slow   # Triton's interpreter on the CPU
def test_the_pass_gives_transformers_hidden_states_on_the_cpu():
    run_interpreted("tests.test_kernel_pass:check_the_pass_in_the_interpreter", timeout=300)


def test_a_pass_replays_graphs_chunk_by_chunk_of_rows_and_long_queries_run_eagerly():
    """Rows beyond what one graph of the length's bucket holds go to further replays, each at a
    bucket warm captures; a query longer than every length bucket has no graph."""
    from kite.runtime.kernel_pass import GRAPH_TOKENS, LENGTH_BUCKETS, ROW_BUCKETS, _chunks

    assert _chunks(15, 21) == [((0, 15), (16, 32))]
    assert _chunks(106, 30) == [((0, 64), (64, 32)), ((64, 106), (64, 32))]
    assert _chunks(32, 100) == [((0, 16), (16, 128)), ((16, 32), (16, 128))]
    assert _chunks(65, 8) == [((0, 64), (64, 8)), ((64, 65), (1, 8))]
    assert _chunks(3, LENGTH_BUCKETS[-1] + 1) is None
    for B in range(1, 200):
        for T in (1, 9, 32, 33, 64, 65, 128):
            chunks = _chunks(B, T)
            assert [a for (a, _), _ in chunks] == list(range(0, B, chunks[0][0][1]))
            assert chunks[-1][0][1] == B
            for (a, b), (rows, length) in chunks:
                assert rows in ROW_BUCKETS and b - a <= rows and T <= length and rows * length <= GRAPH_TOKENS


def test_chunk_by_chunk_each_replay_is_copied_out_before_the_next():
    """A replay's outputs are views of its graph's static buffers, which the next replay of the same
    graph overwrites: 120 rows (two replays of the 64-row graph) come back each with its own values,
    in order, for the final states and every kept layer."""
    from kite.runtime import kernel_pass

    class Graph:    # a captured pass's static outputs, rewritten at every replay
        def __init__(self, B, T):
            self.last, self.kept = torch.zeros(B, T, 2), {0: torch.zeros(B, T, 2)}

        def run(self, ids):
            b, t = ids.shape
            self.last.zero_()
            self.kept[0].zero_()
            self.last[:b, :t, 0] = ids
            self.kept[0][:b, :t, 1] = -ids
            return self.last[:b, :t], {k: v[:b, :t] for k, v in self.kept.items()}

    graphs = {}
    ids = torch.arange(120 * 19, dtype=torch.float32).reshape(120, 19)
    with mock.patch.object(kernel_pass, "applies", lambda model: True), \
            mock.patch.object(kernel_pass, "_graph", lambda model, B, T, w: graphs.setdefault((B, T, w), Graph(B, T))):
        last, kept = kernel_pass.hidden_pass(object(), ids, (0,))
    assert set(graphs) == {(64, 32, (0,))}
    assert torch.equal(last[..., 0], ids) and torch.equal(kept[0][..., 1], -ids)


@cuda
def test_gpu_pass_at_bf16_gives_transformers_signals():
    """The query signals YOCO reads (entropy, NLL) through the kernels and through transformers'
    forward, on a bf16 model: within 0.05 bits."""
    from unittest import mock

    from kite.runtime import kernel_pass
    from kite.yoco.intent import query_signals

    lm = tiny_lm("qwen2", "cuda", torch.bfloat16, layers=3, hidden_size=256, num_attention_heads=4,
                 num_key_value_heads=2)    # head size 64: the kernels take it (16 they do not)
    lm.device = lm.model.device
    assert kernel_pass.applies(lm.model)
    _compare(lm, atol=0.25)
    queries = ["what is the notice period", "who pays", "is there a limit of liability in section 9"]
    fast = query_signals(lm, queries)
    with mock.patch.object(kernel_pass, "applies", lambda model: False):
        slow = query_signals(lm, queries)
    for a, b in zip(fast, slow):
        assert a.tokens == b.tokens
        assert abs(a.intent_entropy - b.intent_entropy) < 0.05
        assert abs(a.nll_bits - b.nll_bits) < 0.05


@cuda
def test_gpu_short_queries_replay_a_captured_pass():
    """A few short queries replay a CUDA graph of the pass (captured once per bucket of rows and
    length): the hidden states of the eager pass over the same ids, within bf16 rounding (a padded
    product may round differently), for every wanted layer; queries longer than every length bucket
    run eagerly."""
    from kite.runtime import kernel_pass

    lm = tiny_lm("qwen2", "cuda", torch.bfloat16, layers=3, hidden_size=256, num_attention_heads=4,
                 num_key_value_heads=2)
    assert kernel_pass.applies(lm.model)
    g = torch.Generator().manual_seed(0)
    for B, T in ((1, 5), (3, 11), (1, 7)):
        ids = torch.randint(5, lm.geometry.vocab_size, (B, T), generator=g)
        last, kept = kernel_pass.hidden_pass(lm.model, ids, (0, 2))
        want_last, want_kept = kernel_pass.kernel_hidden(lm.model, ids, (0, 2))
        assert last.shape == want_last.shape == (B, T, want_last.shape[-1])
        scale = want_last.float().abs().max().item()
        assert (last.float() - want_last.float()).abs().max().item() <= 0.02 * scale
        for k in (0, 2):
            assert (kept[k].float() - want_kept[k].float()).abs().max().item() <= 0.02 * want_kept[k].float().abs().max().item()
    graphs = lm.model.__dict__["_kite_pass_graphs"]
    assert set(graphs) == {(1, 8, (0, 2)), (4, 16, (0, 2))}      # (1, 5) and (1, 7) share one
    long = torch.randint(5, lm.geometry.vocab_size, (2, 200), generator=g)    # longer than every length bucket
    kernel_pass.hidden_pass(lm.model, long, (0, 2))
    assert len(graphs) == 2


@cuda
def test_gpu_more_questions_than_a_graph_holds_replay_it_chunk_by_chunk():
    """120 questions of up to 32 tokens: two replays of the 64-row graph (the second chunk's output
    must not overwrite the first's), within bf16 rounding of the eager pass row by row."""
    from kite.runtime import kernel_pass

    lm = tiny_lm("qwen2", "cuda", torch.bfloat16, layers=3, hidden_size=256, num_attention_heads=4,
                 num_key_value_heads=2)
    ids = torch.randint(5, lm.geometry.vocab_size, (120, 19), generator=torch.Generator().manual_seed(2))
    last, kept = kernel_pass.hidden_pass(lm.model, ids, (1,))
    want_last, want_kept = kernel_pass.kernel_hidden(lm.model, ids, (1,))
    assert set(lm.model.__dict__["_kite_pass_graphs"]) == {(64, 32, (1,))}
    assert last.shape == want_last.shape == (120, 19, want_last.shape[-1])
    for got, want in ((last, want_last), (kept[1], want_kept[1])):
        err = (got.float() - want.float()).abs().amax(dim=(1, 2))
        assert bool((err <= 0.02 * want.float().abs().amax(dim=(1, 2))).all()), err


@cuda
def test_gpu_warm_captures_every_bucket_and_a_burst_replays_one():
    """:func:`warm` captures the pass of every bucket a graph holds (a server's, before its first
    request); a burst of 15 questions then replays the 16-row graph (no new capture), within bf16
    rounding of the eager pass."""
    from kite.runtime import kernel_pass

    lm = tiny_lm("qwen2", "cuda", torch.bfloat16, layers=3, hidden_size=256, num_attention_heads=4,
                 num_key_value_heads=2)
    made = kernel_pass.warm(lm.model, (2, 0))
    graphs = lm.model.__dict__["_kite_pass_graphs"]
    want = {(B, T, (0, 2)) for B in kernel_pass.ROW_BUCKETS for T in kernel_pass.LENGTH_BUCKETS
            if B * T <= kernel_pass.GRAPH_TOKENS}
    assert made == len(want) == len(graphs) and set(graphs) == want and (16, 32, (0, 2)) in want
    ids = torch.randint(5, lm.geometry.vocab_size, (15, 21), generator=torch.Generator().manual_seed(1))
    last, _ = kernel_pass.hidden_pass(lm.model, ids, (0, 2))
    want_last, _ = kernel_pass.kernel_hidden(lm.model, ids, (0, 2))
    assert len(graphs) == len(want)
    assert (last.float() - want_last.float()).abs().max().item() <= 0.02 * want_last.float().abs().max().item()
    with mock.patch.object(kernel_pass, "GRAPHS", False):
        assert kernel_pass.warm(lm.model, (0, 2)) == 0
