"""Batched decoding: every sequence of a batch gets exactly what generate() gives it alone, whatever
its state, whenever it joins or leaves, and whatever the others in the batch do."""

from __future__ import annotations

import pytest
import torch

from kite.errors import BadInput
from kite.runtime.attention import ragged_rows as _ragged_rows   # the real one, under the tests' spy
from kite.runtime.batch_decode import BatchDecoder, BatchFull, BatchKVCache, forward_prompt_rows, forward_rows
from kite.runtime.cache import KVPrefix, cache_layers, new_cache
from kite.runtime.decoding import SequenceDecode
from kite.runtime.generate import forward_tokens, generate


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm(request, tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models[request.param]), device="cpu")


@pytest.fixture(autouse=True)
def token_ids(monkeypatch):
    """Every GenerationResult made during a test carries its new token ids as `.ids` (the result
    itself has only the text)."""
    result = SequenceDecode.result

    def with_ids(self, **kwargs):
        out = result(self, **kwargs)
        out.ids = list(self.new)
        return out

    monkeypatch.setattr(SequenceDecode, "result", with_ids)


def _ids(lm, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, lm.geometry.vocab_size, (n,), generator=g).tolist()


def _document_prefix(lm, doc, keep_per_layer, gap=0, reader=False) -> KVPrefix:
    """The KV of `doc` with layer l keeping the tokens keep_per_layer[l] (a slice); the live tokens
    start `gap` positions after the document."""
    cache = new_cache(lm.model)
    forward_tokens(lm.model, doc, cache, 0)
    layers = cache_layers(cache)
    return KVPrefix([k[0][:, keep] for (k, _), keep in zip(layers, keep_per_layer)],
                    [v[0][:, keep] for (_, v), keep in zip(layers, keep_per_layer)],
                    len(doc) + gap, reader=reader)


@pytest.fixture(scope="module")
def prefixes(lm):
    """Two states whose layers hold different numbers of tokens, one layer none; both leave a gap
    of absent tokens before the live ones (next_position > any layer's length)."""
    n = lm.geometry.n_layers
    every_other = [slice(None)] + [slice(None, None, 2)] * (n - 2) + [slice(0, 0)]
    tail = [slice(0, 0)] + [slice(-10, None)] * (n - 1)
    a = _document_prefix(lm, _ids(lm, 30, 100), every_other, gap=3)
    b = _document_prefix(lm, _ids(lm, 24, 101), tail, gap=5, reader=True)
    assert 0 in a.tokens_per_layer() and 0 in b.tokens_per_layer()
    assert len(set(a.tokens_per_layer())) > 1 and max(a.tokens_per_layer()) < a.next_position
    return a, b


@pytest.mark.parametrize("how", ["masks", "ragged", "causal"], ids=["masks", "each row's keys", "a row at a time"])
def test_one_forward_of_mixed_rows_equals_each_row_alone(lm, prefixes, one_thread, how, monkeypatch):
    """forward_rows: a row prefilling 7 tokens after a state, a row decoding 1, a row prefilling 3
    with another state, in one padded forward over rows that are not consecutive: each row's
    logits equal its own forward alone, through the per-row masks, each row over its own keys only
    (rows of unlike lengths on a CPU), or (a prompt's prefill) a row at a time causal from the
    bottom-right corner."""
    from kite.runtime import attention

    monkeypatch.setattr(attention, "CAUSAL_ROWS_MIN_QUERY", 1 if how == "causal" else 10**9)
    monkeypatch.setattr(attention, "RAGGED_SAVING", 0.0 if how == "ragged" else 2.0)
    calls = []
    monkeypatch.setattr(attention, "ragged_rows", lambda *a, **k: calls.append(1) or _ragged_rows(*a, **k))
    a, b = prefixes
    cache = BatchKVCache(lm.model, max_rows=4)
    rows = [cache.take(a), cache.take(None), cache.take(None), cache.take(b)]
    rows.pop(2)   # taken, but not in these forwards: the rows fed are not one slice of the buffers
    first = _ids(lm, 5, 1)
    forward_rows(lm.model, cache, [rows[1]], [first], [0])     # row 1 has something to decode after
    tokens = [_ids(lm, 7, 2), _ids(lm, 1, 3), _ids(lm, 3, 4)]
    positions = [a.next_position, len(first), b.next_position]
    got = forward_rows(lm.model, cache, rows, tokens, positions)

    alone_1 = new_cache(lm.model)
    forward_tokens(lm.model, first, alone_1, 0)
    want = [forward_tokens(lm.model, tokens[0], new_cache(lm.model, a), a.next_position),
            forward_tokens(lm.model, tokens[1], alone_1, len(first)),
            forward_tokens(lm.model, tokens[2], new_cache(lm.model, b), b.next_position)]
    for g, w in zip(got, want):
        assert g.shape == w.shape and (g - w).abs().max() <= 1e-4
    assert bool(calls) == (how == "ragged")
    # the padded positions wrote nothing: each row holds its prefix and its real tokens only
    assert cache.row_lengths(rows[0]) == [p + 7 for p in a.tokens_per_layer()]
    assert cache.row_lengths(rows[1]) == [6] * lm.geometry.n_layers
    assert cache.bytes_in_use() == sum(sum(cache.row_lengths(r)) for r in rows) * cache.slot_bytes // cache.n_layers


