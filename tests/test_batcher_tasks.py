"""Model work handed to the batch's thread (kite.serve.batcher.Batcher.call): it runs there, between
two steps, in arrival order, and the batch goes on decoding around it."""

from __future__ import annotations

import threading

import pytest

from kite.serve.batcher import Batcher
from kite.serve.runner import GenOptions

from tests.waiting import wait_until
from tests.tiny_models import load_tiny_llama


@pytest.fixture(scope="module")
def lm(tiny_models):
    return load_tiny_llama(tiny_models)


@pytest.fixture
def batcher(lm):
    b = Batcher(lm, max_batch=4)
    yield b
    b.close()


def test_work_runs_on_the_batch_thread_and_returns_its_result_or_error(batcher):
    where, waited = batcher.call(lambda: threading.current_thread())
    assert where is batcher._thread and waited >= 0

    def boom():
        raise ValueError("bad input inside the task")

    with pytest.raises(ValueError, match="bad input inside the task"):
        batcher.call(boom)
    # a task that hands over more work runs it at once (no deadlock), and the batcher goes on
    assert batcher.call(lambda: batcher.call(lambda: 7)[0])[0] == 7
    assert batcher.call(lambda: "still here")[0] == "still here"


def test_work_handed_over_during_a_generation_runs_at_the_next_step_boundary(batcher, lm):
    import torch

    ids = lm.tokenizer("Once upon a time", add_special_tokens=True)["input_ids"]
    alone, _ = batcher.generate(ids, None, GenOptions(max_new_tokens=40))
    steps_seen: list[tuple[int, int]] = []
    started = threading.Event()

    def on_text(_piece):
        started.set()

    done: dict = {}

    def generation():
        done["gen"], _ = batcher.generate(ids, None, GenOptions(max_new_tokens=40, on_text=on_text))

    t = threading.Thread(target=generation)
    t.start()
    assert started.wait(30)
    for _ in range(5):   # each waits for the step in progress at most, then the batch steps again
        asked = batcher.steps
        ran_at, _ = batcher.call(lambda: (batcher.steps, torch.ones(4).sum().item()))
        steps_seen.append((asked, ran_at[0]))
        wait_until(lambda: batcher.steps > ran_at[0] or not t.is_alive(), 30, 0.001,
                   "the batch's next step")   # the next call meets another step
    t.join(60)
    assert all(ran - asked <= 1 for asked, ran in steps_seen), steps_seen
    # the generation was not disturbed: the same tokens as alone
    got = done["gen"]
    assert (got.text, got.new_tokens, got.stop_reason) == (alone.text, alone.new_tokens, alone.stop_reason)
    assert got.new_tokens > 10


def test_tasks_run_in_the_order_they_were_handed_over(batcher):
    order: list[int] = []
    gate = threading.Event()
    holding = threading.Event()
    first = threading.Thread(target=lambda: batcher.call(lambda: (holding.set(), gate.wait(10), order.append(0))))
    first.start()
    assert holding.wait(10)   # the first task holds the thread: the next ones queue behind it
    threads = []
    for i in range(1, 5):
        th = threading.Thread(target=lambda i=i: batcher.call(lambda: order.append(i)))
        th.start()
        threads.append(th)
        wait_until(lambda: len(batcher._tasks) == i, 10, 0.001, f"task {i} in the queue")
    gate.set()
    for th in [first, *threads]:
        th.join(10)
    assert order == [0, 1, 2, 3, 4]


def test_a_closed_batcher_refuses_work(lm):
    b = Batcher(lm, max_batch=1)
    b.close()
    with pytest.raises(RuntimeError, match="shutting down"):
        b.call(lambda: 1)


def test_requests_are_prepared_together_and_finished_on_the_batch_thread(batcher, lm):
    """Requests whose preparations wait at the same step boundary are prepared in one call, in arrival
    order, and join the batch after their results' prefixes; a request whose preparation fails gets
    its own error and the others go on; ``finish`` runs on the batch's thread with the generation and
    the preparation, its result on the request (its error fails the request alone)."""
    from types import SimpleNamespace

    from kite.serve.batcher import Preparation

    release = threading.Event()
    calls: list[list] = []
    where: list = []
    ids = lm.tokenizer("Once upon a time", add_special_tokens=True)["input_ids"]
    alone, _ = batcher.generate(ids, None, GenOptions(max_new_tokens=6))

    def together(items):
        calls.append(list(items))
        where.append(threading.current_thread())
        return [ValueError(f"bad {i}") if i == 2 else SimpleNamespace(prefix=None, i=i) for i in items]

    def finish(result, prepared):
        where.append(threading.current_thread())
        if prepared.i == 3:
            raise RuntimeError("feedback failed")
        return (prepared.i, result.new_tokens)

    blocker = threading.Thread(target=lambda: batcher.call(release.wait))
    blocker.start()
    wait_until(lambda: not batcher._tasks, what="the blocking task to start")
    results: dict = {}

    def ask(i):
        try:
            gen, req = batcher.generate(ids, None, GenOptions(max_new_tokens=6),
                                        prepare=Preparation("k", i, together), finish=finish)
            results[i] = (gen.text, req.finished, req.prepared.i)
        except (ValueError, RuntimeError) as exc:
            results[i] = str(exc)

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for n, t in enumerate(askers, 1):
        t.start()
        wait_until(lambda n=n: batcher.queue_length == n, what="the request to be queued")
    release.set()
    for t in askers + [blocker]:
        t.join(timeout=60)
    assert calls == [[0, 1, 2, 3]]
    assert results == {0: (alone.text, (0, 6), 0), 1: (alone.text, (1, 6), 1), 2: "bad 2", 3: "feedback failed"}
    assert set(where) == {batcher._thread}

    def broken(items):
        raise RuntimeError("the whole group failed")

    with pytest.raises(RuntimeError, match="the whole group failed"):
        batcher.generate(ids, None, GenOptions(max_new_tokens=2), prepare=Preparation("other", 1, broken))
    assert batcher.call(lambda: "still here")[0] == "still here"


def test_a_step_that_fails_beyond_repair_stops_the_thread_and_fails_every_request_in_one_line(lm):
    """A step fails and so does its clean-up (as on a GPU whose context an illegal memory access
    broke): the request in the batch, the ones queued and handed-over work all get ModelStopped
    instead of waiting forever, and so does everything after."""
    from kite.serve.batcher import ModelStopped

    b = Batcher(lm, max_batch=1)
    try:
        ids = lm.tokenizer("Once upon a time", add_special_tokens=True)["input_ids"]

        def broken(*a, **k):
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")

        b.decoder.step = broken
        b.decoder.cancel = broken
        errors: dict = {}

        def ask(i):
            try:
                b.generate(ids, None, GenOptions(max_new_tokens=4))
            except ModelStopped as exc:
                errors[i] = str(exc)

        askers = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in askers:
            t.start()
        for t in askers:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in askers)
        assert len(errors) == 3
        msg = errors[0]
        assert "\n" not in msg and "RuntimeError: CUDA error: an illegal memory access" in msg and "restart" in msg
        with pytest.raises(ModelStopped, match="illegal memory access"):
            b.generate(ids, None, GenOptions(max_new_tokens=2))
        with pytest.raises(ModelStopped):
            b.call(lambda: 1)
        assert b.stopped is not None
    finally:
        b.close()
