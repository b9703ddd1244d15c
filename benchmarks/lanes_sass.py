"""The lanes stream kernel's machine code for the H200 (sm_90a), compiled here without a GPU: the
instructions of its loops, by opcode (the tile loop's size is the kernel's per-tile work).

    python benchmarks/lanes_sass.py [--block 64] [--stages 3] [--maxnreg N]

The benchmark's geometry and the kernel's default configuration: 4 KV heads x 7 query heads, 128
lanes a row, groups of 512 rows, one-warp programs. Needs Triton with its NVIDIA backend (ptxas and
cuobjdump ship in its package; kite.testing.sm90 compiles it, as tests/test_lanes_kernel.py does).
Rows: each loop's instruction count, the innermost (tile) loop first (a size: no baseline, no
floor); every loop's opcodes under ``raw``.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kite.testing.sm90 import compile_sm90, sass  # noqa: E402
from harness import Result, finish, parse, parser  # noqa: E402


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
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--maxnreg", type=int, default=0)
    args = parse(ap, argv)
    found = loops(sass(compile_sm90(True, args.block, args.stages, args.maxnreg or None)["cubin"]))
    res = Result("lanes_sass", device="cpu")
    for loop in found:   # innermost (the tile loop) first: the shortest span
        top = ", ".join(f"{k} {v}" for k, v in list(loop["opcodes"].items())[:12])
        res.row(f"loop {loop['from']}-{loop['to']}", loop["instructions"], "instructions", top_opcodes=top)
    res.raw.update(block=args.block, stages=args.stages, maxnreg=args.maxnreg or None, loops=found)
    return finish(res, args)


if __name__ == "__main__":
    sys.exit(main())
