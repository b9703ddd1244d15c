"""Where blocking work runs. Model work (generate, upcycle) goes to one worker thread at a time,
through its own limiter: requests queued for the model wait on the event loop, not in threads,
so the shared thread pool stays free for admin reloads and listings however long the queue."""

from __future__ import annotations

from functools import partial

import anyio


async def in_worker(fn, *args, **kwargs):
    """Short blocking work (a rule reload, a directory listing) in the shared thread pool."""
    return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs))


async def on_model(srv, fn, *args, **kwargs):
    """Model work, one call at a time per server (`srv`: the app's ServerState)."""
    if srv.model_limiter is None:  # made on first use: a limiter belongs to the running loop
        srv.model_limiter = anyio.CapacityLimiter(1)
    return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs), limiter=srv.model_limiter)
