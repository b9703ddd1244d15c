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


def _prefix(lm, text):
    from kite.runtime.cache import cache_layers
    from kite.upcycle.capture import tokenize_document

    ids = tokenize_document(lm.tokenizer, text)[0]
    cache = new_cache(lm.model)
    forward_tokens(lm.model, ids, cache, 0)
    return KVPrefix([k[0].clone() for k, _ in cache_layers(cache)], [v[0].clone() for _, v in cache_layers(cache)],
                    len(ids))


def test_pairs_read_in_one_padded_forward_get_the_logits_each_gets_alone(tiny_lm):
    from kite.upcycle.train.adapter import Example, student_batch_logits, student_logits

    words = CORPUS.split()
    prefixes = [_prefix(tiny_lm, " ".join(words[:n])) for n in (60, 25, 90)]
    tok = tiny_lm.tokenizer
    exs = [Example(str(i), tok(f"\nQuestion {i}:" + " more" * i, add_special_tokens=False)["input_ids"],
                   tok(f" answer {i * 3} now", add_special_tokens=False)["input_ids"], torch.zeros(0), torch.zeros(0))
           for i in range(3)]
    batched = student_batch_logits(tiny_lm.model, prefixes, exs)
    for p, ex, got in zip(prefixes, exs, batched):
        want = student_logits(tiny_lm.model, p, ex)
        assert got.shape == want.shape == (len(ex.response_ids), want.shape[-1])
        assert torch.allclose(got, want, atol=1e-4)
    from kite.upcycle.train.report import _state_nll                   # the held-out report's NLLs, batched the same way
    alone = [_state_nll(tiny_lm.model, [p], [ex])[0] for p, ex in zip(prefixes, exs)]
    assert _state_nll(tiny_lm.model, prefixes, exs) == pytest.approx(alone, abs=1e-5)
    torch.stack([g.sum() for g in batched]).sum().backward()       # the rows' grads reach the weights
    assert tiny_lm.model.model.layers[0].self_attn.q_proj.weight.grad is not None
    tiny_lm.model.zero_grad(set_to_none=True)
    cut = KVPrefix([prefixes[0].keys[0][:, :5]] + prefixes[0].keys[1:], prefixes[0].values, 60)
    with pytest.raises(ValueError, match="whole states"):
        student_batch_logits(tiny_lm.model, [cut, prefixes[1]], exs[:2])


def test_an_epoch_of_pairs_in_batches_takes_a_step_per_batch(tiny_lm, tmp_path):
    from kite.upcycle.compress import capture_for
    from kite.upcycle.train.adapter import AdapterSettings, attach_lora, train_adapter
    from kite.upcycle.train.stages import StageTimes
    from kite.upcycle.train.teacher import document_examples

    pairs = _pairs(5)
    cap = capture_for(tiny_lm, pairs[0].context, keep_cache=True)
    examples = document_examples(tiny_lm, pairs, cap.cache, cap.ids, 16)
    prefix = _prefix(tiny_lm, pairs[0].context)
    s = AdapterSettings(target_modules=["q_proj", "o_proj"], r=4, lora_alpha=8, epochs=2, checkpoint_every=4,
                        pairs_per_step=2)
    base = tiny_lm.model
    torch.manual_seed(0)
    peft_model = attach_lora(tiny_lm, s)
    times = StageTimes("cpu")
    try:
        h = train_adapter(peft_model, examples, lambda doc: prefix, s, tmp_path, seed=0, resume=False, times=times)
    finally:
        tiny_lm.model = peft_model.unload()
    assert tiny_lm.model is base
    assert h["steps"] == 6 and len(h["loss"]) == 6 and all(v == v and v >= 0 for v in h["loss"])   # 3 a epoch
    assert h["response_tokens"] == 2 * sum(len(e.response_ids) for e in examples)
    assert times.counts == {"adapter_steps": 6, "checkpoints": 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the split-KV kernel runs on a GPU)")
