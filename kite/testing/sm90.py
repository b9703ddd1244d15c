"""The lanes stream kernel compiled for the H200 (sm_90a) on a machine without a GPU (Triton's compiler
and the ptxas / cuobjdump in its package): its PTX and SASS, for the tests that check its machine code
and benchmarks/lanes_sass.py."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path


def compile_sm90(ptx: bool = True, block: int = 64, stages: int = 3, maxnreg: int | None = None) -> dict:
    """The stream kernel compiled for sm_90a (Triton's compiler and ptxas): its ``asm`` (ptx, cubin ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kite.kernels.lanes_triton import STREAM_KERNEL as fn

    types = {"ptrs": "*i64", "ng_ptr": "*i32", "len_ptr": "*i32", "splits": "i32"}
    consts = dict(H=4, G=7, GP=16, NGMAX=32, GROUP=512, RK=128, RV=128, BT=block, PTX=ptx)
    sig = {name: types.get(name, "*fp32" if name.endswith(("_ptr", "_out")) else "constexpr")
           for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if sig[name].startswith("*")}
    options = dict(num_warps=1, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm


def sass(cubin: bytes) -> str:
    """cuobjdump -sass of a cubin (the cuobjdump in Triton's package)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
