"""Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1: kernels run in numpy),
for tests (pytest's skip is used, so call it from a test). The interpreter must be on before Triton's first import in a process (Triton's own helpers
are kernels too), and a test session may have imported Triton already, so the checks run in a child
process: ``run_interpreted("tests.module:function")`` calls that function there and fails the test
with its output if it raises. Skipped where Triton is missing, and on a GPU (which runs the compiled
kernels instead)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]     # the checkout, where ``tests.module`` is found


def run_interpreted(target: str, timeout: float = 300) -> str:
    """Run ``module:function`` under the interpreter in a child process; its output."""
    import pytest
    import torch

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the compiled kernels (the GPU tests)")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "kite.testing.triton_interpreter", target], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r.stdout


def bridge_interpreter_gaps() -> None:
    """Two interpreter gaps of triton 3.6 with numpy >= 2.3: loop bounds held as one-element arrays,
    and bf16 (held as uint16 bits) multiplied as integers by tl.dot."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    patch_tensor, dot = interp._patch_lang_tensor, interp.InterpreterBuilder.create_dot

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    def as_f32(h):
        if h.data.dtype == np.uint16:       # bf16 bits
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    interp._patch_lang_tensor = patched_tensor
    interp.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: dot(self, as_f32(a), as_f32(b), d, *rest)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    bridge_interpreter_gaps()
    module, fn = sys.argv[1].split(":")
    getattr(importlib.import_module(module), fn)()