def test_a_prefill_keeps_only_each_rows_last_logits_and_its_prompts_nll(lm, prefixes, one_thread, monkeypatch):
    """forward_prompt_rows: the head runs over the final hidden states a few positions at a time; each
    row's last logits and summed NLL are what the whole logits give (two caches fed alike)."""
    from kite.runtime import batch_decode
    from kite.runtime.decoding import prompt_nll_nats

    monkeypatch.setattr(batch_decode, "HEAD_CHUNK", 3)
    a, _ = prefixes
    tokens = [_ids(lm, 9, 11), _ids(lm, 4, 12)]
    targets = [tokens[0][1:] + [7], tokens[1][1:]]          # a chunk whose last token has a target, and a whole prompt
    caches = [BatchKVCache(lm.model, max_rows=2) for _ in range(2)]
    rows = [[c.take(a), c.take(None)] for c in caches]
    positions = [a.next_position, 0]
    whole = forward_rows(lm.model, caches[0], rows[0], tokens, positions)
    last, nll = forward_prompt_rows(lm.model, caches[1], rows[1], tokens, positions, targets)
    assert last.shape == (2, lm.geometry.vocab_size) and last.dtype == torch.float32
    for b in range(2):
        assert (last[b] - whole[b][-1]).abs().max() <= 1e-4
        assert nll[b] == pytest.approx(prompt_nll_nats(whole[b], targets[b]), rel=1e-5, abs=1e-4)
    assert caches[0].row_lengths(rows[0][0]) == caches[1].row_lengths(rows[1][0])


def test_a_freed_row_takes_the_highest_rows_sequence_so_taken_rows_stay_packed(lm, prefixes, one_thread):
    a, b = prefixes
    cache = BatchKVCache(lm.model, max_rows=4)
    rows = [cache.take(None), cache.take(a), cache.take(None), cache.take(b)]
    forward_rows(lm.model, cache, rows, [_ids(lm, 4, 5), _ids(lm, 2, 6), _ids(lm, 3, 7), _ids(lm, 5, 8)],
                 [0, a.next_position, 0, b.next_position])
    want_len = cache.row_lengths(3)
    want = [(cache.keys[layer][3, :, :n].clone(), cache.values[layer][3, :, :n].clone())
            for layer, n in enumerate(want_len)]
    assert cache.free_many([1]) == {3: 1}          # row 3's sequence now sits in row 1
    assert cache.taken == [True, True, True, False] and cache.row_lengths(3) == [0] * cache.n_layers
    assert cache.row_lengths(1) == want_len
    for layer, (k, v) in enumerate(want):
        n = want_len[layer]
        assert torch.equal(cache.keys[layer][1, :, :n], k) and torch.equal(cache.values[layer][1, :, :n], v)
    assert cache.free_many([2]) == {}              # the highest taken row: nothing to move
    assert cache.taken == [True, True, False, False]


