"""Continuous batching for `kite serve`: concurrent requests decode together, one step at a time.

One scheduler thread owns a :class:`kite.runtime.batch_decode.BatchDecoder`. Requests wait in a
first-come queue; at every step boundary the scheduler admits the queue's head while a row and the
KV budget allow (a request joins with its own loaded state, or none), cancels the requests whose
clients left, and runs one step: the newcomers' prompts are prefilled, every running sequence gets
one token, streamed text goes out through each request's ``on_text``. A sequence that ends leaves
its row at once. Strict arrival order: a head that does not fit yet waits for rooms to free up, and
one that can never fit (alone it would pass the KV budget) is refused.

The scheduler's thread is the model's only thread. A request is one object through it: the work it
needs before joining (a :class:`Preparation`: YOCO's decision and the state's load, run together for
every request that arrived since the last step — YOCO's pass over their queries is one forward, not
one each — then admitted at the same boundary), its rows' steps, and the work after it ends (its
``finish``: the measured gain), with no hand-back to the request's own thread in between. Other
model work (an upload's upcycle) is handed over with :meth:`Batcher.call` and runs between two
steps, in arrival order. One
thread keeps one OpenMP team: a second thread that runs torch work starts a second team, and
libgomp, seeing more of its threads than cores, stops letting idle workers spin, so every parallel
region of every step waits for a worker to wake (on the 2-core dev box a 6-row step in `kite serve` went
from 152 to 131 ms once only this thread ran torch; docs/PERFORMANCE.md "Continuous batching"). This is the
scheduling vLLM and SGLang call continuous (iteration-level) batching, without their paged KV: each
row is one contiguous block per layer (docs/serving.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from kite.errors import BadInput, KiteError
from kite.runtime.batch_decode import BatchDecoder
from kite.runtime.resident import ResidentPrefix
from kite.runtime.row_memory import RowMemory

if TYPE_CHECKING:
    from kite.model import LoadedModel

_log = logging.getLogger("kite.serve")


class ModelStopped(KiteError):
    """The model's thread stopped on an error it could not recover from (a failed step whose clean-up
    failed too, e.g. a GPU whose context an illegal memory access broke): every request waiting on it
    and every later one gets this, and the server's /healthz answers 503, until it is restarted."""


@dataclass(eq=False)
class Preparation:
    """Model work a request needs before it joins the batch: the preparations of one ``key`` waiting
    at a step boundary run in one ``run(items)`` on the model's thread, which gives one result or
    exception per item, in order; the request joins the batch after the result's ``prefix`` at that
    same boundary (an exception fails it alone)."""

    key: object
    item: object
    run: Callable[[list], list]


@dataclass(eq=False)
class BatchRequest:
    """One request's way through the batch; ``future`` gets its GenerationResult (or the error).
    ``prepare``: its work before it joins (its result in ``prepared``); ``finish(result, prepared)``:
    its work after its sequence ends, on the model's thread before the future is set (its result in
    ``finished``)."""

    prompt_ids: list[int]
    prefix: ResidentPrefix | None
    opts: object                      # kite.serve.runner.GenOptions
    memory: RowMemory | None = None   # a budgeted request's older tokens (kite.upcycle.BudgetRow)
    prepare: Preparation | None = None
    finish: Callable[[object, object], object] | None = None
    future: Future = field(default_factory=Future)
    queued_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    handle: int | None = None
    cancelled: bool = False
    ready: bool = True                # prepared (or nothing to prepare): may join
    prepared: object = None
    finished: object = None

    def __post_init__(self) -> None:
        self.ready = self.prepare is None

    @property
    def wait_ms(self) -> float:
        """Time from its arrival to joining the batch, its preparation included (so far, while it waits)."""
        end = self.admitted_at if self.admitted_at is not None else time.perf_counter()
        return (end - self.queued_at) * 1e3


@dataclass(eq=False)
class ModelTask:
    """Work for the model's thread (:meth:`Batcher.call`): ``fn()``'s result or error in ``future``."""

    fn: Callable[[], object]
    future: Future = field(default_factory=Future)
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        self.started_at = time.perf_counter()
        try:
            self.future.set_result(self.fn())
        except BaseException as exc:  # noqa: BLE001 - the caller gets it
            self.future.set_exception(exc)


