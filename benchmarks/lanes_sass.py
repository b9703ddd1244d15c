"""The lanes stream kernel's machine code for the H200 (sm_90a), compiled here without a GPU: the
instructions of its loops, by opcode (the tile loop's size is the kernel's per-tile work).

    python benchmarks/lanes_sass.py [--block 64] [--stages 3] [--maxnreg N] [--json]

The benchmark's geometry and the kernel's default configuration: 4 KV heads x 7 query heads, 128
lanes a row, groups of 512 rows, one-warp programs. Needs Triton with its NVIDIA backend (ptxas and
cuobjdump ship in its package); tests/test_lanes_kernel.py compiles through `compile_sm90` too.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def compile_sm90(ptx: bool = True, block: int = 64, stages: int = 3, maxnreg: int | None = None) -> dict:
    """The stream kernel compiled for sm_90a (Triton's compiler and ptxas): its ``asm`` (ptx, cubin ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kite.kernels.lanes_triton import STREAM_KERNEL as fn

    types = {"ptrs": "*i64", "ng_ptr": "*i32", "len_ptr": "*i32"}
    consts = dict(H=4, G=7, GP=16, NGMAX=32, GROUP=512, RK=128, RV=128, BT=block, SPLITS=4, PTX=ptx)
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


def loops(text: str) -> list[dict]:
    """Every loop of a SASS listing (a branch back to a lower address): its span, its instruction
    count and the count of each opcode (predicates dropped, modifiers kept apart by their name)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in text.splitlines()) if m]
    out = []
    for at, text_ in ins:
        back = re.search(r"BRA (0x[0-9a-f]+)", text_)
        if back and int(back.group(1), 16) < at:
            start = int(back.group(1), 16)
            body = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in ins if start <= a <= at]
            out.append({"from": hex(start), "to": hex(at), "instructions": len(body),
                        "opcodes": dict(Counter(body).most_common())})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--maxnreg", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    found = loops(sass(compile_sm90(True, args.block, args.stages, args.maxnreg or None)["cubin"]))
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    for loop in found:   # innermost (the tile loop) first: the shortest span
        top = ", ".join(f"{k} {v}" for k, v in list(loop["opcodes"].items())[:12])
        print(f"loop {loop['from']}-{loop['to']}: {loop['instructions']} instructions ({top})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