def test_rows_that_leave_together_free_at_once_and_only_rows_that_stay_move(lm, prefixes, one_thread):
    """Six rows, rows 0, 2 and 5 leave in one call: the two rows that stay above the packed three
    (4, 3) move into the freed rows below (1 stays), the highest into the lowest, each with its
    slots; a row that leaves is never copied."""
    a, b = prefixes
    cache = BatchKVCache(lm.model, max_rows=6)
    seeds = [None, a, None, b, a, None]
    rows = [cache.take(x) for x in seeds]
    forward_rows(lm.model, cache, rows, [_ids(lm, 2 + r, 20 + r) for r in rows],
                 [0 if x is None else x.next_position for x in seeds])
    want = {r: (cache.row_lengths(r), [(cache.keys[layer][r].clone(), cache.values[layer][r].clone())
                                       for layer in range(cache.n_layers)]) for r in (1, 3, 4)}
    assert cache.free_many([5, 0, 2]) == {4: 0, 3: 2}
    assert cache.taken == [True, True, True, False, False, False]
    assert [cache.row_lengths(r) == [0] * cache.n_layers for r in (3, 4, 5)] == [True] * 3
    for new, old in ((0, 4), (1, 1), (2, 3)):
        lengths, kv = want[old]
        assert cache.row_lengths(new) == lengths
        for layer, (k, v) in enumerate(kv):
            n = lengths[layer]
            assert torch.equal(cache.keys[layer][new, :, :n], k[:, :n])
            assert torch.equal(cache.values[layer][new, :, :n], v[:, :n])
    with pytest.raises(ValueError, match="row 4 is not taken"):
        cache.free_many([4])
    assert cache.free_many([0, 1, 2]) == {} and cache.taken == [False] * 6


def test_sequences_that_end_in_one_step_leave_the_others_decoding_where_they_moved(lm, prefixes, one_thread):
    """Rows 0, 2 and 3 end in the same step; the rows that stay (one of them moved down) go on to
    generate()'s tokens."""
    a, b = prefixes
    requests = [(_ids(lm, 4, 30), None, 3), (_ids(lm, 5, 31), a, 9), (_ids(lm, 3, 32), b, 3),
                (_ids(lm, 6, 33), None, 3), (_ids(lm, 2, 34), b, 7)]
    alone = [generate(lm, p, prefix=x, max_new_tokens=n, stop_ids=set()) for p, x, n in requests]
    engine = BatchDecoder(lm, max_rows=5)
    handles = [engine.add(p, prefix=x, max_new_tokens=n, stop_ids=set()) for p, x, n in requests]
    ended_at, results, steps = {}, {}, 0
    while len(engine):
        steps += 1
        ended = engine.step()
        results.update(ended)
        ended_at.update({h: steps for h in ended})
    assert len({ended_at[handles[i]] for i in (0, 2, 3)}) == 1 < ended_at[handles[4]] < ended_at[handles[1]]
    for h, want in zip(handles, alone):
        assert results[h].ids == want.ids


