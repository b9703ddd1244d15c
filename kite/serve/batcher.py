"""Continuous batching for `kite serve`: concurrent requests decode together, one step at a time.

One scheduler thread owns a :class:`kite.runtime.batch_decode.BatchDecoder`. Requests wait in a
first-come queue; at every step boundary the scheduler admits the queue's head while a row and the
KV budget allow (a request joins with its own loaded state, or none), cancels the requests whose
clients left, and runs one step: the newcomers' prompts are prefilled, every running sequence gets
one token, streamed text goes out through each request's ``on_text``. A sequence that ends leaves
its row at once. Strict arrival order: a head that does not fit yet waits for rooms to free up, and
one that can never fit (alone it would pass the KV budget) is refused.

The model is shared with the request threads (YOCO's decision, the state's load, the measured
gain's extra forward run there): every touch of it, the steps included, holds the server's model
lock, so they interleave at step boundaries. This is the scheduling vLLM and SGLang call
continuous (iteration-level) batching, without their paged KV: each row is one contiguous block
per layer (docs/serving.md).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from kite.errors import BadInput
from kite.runtime.batch_decode import BatchDecoder
from kite.runtime.cache import KVPrefix
from kite.runtime.row_memory import RowMemory


@dataclass(eq=False)
class BatchRequest:
    """One request's way through the batch; ``future`` gets its GenerationResult (or the error)."""

    prompt_ids: list[int]
    prefix: KVPrefix | None
    opts: object                      # kite.serve.runner.GenOptions
    memory: RowMemory | None = None   # a budgeted request's older tokens (kite.upcycle.BudgetRow)
    future: Future = field(default_factory=Future)
    queued_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    handle: int | None = None
    cancelled: bool = False

    @property
    def wait_ms(self) -> float:
        """Time in the queue before it joined the batch (so far, while it waits)."""
        end = self.admitted_at if self.admitted_at is not None else time.perf_counter()
        return (end - self.queued_at) * 1e3


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
    """The scheduler thread over one model (``lm``), sharing ``lock`` with everything else that runs
    it. ``max_batch``: sequences decoding at once; ``max_kv_bytes``: the batch's KV buffers (None:
    unbounded). ``on_step(queue_length, rows, cancelled, seconds)`` is called after every step (metrics:
    the queue left, the sequences the step ran, those it dropped because their clients left, the step's
    wall time)."""

    def __init__(self, lm, lock, *, max_batch: int = 8, max_kv_bytes: int | None = None,
                 on_step=None):
        if max_batch < 1:
            raise BadInput(f"--max-batch {max_batch}: at least 1")
        self.lm, self.lock, self.on_step = lm, lock, on_step
        self.decoder = BatchDecoder(lm, max_batch, max_kv_bytes=max_kv_bytes)
        self._queue: deque[BatchRequest] = deque()
        self._running: dict[int, BatchRequest] = {}
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kite-batcher", daemon=True)
        self.steps = 0
        self.cancelled = 0     # sequences dropped because their clients left (queued or decoding)
        self._thread.start()

    # -- requests ----------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], prefix: KVPrefix | None, opts,
               memory: RowMemory | None = None) -> BatchRequest:
        """Queue a request; it joins the batch at the next step boundary it fits. ``memory``: where
        its older tokens go (a memory-budgeted completion: its prompt is fed a chunk a step)."""
        req = BatchRequest(list(prompt_ids), prefix, opts, memory)
        if opts.queued_at is not None:
            req.queued_at = opts.queued_at
        with self._wake:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._queue.append(req)
            self._wake.notify()
        return req

    def generate(self, prompt_ids: list[int], prefix: KVPrefix | None, opts,
                 memory: RowMemory | None = None) -> tuple[object, BatchRequest]:
        """Submit and wait: (GenerationResult, the request). ``opts.on_request(req)``, when set, gets
        the request first (to :meth:`cancel` it). Cancelled in the batch: stop_reason "cancelled";
        still queued: concurrent.futures.CancelledError."""
        req = self.submit(prompt_ids, prefix, opts, memory)
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
        for req in list(self._queue) + list(self._running.values()):
            if not req.future.done():
                req.future.set_exception(RuntimeError("the server is shutting down"))

    # -- the scheduler -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._queue and not self._running:
                    self._wake.wait()
                if self._closed:
                    return
            try:
                with self.lock:
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
                    req.future.set_result(result)
            self.cancelled += cancelled
            if self.on_step is not None:
                self.on_step(self.queue_length, ran, cancelled, took)

    def _admit(self) -> None:
        """Move the queue's head into the batch while it fits (arrival order)."""
        while True:
            with self._wake:
                if not self._queue:
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
        """A step failed: every request in the batch gets the error, their rows are freed."""
        with self.lock:
            for handle, req in list(self._running.items()):
                self.decoder.cancel(handle)
                if not req.future.done():
                    req.future.set_exception(exc)
            self.decoder.step()   # no sequence left: collects the cancelled ones' results
            self._running.clear()
