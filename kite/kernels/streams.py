"""CUDA stream plumbing for encoders that must not wait for the device: host copies on a copy
stream into pinned memory, small host tables to the device without a sync, a side stream for work
the caller's stream joins later, TF32 matmuls, and stage timings. On the CPU every helper degrades
to the plain synchronous operation.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch


def const(values, dev: torch.device) -> torch.Tensor:
    """A float64 host list on ``dev`` without a host sync (torch.tensor(..., device=cuda) waits
    for the stream)."""
    t = torch.tensor(values, dtype=torch.float64)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


_PINNED: dict = {}
_COPY_STREAMS: dict = {}


def to_host(tensors: list[torch.Tensor], after: torch.cuda.Event | None = None) -> list[np.ndarray]:
    """uint8 device tensors -> numpy views of host copies. On a GPU: pinned buffers filled on a copy
    stream once ``after`` has happened (default: once the work queued so far on the current stream is
    done), so the copies overlap the work queued after it (call host_sync before reading them);
    plain .cpu() elsewhere."""
    if not tensors or not tensors[0].is_cuda:
        return [t.cpu().numpy() for t in tensors]
    dev = tensors[0].device
    cs = _COPY_STREAMS.get(dev)
    if cs is None:
        cs = _COPY_STREAMS[dev] = torch.cuda.Stream(device=dev)
    if after is None:
        cs.wait_stream(torch.cuda.current_stream(dev))
    else:
        cs.wait_event(after)
    out = []
    with torch.cuda.stream(cs):
        for t in tensors:
            n = t.numel()
            buf = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=True)
            _PINNED[len(_PINNED)] = buf   # kept alive until host_sync
            buf[:n].copy_(t.reshape(-1), non_blocking=True)
            t.record_stream(cs)           # not reused by the allocator before the copy is done
            out.append(buf[:n].numpy())
    return out


def to_dev(dev: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Small int64 host tensors -> the device in one asynchronous copy (no host sync)."""
    if dev.type != "cuda" or not tensors:
        return [t.to(dev) for t in tensors]
    sizes = [t.numel() for t in tensors]
    buf = torch.empty(max(1, sum(sizes)), dtype=torch.int64, pin_memory=True)
    if sizes and sum(sizes):
        torch.cat([t.reshape(-1).to(torch.int64) for t in tensors], out=buf[:sum(sizes)])
    d = buf.to(dev, non_blocking=True)
    return [x.view(t.shape) for x, t in zip(torch.split(d[:sum(sizes)], sizes), tensors)]


def host_sync(dev: torch.device) -> None:
    """Wait for the device (and so for every copy :func:`to_host` queued) and release their buffers."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    _PINNED.clear()


def record_event(dev: torch.device):
    """An event recorded now on the current stream (None on the CPU)."""
    if dev.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


def host_async(*ts: torch.Tensor) -> tuple:
    """Host copies of device tensors, ready once the returned event is (last item; None on the CPU)."""
    if not ts[0].is_cuda:
        return ts + (None,)
    bufs = []
    for t in ts:
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        bufs.append(buf)
    ev = torch.cuda.Event()
    ev.record()
    return tuple(bufs) + (ev,)


_SIDE_STREAMS: dict = {}


@contextlib.contextmanager
def on_side_stream(dev: torch.device):
    """On a GPU: the work inside runs on a side stream that starts after everything queued so far;
    the caller's stream waits for it at :func:`join_side_stream` (meanwhile the caller queues work
    that does not need the side stream's results). Elsewhere: no stream (yields None)."""
    if dev.type != "cuda":
        yield None
        return
    st = _SIDE_STREAMS.get(dev)
    if st is None:
        st = _SIDE_STREAMS[dev] = torch.cuda.Stream(device=dev)
    st.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(st):
        yield st


def join_side_stream(dev: torch.device) -> None:
    if dev.type == "cuda" and dev in _SIDE_STREAMS:
        torch.cuda.current_stream(dev).wait_stream(_SIDE_STREAMS[dev])


@contextlib.contextmanager
def tf32(dev: torch.device):
    """fp32 matmuls on TF32 tensor cores inside (CUDA only). Inputs round to 10-bit mantissas,
    unbiasedly: a sum over thousands of products keeps far more precision than that."""
    if dev.type != "cuda":
        yield
        return
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


class StageClock:
    """Milliseconds per named stage; ``sync`` waits for the device at each lap so the split is true
    (otherwise a stage's figure is its host-side time only)."""

    def __init__(self, dev: torch.device, sync: bool):
        self.sync = sync and dev.type == "cuda"
        self.dev = dev
        self.times: dict[str, float] = {}
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.sync:
            torch.cuda.synchronize(self.dev)
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + (now - self.t) * 1e3
        self.t = now