def test_on_a_gpu_the_adapters_query_projections_learn_through_a_long_prefix(tiny_models):
    """A short query after >= 1,024 cached keys goes to the split-KV kernel on a GPU, which has no
    backward: while the adapter trains, attention stays on autograd's path so q_proj's LoRA gets grads."""
    from kite.model import load_model
    from kite.upcycle.train.adapter import AdapterSettings, Example, attach_lora, student_logits

    lm = load_model(str(tiny_models["llama"]), device="cuda")
    g = lm.geometry
    gen = torch.Generator(device="cuda").manual_seed(0)
    prefix = KVPrefix([torch.randn(g.n_kv_heads, 1100, g.head_dim, device="cuda", generator=gen, dtype=lm.dtype)
                       for _ in range(g.n_layers)],
                      [torch.randn(g.n_kv_heads, 1100, g.head_dim, device="cuda", generator=gen, dtype=lm.dtype)
                       for _ in range(g.n_layers)], 1100)
    torch.manual_seed(0)
    peft_model = attach_lora(lm, AdapterSettings(target_modules=["q_proj", "o_proj"], r=4, lora_alpha=8))
    ex = Example("d", [5, 6, 7], [8, 9, 10], torch.zeros(0), torch.zeros(0))
    student_logits(peft_model, prefix, ex).float().logsumexp(-1).sum().backward()
    grads = {n: p.grad for n, p in peft_model.named_parameters() if "q_proj.lora_B" in n}
    assert len(grads) == g.n_layers and all(v is not None and v.abs().sum() > 0 for v in grads.values())


def test_states_coded_by_host_threads_are_those_coded_in_turn(tiny_lm, regenerator, tmp_path):
    """On a GPU the run codes states on host threads while the device goes on: the same states and
    teachers as coded one after the other (here both on the CPU)."""
    from kite.upcycle.codec.regenerator import install
    from kite.upcycle.load.prefix import load_prefix
    from kite.upcycle.settings import UpcycleConfig
    from kite.upcycle.train.documents import prepare_documents
    from kite.upcycle.train.stages import StageTimes

    install(regenerator)                 # as the run does: its prefixes load with it

    words = CORPUS.split()
    pairs = [Pair(" ".join(words[d * 11:d * 11 + 90]), f"\nQ{q}:", f" A{q}.", d * 2 + q + 1)
             for d in range(3) for q in range(2)]
    cfg = UpcycleConfig.model_validate({"compression": {"cluster_num": 2, "min_span_tokens": 8, "max_span_tokens": 24}})
    got, threads = {}, torch.get_num_threads()
    for workers in (0, 2):
        times = StageTimes("cpu")
        prep = prepare_documents(tiny_lm, pairs, pairs[:4], pairs[4:], regenerator, cfg, [8.0], tmp_path / str(workers),
                                 times, teacher=True, codec_workers=workers)
        assert prep.made == 3 and times.counts["compress"] == 3 and times.counts["load"] == 3
        assert torch.get_num_threads() == threads            # the workers' one thread each, given back
        got[workers] = prep
    for key, path in got[0].states.items():
        a, _ = load_prefix(path, tiny_lm, regenerator=regenerator)
        b, _ = load_prefix(got[2].states[key], tiny_lm, regenerator=regenerator)
        assert all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))
    for x, y in zip(got[0].examples + got[0].held_examples, got[2].examples + got[2].held_examples):
        assert torch.equal(x.teacher_logp, y.teacher_logp) and torch.equal(x.full_logp, y.full_logp)


def test_on_a_gpu_the_states_go_to_host_threads_only_when_the_batched_codec_cannot_take_the_regenerator(regenerator):
    from dataclasses import replace

    from kite.upcycle.train.documents import codec_workers_for

    assert codec_workers_for("cpu", regenerator, [8.0]) == 0
    assert codec_workers_for("cuda", regenerator, [8.0, 16.0]) == 0          # coded on the device, batched
    assert codec_workers_for("cuda", replace(regenerator, choice="measured"), [8.0]) >= 1
    assert codec_workers_for("cuda", None, [8.0]) >= 1
    # bases across layers: their products are the device's work, coded there in turn
    grouped = replace(regenerator, meta={**regenerator.meta, "layer_groups": [[0, regenerator.meta["n_layers"]]]})
    assert codec_workers_for("cuda", grouped, [8.0]) == 0
