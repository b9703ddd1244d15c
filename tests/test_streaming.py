"""Streamed text: pieces decoded a few tokens at a time join to the answer's text; a batch hands a
step's pieces out in one call, a decode step's while the next step runs; a server's pieces reach
each event loop in one wake-up."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kite.runtime.batch_decode import BatchDecoder
from kite.runtime.decoding import TextStream
from kite.serve.batcher import LoopText, deliver_to_loops

TEXTS = ["The parties agree that the Licensee shall pay, within thirty (30) days, the sum of $1,200.",
         "naïve café — 東京の契約 😀 déjà vu, «quoted» ½ ∑ ok",
         "  leading spaces, trailing newline\n\n and tabs\tend"]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_decoded_a_few_tokens_at_a_time_join_to_the_whole_text(embedded, text):
    tok = embedded.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces: list[str] = []
    stream = TextStream(tok, pieces.append)
    for n in range(1, len(ids) + 1):
        stream.push(ids[:n])
        assert not any("\ufffd" in p for p in pieces)      # a split character waits for its last byte
    whole = stream.finish(ids)
    assert whole == tok.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == whole
    assert stream.piece(ids) is None                        # nothing more once finished


def test_a_stream_nobody_listens_to_hands_out_nothing(embedded):
    ids = embedded.tokenizer("hello there", add_special_tokens=False)["input_ids"]
    stream = TextStream(embedded.tokenizer, None)
    assert stream.piece(ids) is None
    assert stream.finish(ids) == "hello there"


def test_a_batch_hands_out_a_steps_pieces_at_once_and_a_decode_steps_while_the_next_runs(embedded, one_thread):
    from kite.runtime.generate import encode_prompt

    engine = BatchDecoder(embedded, max_rows=3)
    events: list = []
    forward = engine._forward

    def recorded_forward(group, tokens, reader_on=False, targets=None):
        events.append(("forward", len(group), max(len(t) for t in tokens)))
        return forward(group, tokens, reader_on, targets)

    engine._forward = recorded_forward
    engine.deliver = lambda pieces: events.append(("deliver", [p for _, p in pieces]))
    prompts = [encode_prompt(embedded.tokenizer, q, chat=True) for q in
               ("What is the capital of France?", "Name a colour.", "Count to five.")]
    handles = [engine.add(p, max_new_tokens=6, on_text=lambda piece: None) for p in prompts]
    results = engine.drain()
    # the prefill, then one decode forward a step; every hand-over holds the pieces of every row
    assert events[0][0] == "forward" and events[0][2] > 1
    assert events[1][0] == "deliver" and len(events[1][1]) == 3     # first tokens: at once, all rows
    # the first decode step has nothing to hand out; each later one is launched, and only then the
    # last step's pieces go out (every row's); the ended rows' last text goes out in one hand-over too
    assert events[2][0] == "forward" and events[2][2] == 1
    rest = events[3:]
    assert [e[0] for e in rest] == ["forward", "deliver"] * 4 + ["deliver"]
    assert all(e[2] == 1 for e in rest[:-1:2]) and all(len(e[1]) == 3 for e in rest[1::2])
    for h in handles:
        assert results[h].new_tokens == 6 and results[h].text


def test_the_ended_rows_last_text_goes_out_before_the_step_reports_them(embedded, one_thread):
    from kite.runtime.generate import encode_prompt

    engine = BatchDecoder(embedded, max_rows=3)
    got: dict[int, list[str]] = {}
    calls = []

    def deliver(pieces):
        calls.append(len(pieces))
        for on_text, piece in pieces:
            on_text(piece)

    engine.deliver = deliver
    prompts = [encode_prompt(embedded.tokenizer, q, chat=True) for q in ("Name a fruit.", "Name a city.", "Hi!")]
    handles = [engine.add(p, max_new_tokens=5 + i, on_text=got.setdefault(i, []).append) for i, p in enumerate(prompts)]
    results = {}
    while len(engine):
        for h, r in engine.step().items():       # whatever a step reports has had all its text
            i = handles.index(h)
            assert "".join(got[i]) == r.text
            results[h] = r
    assert len(results) == 3
    cancelled = engine.add(prompts[0], max_new_tokens=20, on_text=got.setdefault(9, []).append)
    engine.step()
    engine.step()
    assert engine.cancel(cancelled)
    r = engine.step()[cancelled]                 # a cancelled row's text too
    assert r.stop_reason == "cancelled" and "".join(got[9]) == r.text


def test_batched_text_streams_the_same_pieces_as_the_answer(embedded, one_thread):
    from kite.runtime.generate import encode_prompt, generate

    prompts = [encode_prompt(embedded.tokenizer, q, chat=True) for q in
               ("Write a haiku about rain.", "¿Dónde está la biblioteca?")]
    engine = BatchDecoder(embedded, max_rows=2)
    pieces = {i: [] for i in range(2)}
    handles = [engine.add(p, max_new_tokens=12, on_text=pieces[i].append) for i, p in enumerate(prompts)]
    results = engine.drain()
    for i, (p, h) in enumerate(zip(prompts, handles)):
        alone = generate(embedded, p, max_new_tokens=12)
        assert results[h].text == alone.text == "".join(pieces[i])


def test_a_steps_pieces_reach_each_event_loop_in_one_wake_up():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    calls = []
    real = loop.call_soon_threadsafe

    def counted(*args):
        calls.append(args)
        return real(*args)

    loop.call_soon_threadsafe = counted
    try:
        queues = [asyncio.Queue() for _ in range(3)]
        direct: list[str] = []
        deliver_to_loops([(LoopText(loop, q), f"piece {i}") for i, q in enumerate(queues)] + [(direct.append, "x")])
        done = threading.Event()
        real(done.set)
        assert done.wait(5)
        assert len(calls) == 1 and direct == ["x"]
        assert [q.get_nowait() for q in queues] == ["piece 0", "piece 1", "piece 2"]
    finally:
        real(loop.stop)
        thread.join(5)
    loop.close()
    deliver_to_loops([(LoopText(loop, asyncio.Queue()), "late")])   # a closed loop: nothing, no error
