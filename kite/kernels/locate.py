"""Find the native runtime library without loading it (and without importing torch)."""

from __future__ import annotations

import os
from pathlib import Path

from kite.paths import repo_root

LIB_NAME = "libkite_runtime.so"


def runtime_path() -> Path | None:
    """`KITE_RUNTIME_LIB`, else `build/libkite_runtime.so` in the checkout, if the file exists."""
    env = os.environ.get("KITE_RUNTIME_LIB")
    candidates = [Path(env)] if env else []
    root = repo_root()
    if root is not None:
        candidates.append(root / "build" / LIB_NAME)
    return next((p for p in candidates if p.is_file()), None)


def runtime_status() -> str:
    path = runtime_path()
    return f"built: {path}" if path else "not built (pure-torch fallback; run `make build-runtime`)"
