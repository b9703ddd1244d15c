"""Find the native runtime libraries without loading torch (``kite version`` reads this).

``build/libkite_runtime.so`` holds the CPU kernels, ``build/libkite_runtime_cuda.so`` the CUDA
ones (built where ``nvcc`` was found). ``KITE_RUNTIME_LIB`` / ``KITE_RUNTIME_CUDA_LIB`` point at
other copies; ``KITE_RUNTIME=torch`` makes every kernel take its pure-torch fallback.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from kite.paths import repo_root

LIB_NAME = "libkite_runtime.so"
CUDA_LIB_NAME = "libkite_runtime_cuda.so"
RUNTIME_ENV = "KITE_RUNTIME"  # auto (default) | torch | native


def _find(env: str, name: str) -> Path | None:
    value = os.environ.get(env)
    candidates = [Path(value)] if value else []
    root = repo_root()
    if root is not None:
        candidates.append(root / "build" / name)
    return next((p for p in candidates if p.is_file()), None)


def runtime_path() -> Path | None:
    """`KITE_RUNTIME_LIB`, else `build/libkite_runtime.so` in the checkout, if the file exists."""
    return _find("KITE_RUNTIME_LIB", LIB_NAME)


def cuda_runtime_path() -> Path | None:
    """`KITE_RUNTIME_CUDA_LIB`, else `build/libkite_runtime_cuda.so`, if the file exists."""
    return _find("KITE_RUNTIME_CUDA_LIB", CUDA_LIB_NAME)


def forced_torch() -> bool:
    return os.environ.get(RUNTIME_ENV, "auto").strip().lower() == "torch"


def cpu_version(path: Path | None = None) -> str | None:
    """The CPU library's version string (loads it with ctypes; no torch), None if it won't load."""
    path = path or runtime_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        lib.kite_runtime_version.restype = ctypes.c_char_p
        return lib.kite_runtime_version().decode()
    except (OSError, AttributeError):
        return None


def runtime_status() -> str:
    """One line: which kernels run (CPU / CUDA native, or the pure-torch fallback) and from where."""
    path, cuda = runtime_path(), cuda_runtime_path()
    if path is None:
        return "not built (pure-torch fallback; run `make build-runtime`)"
    version = cpu_version(path)
    if version is None:
        return f"broken: {path} does not load (pure-torch fallback; run `make build-runtime`)"
    cuda_note = (f"; CUDA kernels built ({cuda.name}, used for tensors on a GPU; eigendecompositions of"
                 " blocks over 128 dims go to cuSOLVER's batched solver where torch's CUDA build has it)"
                 if cuda else "")
    forced = "; KITE_RUNTIME=torch forces the fallback" if forced_torch() else ""
    return f"CPU kernels available: {version} at {path.parent}{cuda_note}{forced}"