def test_batch_equals_one_at_a_time(lm, prefixes, one_thread):
    """Six requests through three rows: joining at different steps, with and without states, one
    ended by an end token, one cancelled mid-way (its row reused), different lengths: every
    finished one has generate()'s token ids, text, stop reason and prompt NLL."""
    a, b = prefixes
    requests = [  # prompt, prefix, max_new_tokens
        (_ids(lm, 5, 10), None, 10),
        (_ids(lm, 9, 11), a, 6),
        (_ids(lm, 1, 12), b, 12),      # a one-token prompt: no prompt NLL
        (_ids(lm, 12, 13), None, 16),  # ended by an end token (below)
        (_ids(lm, 3, 14), a, 8),
        (_ids(lm, 7, 15), b, 20),      # cancelled after its third token
    ]
    alone = [generate(lm, p, prefix=x, max_new_tokens=n, stop_ids=set()) for p, x, n in requests]
    eos = alone[3].ids[4]
    assert eos not in alone[3].ids[:4]
    stops = [set()] * 3 + [{eos}] + [set()] * 2
    alone[3] = generate(lm, requests[3][0], max_new_tokens=16, stop_ids={eos})
    assert alone[3].stop_reason == "eos" and alone[3].new_tokens == 4

    engine = BatchDecoder(lm, max_rows=3)
    pieces: dict[int, list[str]] = {}

    def add(i):
        prompt, prefix, n = requests[i]
        pieces[i] = []
        return engine.add(prompt, prefix=prefix, max_new_tokens=n, stop_ids=stops[i], on_text=pieces[i].append)

    handles = {0: add(0), 1: add(1)}
    results = engine.step()
    handles[5] = add(5)                       # joins while 0 and 1 decode
    results.update(engine.step())
    results.update(engine.step())
    results.update(engine.step())
    assert engine.cancel(handles[5]) and not engine.cancel(handles[5])
    assert engine.cache.free_rows() == 1      # the cancelled sequence's row is free at once
    handles[2] = add(2)                       # and taken again
    waiting = [3, 4]
    while len(engine) or waiting:
        while waiting and engine.fits(len(requests[waiting[0]][0]), requests[waiting[0]][1]):
            i = waiting.pop(0)
            handles[i] = add(i)
        results.update(engine.step())
    assert sorted(results) == sorted(handles.values())

    for i, want in enumerate(alone):
        got = results[handles[i]]
        if i == 5:
            assert got.stop_reason == "cancelled" and got.ids == want.ids[:3] and got.new_tokens == 3
            continue
        assert got.ids == want.ids, f"request {i}"
        assert (got.text, got.new_tokens, got.stop_reason) == (want.text, want.new_tokens, want.stop_reason)
        assert (got.prompt_tokens, got.prefix_tokens) == (want.prompt_tokens, want.prefix_tokens)
        assert (got.prompt_nll_bits is None) == (want.prompt_nll_bits is None)
        if want.prompt_nll_bits is not None:
            assert got.prompt_nll_bits == pytest.approx(want.prompt_nll_bits, abs=1e-4)
        assert "".join(pieces[i]) == got.text
        assert 0 < got.ttft_ms <= got.total_ms
    assert engine.cache.free_rows() == 3 and engine.cache.bytes_in_use() == 0
    assert engine.cache.rows_allocated == 3


def test_seeded_sampling_equals_generate(lm, prefixes, one_thread):
    a, _ = prefixes
    requests = [(_ids(lm, 6, 20), None, 7), (_ids(lm, 4, 21), a, 11), (_ids(lm, 8, 22), None, 3)]
    alone = [generate(lm, p, prefix=x, max_new_tokens=12, temperature=0.9, top_p=0.9, seed=s, stop_ids=set())
             for p, x, s in requests]
    engine = BatchDecoder(lm, max_rows=4)
    handles = [engine.add(p, prefix=x, max_new_tokens=12, temperature=0.9, top_p=0.9, seed=s, stop_ids=set())
               for p, x, s in requests]
    results = engine.drain()
    assert [results[h].ids for h in handles] == [r.ids for r in alone]
    greedy = generate(lm, requests[0][0], max_new_tokens=12, stop_ids=set())
    assert alone[0].ids != greedy.ids   # the sampling was not just argmax


def test_bad_requests_are_refused(lm, prefixes, one_thread):
    engine = BatchDecoder(lm, max_rows=1)
    with pytest.raises(BadInput, match="empty"):
        engine.add([])
    with pytest.raises(BadInput, match="context"):
        engine.add(_ids(lm, 10, 30), max_new_tokens=lm.geometry.context_length)
    with pytest.raises(BadInput, match="context"):
        engine.add(_ids(lm, 10, 30), prefix=prefixes[0], max_new_tokens=lm.geometry.context_length - 20)
    assert len(engine) == 0 and engine.cache.free_rows() == 1
    engine.add(_ids(lm, 3, 31), max_new_tokens=2)
    assert not engine.fits(3)
    with pytest.raises(BatchFull, match="rows"):
        engine.add(_ids(lm, 3, 32))