def run_tasks(tasks: list[ModelTask]) -> None:
    """Run the work handed over before a step boundary, in arrival order."""
    for task in tasks:
        task.run()


class LoopText:
    """A request's ``on_text`` that puts each piece on an asyncio queue of ``loop`` from the model's
    thread. :func:`deliver_to_loops` hands a step's pieces for one loop over in one call (one wake-up
    of the loop, one hand-over of the GIL) instead of one a row."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop, queue):
        self.loop, self.queue = loop, queue

    def __call__(self, piece: str) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, piece)


def deliver_to_loops(pieces: list[tuple[Callable[[str], None], str]]) -> None:
    """The batch's ``deliver`` in a server: the pieces for :class:`LoopText` receivers in one
    ``call_soon_threadsafe`` per event loop (in order), any other receiver called as it is. A loop
    that has closed (its server is stopping) gets nothing."""
    by_loop: dict = {}
    for on_text, piece in pieces:
        if isinstance(on_text, LoopText):
            by_loop.setdefault(on_text.loop, []).append((on_text.queue, piece))
        else:
            on_text(piece)
    for loop, puts in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, puts)
        except RuntimeError:   # the loop is closed
            pass


def _put_all(puts: list) -> None:
    for queue, piece in puts:
        queue.put_nowait(piece)


class Leaving:
    """A client that may leave before its request joins the batch: :meth:`leave` cancels it
    whenever that happens (pass :meth:`attach` as ``GenOptions.on_request``)."""

    def __init__(self, batcher: "Batcher"):
        self.batcher, self.req, self.gone = batcher, None, False
        self._lock = threading.Lock()

    def attach(self, req: BatchRequest) -> None:
        with self._lock:
            self.req = req
            gone = self.gone
        if gone:
            self.batcher.cancel(req)

    def leave(self) -> None:
        with self._lock:
            self.gone = True
            req = self.req
        if req is not None:
            self.batcher.cancel(req)


class Batcher:
    """The scheduler thread over one model (``lm``), and the only thread that runs it (:meth:`call`).
    ``max_batch``: sequences decoding at once; ``max_kv_bytes``: the batch's KV buffers (None:
    unbounded). ``on_step(queue_length, rows, cancelled, seconds, kind)`` is called after every step
    (metrics: the queue left, the sequences the step ran, those it dropped because their clients left,
    the step's wall time, and what it ran: "prefill" for newcomers' prompts only, "decode" for one token
    a row, "mixed" for both). ``reserve_tokens``: every row's KV allocated for that many tokens before
    the first request (BatchDecoder.reserve), on the model's thread."""

    def __init__(self, lm: LoadedModel, *, max_batch: int = 8, max_kv_bytes: int | None = None,
                 reserve_tokens: int | None = None, on_step=None):
        if max_batch < 1:
            raise BadInput(f"--max-batch {max_batch}: at least 1")
        self.lm, self.on_step = lm, on_step
        self.decoder = BatchDecoder(lm, max_batch, max_kv_bytes=max_kv_bytes)
        self.decoder.deliver = deliver_to_loops
        self._queue: deque[BatchRequest] = deque()
        self._tasks: deque[ModelTask] = deque()
        self._running: dict[int, BatchRequest] = {}
        self._wake = threading.Condition()
        self._closed = False
        self.stopped: ModelStopped | None = None    # set when the model's thread could not go on
        self._thread = threading.Thread(target=self._loop, name="kite-batcher", daemon=True)
        self.steps = 0
        self.cancelled = 0     # sequences dropped because their clients left (queued or decoding)
        self._thread.start()
        if reserve_tokens is not None:
            try:
                self.call(lambda: self.decoder.reserve(reserve_tokens))
            except BaseException:
                self.close()
                raise

    # -- other model work ----------------------------------------------------------------------------
    def call(self, fn: Callable[[], object], since: float | None = None) -> tuple[object, float]:
        """Run ``fn()`` on the model's thread at the next step boundary, after the work handed over
        before it; (its result, ms it waited to start, counted from ``since`` when given). Its error is
        raised here. Called from the model's thread itself (``fn`` inside another task), it runs at once."""
        if threading.current_thread() is self._thread:
            t0 = time.perf_counter()
            return fn(), ((t0 - since) * 1e3 if since is not None else 0.0)
        return self._hand_over(ModelTask(fn), since)

    def check_running(self) -> None:
        """ModelStopped (a fresh one, naming the error) once the model's thread has stopped."""
        if self.stopped is not None:
            raise ModelStopped(str(self.stopped))

    def _hand_over(self, task: ModelTask, since: float | None) -> tuple[object, float]:
        """Queue ``task`` for the next step boundary and wait: (its result, ms it waited to start)."""
        if since is not None:
            task.queued_at = since
        with self._wake:
            self.check_running()
            if self._closed:
                raise RuntimeError("the server is shutting down")
            self._tasks.append(task)
            self._wake.notify()
        result = task.future.result()
        return result, (task.started_at - task.queued_at) * 1e3

    # -- requests ----------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], prefix: ResidentPrefix | None, opts,
               memory: RowMemory | None = None, prepare: Preparation | None = None,
               finish: Callable[[object, object], object] | None = None) -> BatchRequest:
        """Queue a request; it joins the batch at the next step boundary it fits (its ``prepare`` run
        first, at that boundary, with the others waiting for theirs). ``memory``: where its older tokens
        go (a memory-budgeted completion: its prompt is fed a chunk a step). ``finish(result,
        prepared)``: run on the model's thread when its sequence ends (see :class:`BatchRequest`)."""
        req = BatchRequest(list(prompt_ids), prefix, opts, memory, prepare, finish)
        if opts.queued_at is not None:
            req.queued_at = opts.queued_at
        with self._wake:
            self.check_running()
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._queue.append(req)
            self._wake.notify()
        return req

    def generate(self, prompt_ids: list[int], prefix: ResidentPrefix | None, opts,
                 memory: RowMemory | None = None, prepare: Preparation | None = None,
                 finish: Callable[[object, object], object] | None = None) -> tuple[object, BatchRequest]:
        """Submit and wait: (GenerationResult, the request: its ``prepared`` and ``finished``).
        ``opts.on_request(req)``, when set, gets the request first (to :meth:`cancel` it). Cancelled in
        the batch: stop_reason "cancelled"; still queued: concurrent.futures.CancelledError; its
        preparation's or finish's error is raised here."""
        req = self.submit(prompt_ids, prefix, opts, memory, prepare, finish)
        if getattr(opts, "on_request", None) is not None:
            opts.on_request(req)
        return req.future.result(), req

    def cancel(self, req: BatchRequest) -> None:
        """Drop a request (its client left): from the queue now, from the batch at the next step."""
        with self._wake:
            req.cancelled = True
            if req in self._queue:
                self._queue.remove(req)
                req.future.cancel()
                self.cancelled += 1
            self._wake.notify()

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def batch_size(self) -> int:
        return len(self._running)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)
        for req in list(self._queue) + list(self._running.values()) + list(self._tasks):
            if not req.future.done():
                req.future.set_exception(RuntimeError("the server is shutting down"))

    # -- the scheduler -----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._schedule()
        except BaseException as exc:  # noqa: BLE001 - the thread cannot go on: nobody may wait on it
            self._stop(exc)

    def _stop(self, exc: BaseException) -> None:
        """The model's thread ends on ``exc``: every queued, running and handed-over request fails with
        :class:`ModelStopped` (one line naming the error), and so does every later one."""
        first = (str(exc).strip().splitlines() or [""])[0]
        err = ModelStopped(f"the model's thread stopped on {type(exc).__name__}: {first} (restart the server)")
        _log.error("the model's thread stopped", exc_info=exc)
        with self._wake:
            self.stopped, self._closed = err, True
            pending = list(self._queue) + list(self._running.values()) + list(self._tasks)
            self._queue.clear()
            self._tasks.clear()
            self._running.clear()
        for req in pending:
            if not req.future.done():
                req.future.set_exception(ModelStopped(str(err)))

    def _schedule(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._queue and not self._running and not self._tasks:
                    self._wake.wait()
                if self._closed:
                    return
                tasks = list(self._tasks)   # what was handed over before this step boundary
                self._tasks.clear()
            if tasks:
                self.decoder.flush_text()   # the last step's text does not wait for this work
            run_tasks(tasks)
            self._prepare_arrivals()
            with self._wake:
                if not self._queue and not self._running:
                    continue
            try:
                self._admit()
                self._cancel_left()
                ran = len(self.decoder)
                t0 = time.perf_counter()
                ended = self.decoder.step() if self._running else {}
                took = time.perf_counter() - t0
                self.steps += 1
            except BaseException as exc:  # noqa: BLE001 - a failed step fails its requests, not the server
                self._fail_running(exc)
                continue
            cancelled = 0
            for handle, result in ended.items():
                cancelled += result.stop_reason == "cancelled"
                req = self._running.pop(handle, None)
                if req is not None and not req.future.done():
                    self._finish(req, result)
            self.cancelled += cancelled
            if self.on_step is not None:
                self.on_step(self.queue_length, ran, cancelled, took, self.decoder.last_step)

    def _prepare_arrivals(self) -> None:
        """Run the preparations of every queued request that has not had its own, one ``run`` per key
        (in order of each key's first request); a request whose preparation failed leaves the queue
        with its error."""
        with self._wake:
            todo = [r for r in self._queue if not r.ready]
        groups: dict = {}
        for r in todo:
            groups.setdefault(r.prepare.key, []).append(r)
        for reqs in groups.values():
            try:
                results = reqs[0].prepare.run([r.prepare.item for r in reqs])
                if len(results) != len(reqs):
                    raise RuntimeError(f"{len(results)} results for {len(reqs)} preparations")
            except BaseException as exc:  # noqa: BLE001 - every member gets it
                results = [exc] * len(reqs)
            for r, result in zip(reqs, results):
                if isinstance(result, BaseException):
                    with self._wake:
                        if r in self._queue:
                            self._queue.remove(r)
                    if not r.future.done():
                        r.future.set_exception(result)
                    continue
                r.prepared, r.prefix, r.ready = result, getattr(result, "prefix", None), True

    def _finish(self, req: BatchRequest, result) -> None:
        """A request whose sequence ended: its ``finish`` (the error fails it), then its result."""
        if req.finish is not None:
            try:
                req.finished = req.finish(result, req.prepared)
            except Exception as exc:  # noqa: BLE001 - the request gets it
                req.future.set_exception(exc)
                return
        req.future.set_result(result)

    def _admit(self) -> None:
        """Move the queue's head into the batch while it fits (arrival order); a head whose preparation
        has not run yet waits for the next boundary."""
        while True:
            with self._wake:
                if not self._queue or not self._queue[0].ready:
                    return
                req = self._queue[0]
                o = req.opts
                if not self.decoder.fits(len(req.prompt_ids), req.prefix, o.max_new_tokens, req.memory):
                    if self._running:
                        return          # waits for a row or KV to free up
                    self._queue.popleft()
                    req.future.set_exception(BadInput(
                        f"the request needs more KV than the batch's budget ({len(req.prompt_ids)} prompt tokens + "
                        f"{o.max_new_tokens} new, after a state of "
                        f"{max(req.prefix.tokens_per_layer(), default=0) if req.prefix else 0}): raise --batch-kv-gb"))
                    continue
                self._queue.popleft()
            try:
                req.handle = self.decoder.add(req.prompt_ids, prefix=req.prefix, max_new_tokens=o.max_new_tokens,
                                              temperature=o.temperature, top_p=o.top_p, seed=o.seed,
                                              on_text=o.on_text, memory=req.memory)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                req.future.set_exception(exc)
                continue
            req.admitted_at = time.perf_counter()
            self._running[req.handle] = req

    def _cancel_left(self) -> None:
        for handle, req in list(self._running.items()):
            if req.cancelled:
                self.decoder.cancel(handle)

    def _fail_running(self, exc: BaseException) -> None:
        """A step failed: every request in the batch gets the error, their rows are freed. (When this
        fails too, the thread stops: :meth:`_stop`.)"""
        for handle, req in list(self._running.items()):
            self.decoder.cancel(handle)
            if not req.future.done():
                req.future.set_exception(exc)
        self.decoder.step()   # no sequence left: collects the cancelled ones' results
        self._running.clear()
