"""A CPU decode step and a short prompt's forward with torch's linear against KITE's products of a few
rows (kite.model.cpu_products).

The embedded model on this CPU, a BatchDecoder of 1, 2, 4 and 8 rows (plain prompts of ~40
tokens), its decode steps timed three ways in turn: torch's linear, the products through BLAS (the
weight times the rows transposed) and through the native runtime's kernel where it is built
(``--repeat`` rounds, each round every way, the median step of each kept): side by side, in one run.
Then the forward of one prompt of each of ``--prompts`` token counts (no cache), with linear and with
the products (the native runtime's up to its NATIVE_ROWS rows; what a short prompt's prefill or
YOCO's pass over a query runs), alternated the same way.

    .venv/bin/python benchmarks/cpu_products.py --threads 2

Rows: per row count, the step with linear (the baseline) and with the products; floors: the step's
weights and KV read once at this CPU's measured memory bandwidth (harness.floors.cpu_forward_floor).
Per prompt length, the forward with linear (the baseline) and with the products; floor: the larger of
the weights read once and 2 x parameters x tokens FLOPs at this CPU's measured fp32 rate.
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


def forward_ms(lm, tokens: int, rounds: int = 3) -> list[float]:
    """The model's forward of one prompt of ``tokens`` tokens (no cache), timed ``rounds`` times (ms)."""
    ids = torch.randint(100, lm.tokenizer.vocab_size - 100, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    out = []
    with torch.inference_mode():
        lm.model(ids, use_cache=False)
        for _ in range(rounds):
            t = clock()
            lm.model(ids, use_cache=False)
            out.append((clock() - t) * 1e3)
    return out


def counts_of(ap, flag: str, text: str) -> list[int]:
    """Whole numbers of at least 1, comma-separated (empty: none); a bad list is refused in one line."""
    try:
        counts = [int(r) for r in text.split(",")] if text else []
        if counts and min(counts) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"{flag} {text!r}: expected whole numbers of at least 1, comma-separated")
    return counts


def main(argv=None) -> int:
    ap = parser(__doc__, timing=True, repeat=3, warmup=0, device="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,2,4,8", help="row counts, comma-separated (default 1,2,4,8)")
    ap.add_argument("--steps", type=int, default=12, help="decode steps timed a round (default 12)")
    ap.add_argument("--prompts", default="12,25,45,100,160,256",
                    help="prompt lengths in tokens whose forward is timed, comma-separated ('' for none)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parse(ap, argv)
    counts = counts_of(ap, "--rows", args.rows)
    prompts = counts_of(ap, "--prompts", args.prompts)
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
    forwards = {"torch's linear": False, "small-rows products": True}
    for tokens in prompts:
        times = {way: [] for way in forwards}
        for _ in range(args.repeat):
            for way, cpu_products.ENABLED in forwards.items():
                times[way] += forward_ms(lm, tokens)
        cpu_products.ENABLED = True
        text, floor_ms = cpu_forward_floor(lm, tokens=tokens, what=f"a forward of {tokens} tokens")
        base = None
        for way, ms in times.items():
            row = res.row(f"prompt of {tokens} tokens, forward: {way}", statistics.median(ms), "ms", floor=text,
                          floor_value=floor_ms, **({"baseline": base["name"]} if base else {}))
            base = base or row
    res.raw.update({"model": args.model, "threads": torch.get_num_threads(), "steps": args.steps,
                    "rounds": args.repeat, "ways": list(ways), "prompts": prompts,
                    "native_rows": cpu_products.NATIVE_ROWS if cpu_products.native_available() else None})
    return finish(res, args)


if __name__ == "__main__":
    sys.exit(main())
