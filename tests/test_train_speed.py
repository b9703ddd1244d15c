"""`kite upcycle train` done once per document and in batches gives what the pair-at-a-time run gave:
the teacher of a document's pairs in one forward, states made from a shared capture, prefixes kept
decoded (tiny Llama, CPU). What each stage cost, and a resumed run, are checked on the runs of
tests/test_train.py."""

from __future__ import annotations

import pytest
import torch

from kite.runtime.cache import KVPrefix, new_cache
from kite.runtime.generate import forward_tokens
from kite.upcycle.codec import RegeneratorFit
from kite.upcycle.train.data import Pair
from tests.tiny_models import CORPUS


@pytest.fixture(scope="module")
def tiny_lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["llama"]), device="cpu")


@pytest.fixture(scope="module")
def regenerator(tiny_lm):
    from kite.upcycle.capture import capture

    fit = RegeneratorFit(n_layers=tiny_lm.geometry.n_layers)
    for i in range(2):
        cap = capture(tiny_lm, CORPUS[i * 97:] + CORPUS[:i * 97])
        fit.add(cap.keys_pre, cap.values, cap.ids)
    return fit.finish({"model_fingerprint": tiny_lm.fingerprints.combined})


def _pairs(n=5):
    context = " ".join(CORPUS.split()[:150])
    return [Pair(context, f"\nQuestion {q}: which word comes next?" + " again" * q, f" word {q * 7}.", q + 1)
            for q in range(n)]


def _one_at_a_time(lm, pairs, top_k):
    """The teacher as runs made it before batching: the context prefilled in one forward, then each
    pair's prompt and response after it, one pair per forward."""
    from kite.upcycle.train.adapter import tokenize_pair

    ctx = tokenize_pair(lm.tokenizer, pairs[0])[0]
    cache = new_cache(lm.model)
    forward_tokens(lm.model, ctx, cache, 0)
    out = []
    for p in pairs:
        _, prompt, response = tokenize_pair(lm.tokenizer, p, ctx)
        logits = forward_tokens(lm.model, prompt + response[:-1], cache, len(ctx))[len(prompt) - 1:]
        cache.crop(-(len(prompt) + len(response) - 1))
        logp = torch.log_softmax(logits, dim=-1)
        out.append((torch.topk(logp, top_k, dim=-1).values, logp.gather(1, torch.tensor(response)[:, None])[:, 0]))
    return out


def test_the_teacher_of_a_documents_pairs_in_batches_is_the_teacher_of_each_alone(tiny_lm):
    from kite.upcycle.compress import capture_for
    from kite.upcycle.train.teacher import document_examples

    pairs = _pairs()
    want = _one_at_a_time(tiny_lm, pairs, 16)
    for rows in (1, 3, 8):
        cap = capture_for(tiny_lm, pairs[0].context, keep_cache=True)
        got = document_examples(tiny_lm, pairs, cap.cache, cap.ids, 16, rows=rows)
        assert [e.response_ids for e in got] == [tiny_lm.tokenizer(p.response, add_special_tokens=False)["input_ids"]
                                                 for p in pairs]
        for ex, (top, own) in zip(got, want):
            assert not ex.teacher_logp.is_inference() and ex.teacher_logp.shape == top.shape
            assert torch.allclose(ex.teacher_logp, top, atol=1e-4), rows
            assert torch.allclose(ex.full_logp, own, atol=1e-4), rows
    with pytest.raises(ValueError, match="rows"):
        document_examples(tiny_lm, pairs, cap.cache, cap.ids, 16, rows=0)


def test_states_made_from_a_shared_capture_are_those_compress_makes_alone(tiny_lm, regenerator, tmp_path):
    """The run's capture serves both ratios' states and then the teacher: the states load as those
    compress makes from its own prefill, and the teacher after them is the one-at-a-time teacher."""
    from kite.upcycle.compress import CompressSettings, capture_for, compress_document
    from kite.upcycle.codec import settings_for
    from kite.upcycle.load.prefix import load_prefix
    from kite.upcycle.train.teacher import document_examples

    pairs = _pairs(3)
    text = pairs[0].context
    cap = capture_for(tiny_lm, text, regenerator=regenerator, keep_cache=True)
    for ratio in (8,):
        s = CompressSettings(codec=settings_for(ratio), n_clusters=2, min_span_tokens=8, max_span_tokens=24)
        shared = compress_document(tiny_lm, text, tmp_path / f"shared-{ratio}.upc", s, regenerator=regenerator,
                                   captured=cap)
        alone = compress_document(tiny_lm, text, tmp_path / f"alone-{ratio}.upc", s, regenerator=regenerator)
        assert shared.state_bytes == alone.state_bytes
        a, _ = load_prefix(shared.path, tiny_lm, regenerator=regenerator)
        b, _ = load_prefix(alone.path, tiny_lm, regenerator=regenerator)
        for x, y in zip(a.keys + a.values, b.keys + b.values):
            assert torch.allclose(x, y, atol=1e-5 * float(y.abs().max()))
    got = document_examples(tiny_lm, pairs, cap.cache, cap.ids, 16)
    for ex, (top, own) in zip(got, _one_at_a_time(tiny_lm, pairs, 16)):
        assert torch.allclose(ex.full_logp, own, atol=1e-4)
    bare = capture_for(tiny_lm, text)                 # no hidden states for the clusters: refused, not guessed
    bare.hidden.clear()
    with pytest.raises(ValueError, match="capture_for"):
        compress_document(tiny_lm, text, tmp_path / "x.upc", regenerator=regenerator, captured=bare)


def test_the_prefix_cache_keeps_what_fits_on_the_device_and_loads_the_rest_again():
    from kite.upcycle.train.adapter import PrefixCache

    asked = []

    def load(doc):
        asked.append(doc)
        with torch.inference_mode():
            return KVPrefix([torch.full((2, 10, 4), float(ord(doc)))], [torch.ones(2, 10, 4)], 10)

    one = 2 * 2 * 10 * 4 * 2                           # keys + values of one prefix, fp16
    cache = PrefixCache(load, budget_bytes=2 * one, device="cpu", dtype=torch.float16)
    for doc in "abab":
        p = cache(doc)
    assert asked == ["a", "b"] and cache.nbytes == 2 * one
    assert p.keys[0].dtype == torch.float16 and not p.keys[0].is_inference() and float(p.keys[0][0, 0, 0]) == ord("b")
    cache("c")                                         # past the budget: the least recently used goes
    cache("b")
    cache("a")
    assert asked == ["a", "b", "c", "a"] and cache.loads == 4 and cache.nbytes == 2 * one
