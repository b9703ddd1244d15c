"""A CPU decode step with torch's linear against KITE's products of a few rows (kite.model.cpu_products).

The embedded model on this CPU, a BatchDecoder of 1, 2, 4 and 8 rows (plain prompts of ~40
tokens), its decode steps timed three ways in turn: torch's linear, the products through BLAS (the
weight times the rows transposed) and through the native runtime's kernel where it is built
(``--repeat`` rounds, each round every way, the median step of each kept): side by side, in one run.

    .venv/bin/python benchmarks/cpu_products.py --threads 2

Rows: per row count, the step with linear (the baseline) and with the products; floors: the step's
weights and KV read once at this CPU's measured memory bandwidth (harness.floors.cpu_forward_floor).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, clock, cpu_forward_floor, finish, parse, parser  # noqa: E402

PROMPT = "The following is a short report about the shipping industry and the way ports handle containers. "


def steps_ms(lm, rows: int, steps: int) -> tuple[list[float], int]:
    """Decode steps of ``rows`` rows after their prompts, each timed (ms), and the tokens the rows'
    slots held at the last one."""
    from kite.runtime.batch_decode import BatchDecoder

    ids = lm.tokenizer(PROMPT * 2, add_special_tokens=False)["input_ids"]
    engine = BatchDecoder(lm, max_rows=rows)
    for i in range(rows):
        engine.add(ids[i:], max_new_tokens=steps + 3, stop_ids=set())
    engine.step()                     # the prompts
    engine.step()
    out = []
    for _ in range(steps):
        t = clock()
        engine.step()
        out.append((clock() - t) * 1e3)
    held = sum(engine.cache.row_lengths(r)[0] for r in range(rows))
    engine.drain()
    return out, held


def main(argv=None) -> int:
    ap = parser(__doc__, timing=True, repeat=3, warmup=0, device="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,2,4,8", help="row counts, comma-separated (default 1,2,4,8)")
    ap.add_argument("--steps", type=int, default=12, help="decode steps timed a round (default 12)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parse(ap, argv)
    try:
        counts = [int(r) for r in args.rows.split(",")]
        if min(counts) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--rows {args.rows!r}: expected whole numbers of at least 1, comma-separated")
    if args.threads:
        torch.set_num_threads(args.threads)
    from kite.model import cpu_products, load_model

    lm = load_model(args.model, device="cpu")
    ways = {"torch's linear": (False, False), "small-rows products (BLAS, transposed)": (True, False)}
    if cpu_products.native_available():
        ways["small-rows products (native runtime)"] = (True, True)
    res = Result("cpu_products", device="cpu")
    for rows in counts:
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.repeat):
            for way, (cpu_products.ENABLED, cpu_products.NATIVE) in ways.items():
                ms, kv = steps_ms(lm, rows, args.steps)
                times[way] += ms
        cpu_products.ENABLED = cpu_products.NATIVE = True
        text, floor_ms = cpu_forward_floor(lm, tokens=rows, kv_tokens=kv, what=f"a decode step of {rows} rows")
        base = None
        for way, ms in times.items():
            row = res.row(f"decode step, {rows} rows: {way}", statistics.median(ms), "ms", floor=text,
                          floor_value=floor_ms, **({"baseline": base["name"]} if base else {}))
            base = base or row
    res.raw.update({"model": args.model, "threads": torch.get_num_threads(), "steps": args.steps,
                    "rounds": args.repeat, "ways": list(ways)})
    return finish(res, args)


if __name__ == "__main__":
    sys.exit(main())
