"""ctypes binding of the native runtime: loaded lazily, once; argument types declared here.

``cpu()`` / ``cuda()`` return the loaded library or None (not built, does not load, or
``KITE_RUNTIME=torch``). ``KITE_RUNTIME=native`` turns a missing library into an error instead.
Tensors are passed as ``data_ptr()`` (device pointers for CUDA tensors) and must be contiguous.
"""

from __future__ import annotations

import ctypes
import functools
import os
from ctypes import c_char_p, c_float, c_int, c_int64, c_void_p

import torch

from kite.kernels.locate import RUNTIME_ENV, cuda_runtime_path, forced_torch, runtime_path

P = c_void_p

_CPU_SIGNATURES = {
    "kite_runtime_version": (c_char_p, []),
    "kite_runtime_abi": (c_int, []),
    "kite_runtime_threads": (c_int, []),
    "kite_quantize_groups": (c_int, [P, c_int64, c_int64, c_int, c_int, P, P, P]),
    "kite_dequantize_groups": (c_int, [P, c_int64, c_int64, c_int, P, P, P]),
    "kite_kmeans_cosine": (c_int, [P, c_int64, c_int64, P, c_int64, c_int, P]),
    "kite_eigh_batched": (c_int, [P, c_int64, c_int64, P, P]),
    "kite_rans_encode": (c_int, [P, c_int64, P, c_int, c_int, c_int64, P, P, P, c_int64]),
    "kite_rans_decode": (c_int, [P, P, P, c_int64, P, c_int, c_int, c_int64, P]),
    "kite_pack_codes": (c_int, [P, c_int64, c_int, P, c_int64]),
    "kite_rows_product_width": (c_int, []),
    "kite_rows_product": (c_int, [P, c_int64, P, c_int64, P, P, c_int64, c_int64, c_int64, c_int64, c_int]),
    "kite_decode_attention": (c_int, [P, P, P] + [c_int64] * 6 + [P, P] + [c_int64] * 4 + [c_float, c_int]),
}
_CUDA_SIGNATURES = {
    "kite_cuda_version": (c_char_p, []),
    "kite_cuda_kmeans_cosine": (c_int, [P, c_int64, c_int64, P, c_int64, c_int, P, P]),
    "kite_cuda_quantize_groups": (c_int, [P, c_int64, c_int64, c_int, c_int, P, P, P, P]),
    "kite_cuda_quantize_plan": (c_int, [P, c_int64, c_int64, P, P, P, c_int64, P, c_int64, c_int, c_int, P, P, P, P,
                                        c_int64, P]),
    "kite_cuda_eigh_batched": (c_int, [P, c_int64, c_int64, P, P, c_int, P]),
    "kite_cuda_pca_coefs": (c_int, [P, c_int64, P, c_int64, c_int64, P, P, P, P, c_int64, c_int, P]),
    "kite_cuda_pca_finish": (c_int, [c_int64] * 4 + [P, c_int, c_int64, c_int64, P, P, c_int64, c_int64, P, P, P,
                                                      P, P, c_int, P]),
}
ABI = 4   # 4: kite_rows_product takes any number of rows (3 refused more than 8)


class NativeError(RuntimeError):
    """A native kernel refused its arguments or hit a CUDA error."""


def _bind(path, signatures: dict):
    lib = ctypes.CDLL(str(path))
    for name, (res, args) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def _required() -> bool:
    return os.environ.get(RUNTIME_ENV, "auto").strip().lower() == "native"


@functools.lru_cache(maxsize=None)
def _load(kind: str):
    path = runtime_path() if kind == "cpu" else cuda_runtime_path()
    if path is None:
        if _required():
            raise NativeError(f"KITE_RUNTIME=native but the {kind} runtime is not built: run `make build-runtime`")
        return None
    try:
        lib = _bind(path, _CPU_SIGNATURES if kind == "cpu" else _CUDA_SIGNATURES)
    except (OSError, AttributeError) as exc:
        if _required():
            raise NativeError(f"{path} does not load: {exc}") from exc
        return None
    if kind == "cpu" and lib.kite_runtime_abi() != ABI:
        return None
    return lib


def cpu():
    """The CPU library, or None."""
    return None if forced_torch() else _load("cpu")


def cuda():
    """The CUDA library, or None (also None when torch sees no GPU)."""
    if forced_torch() or not torch.cuda.is_available():
        return None
    return _load("cuda")


def lib_for(t: torch.Tensor):
    """The library that runs kernels on ``t``'s device, or None."""
    return cuda() if t.is_cuda else cpu()


def ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if not t.is_contiguous():
        raise ValueError("native kernels take contiguous tensors")
    return t.data_ptr()


def stream(t: torch.Tensor) -> int | None:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def check(rc: int, what: str) -> int:
    if rc < 0:
        raise NativeError(f"{what}: native kernel failed ({'bad arguments' if rc == -1 else 'CUDA error'})")
    return rc
