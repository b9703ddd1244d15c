"""Native kernels (build/libkite_runtime.so via ctypes) with pure-torch fallbacks.

Each kernel picks the native runtime when it is built and loads (CPU tensors: the OpenMP library;
CUDA tensors: the CUDA library), else its pure-torch twin (``*_torch``), which computes the same
function. ``KITE_RUNTIME=torch`` forces the fallback; ``backend()`` says which runs.
Importing this package does not import torch (``kite version`` reads :mod:`kite.kernels.locate`);
the kernels load on first use.
"""

import importlib

_EXPORTS = {
    "backend": "backend", "backends": "backend", "batched_pca": "eigh", "eigh_desc": "eigh",
    "lloyd_cosine": "kmeans", "quantize_groups": "quant", "dequantize_groups": "quant",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"kite.kernels.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kite.kernels' has no attribute {name!r}")
