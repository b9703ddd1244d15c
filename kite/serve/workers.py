"""Where blocking work runs. Model work (generate, upcycle) runs in worker threads through its own
limiter: the continuous batch (kite.serve.batcher) takes its requests from there, so as many may
wait in threads as the batch could ever hold plus a queue; beyond that they wait on the event loop,
and the shared thread pool stays free for admin reloads and listings however long the queue."""

from __future__ import annotations

from functools import partial

import anyio

QUEUED_PER_ROW = 4   # threads per batch row: requests queued for the batch wait in them


async def in_worker(fn, *args, **kwargs):
    """Short blocking work (a rule reload, a directory listing) in the shared thread pool."""
    return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs))


def model_limiter(srv) -> anyio.CapacityLimiter:
    """The limiter of the server's model work, made on first use (a limiter belongs to the running loop)."""
    if srv.model_limiter is None:
        srv.model_limiter = anyio.CapacityLimiter(max(2, QUEUED_PER_ROW * srv.settings.max_batch))
    return srv.model_limiter


async def on_model(srv, fn, *args, **kwargs):
    """Model work (`srv`: the app's ServerState): its thread waits here while the batch's thread, the
    model's only one, runs it (kite.serve.batcher)."""
    return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs), limiter=model_limiter(srv))
