"""The one timer of benchmarks/: CUDA events around each call on a GPU (after warm-up, synchronised),
host perf_counter on a CPU; medians with their 10th and 90th percentiles, in ms.

    t = time_ms(fn, repeat=20, warmup=3, device="cuda")   # Timing(median_ms, p10_ms, p90_ms, samples_ms)
    with wall() as w: ...                                  # one span of the host clock: w.ms, w.s
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

clock = time.perf_counter       # the host clock every benchmark reads (seconds)


@dataclass(frozen=True)
class Timing:
    """Times of repeated calls, ms: median, 10th and 90th percentile, every sample."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    samples_ms: list[float] = field(repr=False)

    @classmethod
    def of(cls, samples_ms: list[float]) -> Timing:
        """The summary of samples (ms); at least one."""
        if not samples_ms:
            raise ValueError("no samples to summarise")
        s = sorted(float(x) for x in samples_ms)
        return cls(statistics.median(s), _quantile(s, 0.10), _quantile(s, 0.90), list(samples_ms))

    def to_dict(self) -> dict:
        return {"median_ms": self.median_ms, "p10_ms": self.p10_ms, "p90_ms": self.p90_ms,
                "samples": len(self.samples_ms)}


def _quantile(s: list[float], q: float) -> float:
    """Linear interpolation between the order statistics of sorted ``s``."""
    at = q * (len(s) - 1)
    lo = int(at)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


def _is_cuda(device) -> bool:
    return device is not None and str(device).startswith("cuda")


def time_ms(fn: Callable[[], object], repeat: int = 20, warmup: int = 3, device=None) -> Timing:
    """Time ``fn()`` ``repeat`` times after ``warmup`` untimed calls. On a CUDA ``device``: a pair of
    CUDA events around each call on the current stream, the device synchronised before the first and
    after each; otherwise the host clock around each call."""
    if repeat < 1 or warmup < 0:
        raise ValueError(f"repeat must be >= 1 and warmup >= 0, got {repeat}, {warmup}")
    for _ in range(warmup):
        fn()
    samples = []
    if _is_cuda(device):
        import torch

        torch.cuda.synchronize()
        for _ in range(repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
    else:
        for _ in range(repeat):
            t = clock()
            fn()
            samples.append((clock() - t) * 1e3)
    return Timing.of(samples)


class Span:
    """One span of the host clock (see :func:`wall`); ``ms`` / ``s`` once it has ended (while it runs:
    the time so far)."""

    def __init__(self):
        self.start, self.end = clock(), None

    @property
    def s(self) -> float:
        return (self.end if self.end is not None else clock()) - self.start

    @property
    def ms(self) -> float:
        return self.s * 1e3


@contextmanager
def wall(device=None):
    """``with wall() as w:`` the host time of the block (w.ms, w.s); on a CUDA ``device`` the device is
    synchronised at both ends, so the span holds the work the block queued."""
    if _is_cuda(device):
        import torch

        torch.cuda.synchronize()
    span = Span()
    try:
        yield span
    finally:
        if _is_cuda(device):
            import torch

            torch.cuda.synchronize()
        span.end = clock()
