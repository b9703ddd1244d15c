"""cuSOLVER's batched symmetric eigensolver (``cusolverDnXsyevBatched``) through ctypes.

torch.linalg.eigh on a CUDA batch of matrices larger than 32x32 runs one ``syevd`` per matrix, each
call latency-bound; ``cusolverDnXsyevBatched`` (cuSOLVER 11.7+, CUDA 12.6U2+) takes the whole batch
in one call (timings: docs/PERFORMANCE.md, ``benchmarks/eigh_gpu.py``). The library is the one torch already
loaded (its CUDA wheels ship it), so nothing is built or installed for this.

``available()`` is False on a CPU-only torch, when the library lacks the symbol (older CUDA) or
when ``KITE_RUNTIME=torch``; callers fall back to ``torch.linalg.eigh``.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
import threading
from ctypes import c_int, c_int64, c_size_t, c_void_p

import torch

from kite.kernels.locate import forced_torch

__all__ = ["available", "syev_batched", "CusolverError"]

_EIG_MODE_VECTOR = 1
_FILL_LOWER = 0
_DTYPES = {torch.float32: 0, torch.float64: 1}  # cudaDataType: CUDA_R_32F, CUDA_R_64F


class CusolverError(RuntimeError):
    """cuSOLVER refused a call (status code in the message)."""


def _candidates() -> list[str]:
    """libcusolver paths: the one this process already mapped first (torch's), then the wheels'."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            found += sorted({line.split()[-1] for line in f if "libcusolver.so" in line})
    except OSError:
        pass
    for base in sys.path:
        found += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libcusolver.so*")))
        found += sorted(glob.glob(os.path.join(base, "nvidia", "cusolver", "lib", "libcusolver.so*")))
    return found + ["libcusolver.so.12", "libcusolver.so.11", "libcusolver.so"]


@functools.lru_cache(maxsize=None)
def _lib():
    if forced_torch() or not torch.cuda.is_available():
        return None
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            fn, size = lib.cusolverDnXsyevBatched, lib.cusolverDnXsyevBatched_bufferSize
        except (OSError, AttributeError):
            continue
        P = c_void_p
        lib.cusolverDnCreate.argtypes = [ctypes.POINTER(P)]
        lib.cusolverDnCreateParams.argtypes = [ctypes.POINTER(P)]
        lib.cusolverDnSetStream.argtypes = [P, P]
        size.argtypes = [P, P, c_int, c_int, c_int64, c_int, P, c_int64, c_int, P, c_int,
                         ctypes.POINTER(c_size_t), ctypes.POINTER(c_size_t), c_int64]
        fn.argtypes = [P, P, c_int, c_int, c_int64, c_int, P, c_int64, c_int, P, c_int,
                       P, c_size_t, P, c_size_t, P, c_int64]
        for f in (lib.cusolverDnCreate, lib.cusolverDnCreateParams, lib.cusolverDnSetStream, size, fn):
            f.restype = c_int
        return lib
    return None


def available() -> bool:
    """Whether the batched solver can run here (CUDA torch, a libcusolver with the symbol)."""
    return _lib() is not None


_local = threading.local()


def _handle(device: torch.device) -> tuple[c_void_p, c_void_p]:
    """One cuSOLVER handle + params per thread, device and stream: handles are not thread-safe, and
    calls on two streams that share a handle do not overlap (the handle's scratch is shared)."""
    cache = _local.__dict__.setdefault("handles", {})
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    if key not in cache:
        lib = _lib()
        h, p = c_void_p(), c_void_p()
        with torch.cuda.device(index):
            _check(lib.cusolverDnCreate(ctypes.byref(h)), "cusolverDnCreate")
            _check(lib.cusolverDnCreateParams(ctypes.byref(p)), "cusolverDnCreateParams")
        cache[key] = (h, p)
    return cache[key]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CusolverError(f"{what} failed with cuSOLVER status {status}")


def syev_batched(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eigenvalues [B, n] (ascending), eigenvectors [B, n, n] (column j = vector j) and the per-matrix
    ``info`` [B] int32 (0: converged) of symmetric ``A`` [B, n, n] (float32 or float64, on a CUDA
    device), in one cuSOLVER call on the current stream. Nothing waits for the device: check
    ``info`` when the results are read back (a nonzero entry means that matrix did not converge).

    The call is replayed from a CUDA graph captured once per (device, B, n, dtype). For n = 512
    the solver launches ~25 small kernels per column (~1,500 for the batch), which costs more host
    time than the device spends on them; a replay launches them all at once. The direct call where
    capture fails, or while the caller's stream is being captured.

    Each stream has its own handle: chunks of a batch on concurrent streams that shared one handle
    ran slower than one call and their replays gave wrong vectors (benchmarks/eigh_gpu.py)."""
    lib = _lib()
    if lib is None:
        raise CusolverError("cusolverDnXsyevBatched is not available (CPU torch, or cuSOLVER older than 11.7)")
    if A.dim() != 3 or A.shape[1] != A.shape[2] or not A.is_cuda or A.dtype not in _DTYPES:
        raise ValueError(f"syev_batched: need a CUDA float32/float64 [B, n, n] tensor, got {A.dtype} "
                         f"{tuple(A.shape)} on {A.device}")
    if A.shape[0] == 0:
        return (torch.empty(0, A.shape[1], dtype=A.dtype, device=A.device), A.clone(),
                torch.zeros(0, dtype=torch.int32, device=A.device))
    if not torch.cuda.is_current_stream_capturing():
        replay = _graph_for(A)
        if replay is not None:
            return replay(A)
    W, V, info = _buffers(A)
    V.copy_(A)
    _call(V, W, info)
    return W, V.transpose(1, 2), info


def _buffers(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, n, _ = A.shape
    return (torch.empty(B, n, dtype=A.dtype, device=A.device), torch.empty_like(A, memory_format=torch.contiguous_format),
            torch.zeros(B, dtype=torch.int32, device=A.device))


def _call(V: torch.Tensor, W: torch.Tensor, info: torch.Tensor, handle=None) -> None:
    """The solver on the current stream: V [B, n, n] in (symmetric), eigenvectors out (column-major).
    ``handle``: the (handle, params) to use (default: the current stream's)."""
    lib = _lib()
    B, n, _ = V.shape
    dt = _DTYPES[V.dtype]
    h, p = handle or _handle(V.device)
    _check(lib.cusolverDnSetStream(h, c_void_p(torch.cuda.current_stream(V.device).cuda_stream)),
           "cusolverDnSetStream")
    ws_dev, ws_host = c_size_t(), c_size_t()
    _check(lib.cusolverDnXsyevBatched_bufferSize(h, p, _EIG_MODE_VECTOR, _FILL_LOWER, n, dt, c_void_p(V.data_ptr()),
                                                 n, dt, c_void_p(W.data_ptr()), dt, ctypes.byref(ws_dev),
                                                 ctypes.byref(ws_host), B), "cusolverDnXsyevBatched_bufferSize")
    work = torch.empty(max(1, ws_dev.value), dtype=torch.uint8, device=V.device)
    host = ctypes.create_string_buffer(max(1, ws_host.value))
    _local.host_workspace = host  # alive until this thread's next call
    _check(lib.cusolverDnXsyevBatched(h, p, _EIG_MODE_VECTOR, _FILL_LOWER, n, dt, c_void_p(V.data_ptr()), n, dt,
                                      c_void_p(W.data_ptr()), dt, c_void_p(work.data_ptr()), ws_dev.value,
                                      ctypes.cast(host, c_void_p), ws_host.value, c_void_p(info.data_ptr()), B),
           "cusolverDnXsyevBatched")
    _local.workspace = work  # a captured graph keeps using it: alive with the graph (see _Graph)


class _Graph:
    """A captured solver call over static buffers: copy in, replay, copy out (results are fresh
    tensors, so a later replay never overwrites what a caller holds)."""

    def __init__(self, A: torch.Tensor):
        self.inp = torch.empty_like(A, memory_format=torch.contiguous_format)
        self.W, self.V, self.info = _buffers(A)
        self.inp.copy_(A)
        # the caller's stream's handle, made and warmed up before capture (creating one allocates);
        # graphs replayed on different streams then never share a handle's scratch
        handle = _handle(A.device)
        self.V.copy_(self.inp)
        _call(self.V, self.W, self.info, handle)
        torch.cuda.synchronize(A.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.V.copy_(self.inp)
            _call(self.V, self.W, self.info, handle)
        self.keep = (_local.workspace, _local.host_workspace, handle)

    def __call__(self, A: torch.Tensor):
        self.inp.copy_(A)
        self.graph.replay()
        return self.W.clone(), self.V.transpose(1, 2).clone(), self.info.clone()


_GRAPHS: dict = {}
_NO_GRAPH: set = set()
_GRAPH_CACHE = 4


def _graph_for(A: torch.Tensor):
    key = (A.device.index, tuple(A.shape), A.dtype, threading.get_ident(),
           torch.cuda.current_stream(A.device).cuda_stream)
    if key in _NO_GRAPH:
        return None
    g = _GRAPHS.pop(key, None)
    if g is None:
        try:
            g = _Graph(A)
        except (RuntimeError, CusolverError):   # not capturable here: the direct call from now on
            torch.cuda.synchronize(A.device)
            _NO_GRAPH.add(key)
            return None
        while len(_GRAPHS) >= _GRAPH_CACHE:
            _GRAPHS.pop(next(iter(_GRAPHS)))
    _GRAPHS[key] = g   # most recently used last
    return g