def test_reserved_rows_are_allocated_up_front_within_the_budget(lm, prefixes, one_thread):
    """BatchDecoder.reserve allocates every row for its tokens at once (requests that fit never regrow
    the buffers); a reservation past the byte budget is refused."""
    engine = BatchDecoder(lm, max_rows=3, max_kv_bytes=BatchKVCache(lm.model, max_rows=1).bytes_for(3, 256))
    engine.reserve(200)
    buffers = engine.cache.keys[0].data_ptr()
    assert engine.cache.rows_allocated == 3 and engine.cache.capacity >= 200
    for n in (30, 50, 20):
        engine.add(_ids(lm, n, n), prefix=prefixes[0], max_new_tokens=8)
    assert len(engine.drain()) == 3
    assert engine.cache.keys[0].data_ptr() == buffers
    with pytest.raises(BatchFull, match="budget"):
        engine.reserve(1000)                                        # not one row of 1,000 tokens fits
    fewer = BatchDecoder(lm, max_rows=3, max_kv_bytes=BatchKVCache(lm.model, max_rows=1).bytes_for(2, 256))
    fewer.reserve(256)                                               # as many rows as the budget holds
    assert fewer.cache.rows_allocated == 2


def test_the_kv_budget_bounds_what_is_admitted(lm, prefixes, one_thread):
    """A byte budget: the buffers never pass it; a request whose worst case would is refused until
    room frees up."""
    probe = BatchKVCache(lm.model, max_rows=2)
    budget = probe.bytes_for(2, 128)
    engine = BatchDecoder(lm, max_rows=2, max_kv_bytes=budget)
    first = engine.add(_ids(lm, 40, 40), max_new_tokens=60)        # worst case 99 slots
    assert not engine.fits(40, max_new_tokens=100)                  # would need 139 > 128
    with pytest.raises(BatchFull, match="room"):
        engine.add(_ids(lm, 40, 41), max_new_tokens=100)
    second = engine.add(_ids(lm, 20, 42), prefix=prefixes[0], max_new_tokens=20)
    results = engine.drain()
    assert sorted(results) == [first, second]
    assert engine.cache.bytes_reserved() <= budget
    assert engine.fits(40, max_new_tokens=100) is False and engine.fits(40, max_new_tokens=80)


def test_reader_adapter_sequences_run_apart_from_the_others(tiny_models, tmp_path, one_thread):
    """The reader adapter switches the whole model: a batch holding sequences after a state made
    for it and sequences without one gives each what generate() gives it (adapter on or off)."""
    from dataclasses import replace

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kite.model import load_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                    init_lora_weights=False)).save_pretrained(tmp_path / "reader")
    lm = load_model(str(tiny_models["llama"]), adapter=tmp_path / "reader", device="cpu")
    n = lm.geometry.n_layers
    plain = _document_prefix(lm, _ids(lm, 20, 50), [slice(None)] * (n - 1) + [slice(0, 0)], gap=2)
    reader = replace(plain, reader=True)
    requests = [(_ids(lm, 4, 51), reader), (_ids(lm, 6, 52), None), (_ids(lm, 3, 53), plain),
                (_ids(lm, 5, 54), reader)]
    alone = [generate(lm, p, prefix=x, max_new_tokens=8, stop_ids=set()) for p, x in requests]
    assert [r.reader_adapter for r in alone] == [True, False, False, True]
    engine = BatchDecoder(lm, max_rows=4)
    handles = [engine.add(p, prefix=x, max_new_tokens=8, stop_ids=set()) for p, x in requests]
    results = engine.drain()
    for h, want in zip(handles, alone):
        got = results[h]
        assert (got.ids, got.reader_adapter) == (want.ids, want.reader_adapter)
    # the adapter mattered: after the same KV without it, the first answer differs
    off = generate(lm, requests[0][0], prefix=plain, max_new_tokens=8, stop_ids=set())
    assert off.ids != alone[0].ids


