"""Mutants of a small state through the public load path: counts by kind and outcome.

A small PCA-coded state (ratio=4, 3 clusters) of the tiny corpus on a tiny random Llama (3 layers,
2 KV heads of 16), and N mutants of it (kite/upcycle/format/mutants.py: random damage, header edits
with the checksum recomputed, blob edits with checksums and offsets rewritten, blob-index key swaps,
cluster-table edits), each loaded as `kite generate --upc` loads it (`StateFile` + `load_prefix`,
every cluster and layer, on the CPU) in a fork of a child process, so that a native crash is counted
(kite/upcycle/study/state_fuzz.py). One row per (kind, outcome): refused (one line), crash (a
signal, or a hang), internal (any other exception), identical (loaded as the original), different
(loaded into other KV without an error); the last three must be 0. `--without-content` fuzzes the
state without its header's content digest, as states were written before it: what the parts' own
structure catches. Then the median load time of
each outcome, and each bad mutant's name in `raw`.

    .venv/bin/python benchmarks/fuzz_states.py [--mutants 10000] [--workers 2]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, finish, parse, parser, wall  # noqa: E402
from harness.floors import cpu_bytes_ms, cpu_mem_text  # noqa: E402


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--mutants", type=int, default=10000, help="how many mutants (default 10000)")
    ap.add_argument("--workers", type=int, default=2, help="child processes at a time (default 2)")
    ap.add_argument("--batch", type=int, default=1000, help="mutants per child process (default 1000)")
    ap.add_argument("--codec", default="ratio=4", help="the state's codec (default ratio=4)")
    ap.add_argument("--without-content", action="store_true",
                    help="fuzz the state without its header's content digest (as states were written before it)")
    args = parse(ap, argv)
    if args.mutants < 1:
        ap.error("--mutants must be >= 1")
    from kite.testing.corpus import CORPUS
    from kite.testing.tiny_models import make_tiny_model
    from kite.upcycle.study import BAD_OUTCOMES, OUTCOMES, counts, fuzz_states, make_fuzz_state

    res = Result("fuzz_states", device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "llama")
        state = make_fuzz_state(model, CORPUS.replace(". ", ".\n\n", 3), Path(tmp) / "small.upc", codec=args.codec,
                                content=not args.without_content)
        size = state.stat().st_size
        with wall() as span:
            outcomes = fuzz_states(model, state, args.mutants, seed=args.seed, batch=args.batch,
                                   workers=args.workers)
    by_kind = counts(outcomes)
    for kind, row in by_kind.items():
        for outcome in OUTCOMES:
            res.row(f"{kind}: {outcome}", row[outcome], "mutants", of=sum(row.values()))
    for outcome in OUTCOMES:
        ms = [o.ms for o in outcomes if o.outcome == outcome and o.ms]
        if ms:
            # a load reads the state at least once, whatever it finds: its bytes at memory bandwidth
            res.row(f"median load, {outcome}", round(statistics.median(ms), 3), "ms", samples=len(ms),
                    floor=f"the state's {size:,} bytes read once {cpu_mem_text()}", floor_value=cpu_bytes_ms(size))
    res.raw.update(mutants=args.mutants, seed=args.seed, codec=args.codec, content_digest=not args.without_content,
                   state_bytes=size,
                   wall_s=round(span.s, 1), counts=by_kind,
                   bad=[o.to_dict() for o in outcomes if o.outcome in BAD_OUTCOMES][:500])
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
