"""The native runtime's other vector paths. `make build-runtime` builds the library for the machine it
runs on (-march=native), so the rest of the suite exercises one path of its kernels: AVX-512 here,
AVX2 or none on another CPU. This builds the library again for x86-64-v3 (AVX2 and FMA, no
AVX-512) and for baseline x86-64 (no vector product: the products fall back to torch), where this
CPU can run them, and runs the native kernels' tests against each build (``KITE_RUNTIME_LIB``)."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ["tests/test_cpu_products.py", "tests/test_decode_attention.py", "tests/test_kernels.py",
                "tests/test_rans.py"]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def _build_flags(march: str) -> list[str]:
    """The Makefile's RT_CFLAGS (one place says how the runtime is built), for ``march``."""
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if ln.startswith("RT_CFLAGS"))
    flags = line.split("=", 1)[1].split()
    assert "-march=native" in flags, line
    return [f"-march={march}" if f == "-march=native" else f for f in flags]


@pytest.mark.parametrize("march,width,needs", [("x86-64-v3", 8, {"avx2", "fma"}), ("x86-64", 0, set())])
def test_the_native_kernels_pass_on_another_vector_path(tmp_path, march, width, needs):
    compiler = os.environ.get("CXX", "g++")
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which(compiler) is None:
        pytest.skip("needs an x86-64 CPU and a C++ compiler")
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - _cpu_flags())}")
    lib = tmp_path / "libkite_runtime.so"
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
    subprocess.run([compiler, *_build_flags(march), "-shared", "-o", str(lib), *sources], cwd=ROOT, check=True,
                   capture_output=True)
    env = {**os.environ, "KITE_RUNTIME_LIB": str(lib), "KITE_RUNTIME": "native"}
    probe = subprocess.run([sys.executable, "-c", "from kite.kernels import native; "
                            "print(native.cpu().kite_rows_product_width())"],
                           cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert int(probe.stdout) == width       # the build took the path asked for
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"\d+ passed", run.stdout), run.stdout[-2000:]
