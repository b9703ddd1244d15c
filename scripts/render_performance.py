"""Render docs/PERFORMANCE.md's tables from benchmarks/performance_rows.yaml and the result files in
benchmarks/results (kite.bench.perfdoc). `--check` renders nothing and exits 1, listing each problem,
when a table differs from its rendering, a row's result file is missing, has no commit or lacks the
row, or a table row stands outside the rendered tables.

    python scripts/render_performance.py            # rewrite the tables in place
    python scripts/render_performance.py --check    # CI: exit 1 unless every figure is backed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kite.bench.perfdoc import check_doc, load_spec, render_doc  # noqa: E402
from kite.errors import KiteError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 unless the doc is its rendering, every row backed")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "PERFORMANCE.md")
    ap.add_argument("--spec", type=Path, default=ROOT / "benchmarks" / "performance_rows.yaml")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    try:
        spec, text = load_spec(args.spec), args.doc.read_text()
        if args.check:
            problems = check_doc(text, spec, args.results)
            for p in problems:
                print(f"{args.doc}: {p}", file=sys.stderr)
            return 1 if problems else 0
        new = render_doc(text, spec, args.results)
    except (KiteError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if new != text:
        args.doc.write_text(new)
    print(f"{args.doc}: {sum(len(r) for r in spec.values())} rows in {len(spec)} tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
