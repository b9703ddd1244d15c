"""Documents captured together (one batch, the shorter ones padded at their end) are the captures
each makes alone: keys before RoPE, values, hidden states and the model's cache to continue, with
the chunks' bounds each document's own (tiny Llama, CPU)."""

from __future__ import annotations

import pytest
import torch

from kite.errors import BadInput
from kite.runtime.cache import cache_layers
from kite.runtime.generate import forward_tokens
from kite.upcycle import capture as capture_mod
from kite.runtime import batch
from kite.upcycle.capture import capture, capture_many, iter_captures
from tests.tiny_models import CORPUS


@pytest.fixture(scope="module")
def tiny_lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["llama"]), device="cpu")


def _texts():
    words = CORPUS.split()
    # unlike lengths: the shortest ends inside the first chunk, the longest runs into a third
    return [" ".join(words[:30]), " ".join(words[40:190]), " ".join(words[200:300])]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # the batch's products round otherwise than one document's (on a GPU another kernel may take them)
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-4 * max(1.0, float(b.abs().max())))


def test_documents_captured_together_are_each_captured_alone(tiny_lm):
    _together_as_alone(tiny_lm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_documents_captured_together_are_each_captured_alone(tiny_models):
    from kite.model import load_model

    _together_as_alone(load_model(str(tiny_models["llama"]), device="cuda"))


def _together_as_alone(tiny_lm):
    texts = _texts()
    seen = []
    together = capture_many(tiny_lm, texts, chunk_tokens=64, hidden_layers=(0, 2), keep_cache=True,
                            progress=lambda done, total: seen.append((done, total)))
    alone = [capture(tiny_lm, t, chunk_tokens=64, hidden_layers=(0, 2), keep_cache=True) for t in texts]
    lengths = [c.n_tokens for c in alone]
    assert min(lengths) < 64 < 128 < max(lengths)
    total = sum(lengths)
    assert seen == [(sum(min(end, n) for n in lengths), total) for end in range(64, max(lengths) + 64, 64)]
    assert sum(c.prefill_ms for c in together) == pytest.approx(together[0].prefill_ms * total / lengths[0])
    for got, want in zip(together, alone):
        assert (got.text, got.ids, got.offsets) == (want.text, want.ids, want.offsets)
        for x, y in zip(got.keys_pre + got.values, want.keys_pre + want.values):
            assert x.is_contiguous() and _close(x, y)
        assert sorted(got.hidden) == [0, 2] and all(_close(got.hidden[k], want.hidden[k]) for k in want.hidden)
        for (k, v), (k2, v2) in zip(cache_layers(got.cache), cache_layers(want.cache)):
            assert _close(k, k2) and _close(v, v2)
        # the cache continues the document as its own does
        nxt = got.ids[:5]
        a = forward_tokens(tiny_lm.model, nxt, got.cache, got.n_tokens)
        b = forward_tokens(tiny_lm.model, nxt, want.cache, want.n_tokens)
        assert _close(a, b)


def test_each_documents_query_sums_are_its_own_tokens_without_the_padding(tiny_lm):
    texts = _texts()
    together = capture_many(tiny_lm, texts, chunk_tokens=64, queries=True)
    # the shorter documents are padded in the batch: their sums equal their own alone only without it
    for got, text in zip(together, texts):
        want = capture(tiny_lm, text, chunk_tokens=64, queries=True)
        assert len(got.query_sq) == len(want.query_sq) == tiny_lm.geometry.n_layers
        assert all(x.dtype == torch.float64 and _close(x, y) for x, y in zip(got.query_sq, want.query_sq))
    assert capture_many(tiny_lm, texts[:1], chunk_tokens=64)[0].query_sq == []


def test_one_document_alone_is_captured_as_before(tiny_lm):
    text = _texts()[1]
    (got,) = capture_many(tiny_lm, [text], chunk_tokens=64)
    want = capture(tiny_lm, text, chunk_tokens=64)
    assert got.cache is None and all(torch.equal(x, y) for x, y in zip(got.keys_pre, want.keys_pre))
    assert capture_many(tiny_lm, []) == []


def test_documents_go_together_within_the_devices_token_budget():
    assert batch.forward_groups([2000] * 9, "cuda") == [list(range(8)), [8]]
    # a group's count times its longest: a long document starts a group of its own
    assert batch.forward_groups([100, 100, 9000, 100], "cuda") == [[0, 1], [2], [3]]
    assert batch.forward_groups([20000, 100], "cuda") == [[0], [1]]
    assert batch.forward_groups([10, 10, 10], "cpu") == [[0], [1], [2]]
    assert batch.forward_groups([], "cuda") == []


def test_iterated_captures_prefill_a_group_at_a_time_in_order(tiny_lm, monkeypatch, capture_batches):
    texts = _texts() * 2
    batches = capture_batches
    longest = max(len(tiny_lm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    monkeypatch.setitem(batch.BATCH_TOKENS, "cpu", 3 * longest)     # three documents a forward
    caps = iter_captures(tiny_lm, texts, chunk_tokens=64)
    first = next(caps)
    assert batches == [3]                              # only the first group so far
    rest = list(caps)
    assert batches == [3, 3]
    for got, text in zip([first, *rest], texts):
        want = capture(tiny_lm, text, chunk_tokens=64)
        assert got.ids == want.ids and all(_close(x, y) for x, y in zip(got.values, want.values))


def test_a_bad_document_among_many_is_refused_before_any_prefill(tiny_lm, monkeypatch):
    monkeypatch.setattr(capture_mod, "_prefill", lambda *a: pytest.fail("prefilled"))
    with pytest.raises(BadInput, match="empty"):
        next(iter_captures(tiny_lm, [_texts()[0], ""]))
    with pytest.raises(ValueError, match="2 texts and 1 id lists"):
        capture_many(tiny_lm, ["a", "b"], ids=[[1]])