@pytest.mark.slow
def test_embedded_batch_equals_one_at_a_time(embedded, one_thread):
    """The embedded model: three chat questions and a question after a document state (its later
    layers holding half the document), 16 new tokens, batched == alone."""
    from kite.runtime.generate import encode_prompt

    tok = embedded.tokenizer
    doc = tok(open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()[:1200],
              add_special_tokens=False)["input_ids"]
    n = embedded.geometry.n_layers
    state = _document_prefix(embedded, doc, [slice(None)] * (n // 2) + [slice(None, None, 2)] * (n - n // 2))
    prompts = [encode_prompt(tok, q, chat=True) for q in
               ("What is the capital of France?", "Name three colours.", "Write a haiku about rain.")]
    requests = [(p, None) for p in prompts] + [
        (tok("\nIn short, the license grants", add_special_tokens=False)["input_ids"], state)]
    alone = [generate(embedded, p, prefix=x, max_new_tokens=16) for p, x in requests]
    engine = BatchDecoder(embedded, max_rows=4)
    handles = [engine.add(p, prefix=x, max_new_tokens=16) for p, x in requests]
    results = engine.drain()
    for h, want in zip(handles, alone):
        got = results[h]
        assert (got.ids, got.text, got.stop_reason) == (want.ids, want.text, want.stop_reason)
    assert "Paris" in results[handles[0]].text


@pytest.mark.parametrize("codec", ["exact", "ratio=8"])
def test_a_budgeted_sequence_in_a_batch_equals_its_budgeted_cache_alone(lm, prefixes, one_thread, codec):
    """A long prompt under a KV memory budget joins a batch beside a request with a state: its
    prompt goes in block-sized chunks, its older tokens are coded into blocks between forwards, its
    row never holds more than the budget plus one chunk, and it gets generate()'s tokens and budget
    report with a BudgetCache alone (the lossless codec: to 1e-4 logits, so the same greedy tokens)."""
    from kite.upcycle import BudgetCache, BudgetRow, BudgetSettings

    settings = BudgetSettings(budget_tokens=48, codec=codec, block_tokens=16)
    long_prompt = _ids(lm, 150, 21)
    cache = BudgetCache(lm.model, settings)
    alone = generate(lm, long_prompt, cache=cache, prefill_chunk=16, max_new_tokens=40, stop_ids=set())
    other_prompt, other_prefix = _ids(lm, 6, 22), prefixes[0]
    other_alone = generate(lm, other_prompt, prefix=other_prefix, max_new_tokens=30, stop_ids=set())

    engine = BatchDecoder(lm, max_rows=2)
    h_other = engine.add(other_prompt, prefix=other_prefix, max_new_tokens=30, stop_ids=set())
    memory = BudgetRow(lm.model, settings)
    h = engine.add(long_prompt, max_new_tokens=40, stop_ids=set(), memory=memory)
    row, most = None, 0
    results = {}
    while len(engine):
        results.update(engine.step())
        for seq in engine._active.values():
            if seq.memory is memory:
                row = seq.row
                most = max(most, int(engine.cache.lengths[:, row].max()))
    got = results[h]
    assert got.ids == alone.ids and got.stop_reason == alone.stop_reason
    assert got.prompt_nll_bits == pytest.approx(alone.prompt_nll_bits, abs=1e-4)
    assert results[h_other].ids == other_alone.ids
    assert most <= settings.budget_tokens   # after every forward (the chunk in flight comes on top)
    want, have = cache.stats(), memory.stats()
    for key in ("tokens", "raw_tokens", "compressed_tokens", "blocks_per_layer", "compressed_bytes",
                "codec_bytes", "raw_bytes", "raw_kv_bytes", "kv_bytes"):
        assert have[key] == want[key], key
    assert have["compressed_tokens"] > 0


def test_a_row_with_a_memory_cannot_start_from_a_state(lm, prefixes, one_thread):
    from kite.upcycle import BudgetRow, BudgetSettings

    engine = BatchDecoder(lm, max_rows=2)
    with pytest.raises(ValueError, match="not both"):
        engine.add(_ids(lm, 5, 1), prefix=prefixes[0],
                   memory=BudgetRow(lm.model, BudgetSettings(budget_tokens=48, block_tokens=16)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_on_a_gpu_a_prompt_after_a_state_attends_a_row_at_a_time_as_it_would_alone(tiny_models, model, monkeypatch):
    """The lower-right causal path on a GPU (flash attention where it runs, GQA for qwen2): a prompt
    after a state, one on an empty row and a padded shorter one give each row's logits alone (fp32)."""
    from kite.model import load_model
    from kite.runtime import attention

    monkeypatch.setattr(attention, "CAUSAL_ROWS_MIN_QUERY", 1)
    gpu = load_model(str(tiny_models[model]), device="cuda", dtype="fp32")
    doc = _ids(gpu, 40, 200)
    a = _document_prefix(gpu, doc, [slice(None)] * gpu.geometry.n_layers)
    cache = BatchKVCache(gpu.model, max_rows=3)
    rows = [cache.take(a), cache.take(None), cache.take(None)]
    tokens = [_ids(gpu, 33, 201), _ids(gpu, 40, 202), _ids(gpu, 9, 203)]
    got = forward_rows(gpu.model, cache, rows, tokens, [a.next_position, 0, 0])
    want = [forward_tokens(gpu.model, tokens[0], new_cache(gpu.model, a), a.next_position),
            forward_tokens(gpu.model, tokens[1], new_cache(gpu.model), 0),
            forward_tokens(gpu.model, tokens[2], new_cache(gpu.model), 0)]
    for g, w in zip(got, want):
        assert g.shape == w.shape and (g - w).abs().max() <= 1e-3


def test_a_burst_of_long_prompts_is_prefilled_in_forwards_within_the_token_budget(lm, prefixes, one_thread,
                                                                                   monkeypatch):
    """With PREFILL_TOKENS of 24: prompts of 20, 3, 11 and 9 tokens (one after a state) are prefilled in
    the same step by forwards of rows x longest ≤ 24 (the 20 alone) and, on the CPU, of at most 25 %
    padding (the 3 alone), and each answer is generate()'s."""
    from kite.runtime import batch_decode

    monkeypatch.setattr(batch_decode, "PREFILL_TOKENS", 24)
    a, _ = prefixes
    requests = [(_ids(lm, 20, 30), None), (_ids(lm, 3, 31), a), (_ids(lm, 11, 32), None), (_ids(lm, 9, 33), None)]
    alone = [generate(lm, p, prefix=x, max_new_tokens=5, stop_ids=set()) for p, x in requests]
    engine = BatchDecoder(lm, max_rows=4)
    fed = []
    prefill = engine._prefill
    engine._prefill = lambda group: fed.append(sorted(len(s.prompt_ids) for s in group)) or prefill(group)
    handles = [engine.add(p, prefix=x, max_new_tokens=5, stop_ids=set()) for p, x in requests]
    first = engine.step()
    assert fed == [[3], [9, 11], [20]] and not first       # one step: three forwards, every row prefilled
    assert all(s.prefilled for s in engine._active.values())
    results = {**first, **engine.drain()}
    for h, want in zip(handles, alone):
        assert results[h].ids == want.ids
        assert results[h].prompt_nll_bits == pytest.approx(want.prompt_nll_bits, abs=1e-4)


def test_a_cpu_prefill_splits_prompts_of_unlike_lengths_rather_than_pad_them():
    """Prompts of 25-31 and 80 tokens: one forward padded to 80 would compute 640 token rows for 431
    of their own; within 25 % padding they go as two forwards (the budget still cuts first)."""
    from kite.runtime.batch_decode import _prefill_parts

    class Row:
        def __init__(self, row, n):
            self.row, self.n = row, n

        def next_chunk(self):
            return [0] * self.n

    rows = [Row(i, n) for i, n in enumerate([80, 25, 80, 31, 25, 80, 30, 80])]
    lengths = [[r.n for r in part] for part in _prefill_parts(rows, 32768, 0.25)]
    assert lengths == [[25, 31, 25, 30], [80, 80, 80, 80]]                # each part in row order
    assert [len(p) for p in _prefill_parts(rows, 32768)] == [8]          # a GPU pads: one forward
    assert [len(p) for p in _prefill_parts(rows, 200, 0.25)] == [4, 2, 2]   # the budget cuts first
