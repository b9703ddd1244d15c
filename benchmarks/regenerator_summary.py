"""Per-ratio summary of `benchmarks/regenerator_quality.py` outputs: one document per row cannot rank
two codecs at margins of a few hundredths of PPL, so this pools the rows of one or more runs.

For every ratio and every method beside ``doc`` (per-document bases): the documents, on how many the
method's ΔPPL (and KL) is lower than per-document bases', the means and medians, and the paired
difference of ΔPPL (method - doc) with its standard error over documents. A document measured in
several files counts once (the last file wins).

    .venv/bin/python benchmarks/regenerator_summary.py benchmarks/results/regenerator_quality_*.json

Rows: per ratio and method the mean KL over the documents, per-document bases' the baseline (a
quality figure, no floor); the whole summary under ``raw``.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from harness import Result, finish, parse, parser


def pooled_rows(paths: list[Path]) -> dict[tuple[str, float], dict]:
    """(document, ratio) -> the row of the last file that measured it, merged over methods."""
    rows: dict[tuple[str, float], dict] = {}
    for path in paths:
        data = json.loads(path.read_text())
        for row in (data["raw"] if "schema" in data else data)["rows"]:   # a result envelope or a bare run
            rows.setdefault((row["document"], float(row["ratio"])), {}).update(row)
    return rows


def summarize(rows: dict[tuple[str, float], dict], method: str) -> list[dict]:
    """One dict per ratio over the documents measured with both ``doc`` and ``method``."""
    out = []
    for ratio in sorted({r for _, r in rows}):
        both = [row for (_, r), row in rows.items() if r == ratio and "doc" in row and method in row]
        if not both:
            continue
        doc = [row["doc"]["ppl_delta"] for row in both]
        new = [row[method]["ppl_delta"] for row in both]
        diff = [b - a for a, b in zip(doc, new)]
        se = statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")
        out.append({
            "ratio": ratio, "method": method, "documents": len(both),
            "ppl_lower": sum(d < 0 for d in diff),
            "kl_lower": sum(row[method]["kl"] < row["doc"]["kl"] for row in both),
            "mean_delta_doc": statistics.fmean(doc), "mean_delta": statistics.fmean(new),
            "median_delta_doc": statistics.median(doc), "median_delta": statistics.median(new),
            "mean_diff": statistics.fmean(diff), "diff_se": se,
            "mean_kl_doc": statistics.fmean(row["doc"]["kl"] for row in both),
            "mean_kl": statistics.fmean(row[method]["kl"] for row in both),
            "bytes_vs_doc": statistics.fmean(row[method]["state_bytes"] / row["doc"]["state_bytes"] for row in both),
        })
    return out


def table(summary: list[dict]) -> str:
    lines = ["| ratio | method | documents | ΔPPL lower | mean ΔPPL doc / method | median | paired diff ± SE | "
             "KL lower | mean KL doc / method | bytes / doc |", "|---" * 10 + "|"]
    for s in summary:
        lines.append(
            f"| {s['ratio']:g}× | {s['method']} | {s['documents']} | {s['ppl_lower']} of {s['documents']} | "
            f"{s['mean_delta_doc']:+.3f} / {s['mean_delta']:+.3f} | {s['median_delta_doc']:+.3f} / "
            f"{s['median_delta']:+.3f} | {s['mean_diff']:+.3f} ± {s['diff_se']:.3f} | {s['kl_lower']} of "
            f"{s['documents']} | {s['mean_kl_doc']:.4f} / {s['mean_kl']:.4f} | {s['bytes_vs_doc']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("files", type=Path, nargs="+", help="regenerator_quality.py's result files")
    ap.add_argument("--methods", nargs="*", default=["regen", "regen+adapter"])
    args = parse(ap, argv)
    rows = pooled_rows(args.files)
    summary = [s for m in args.methods for s in summarize(rows, m)]
    if not summary:
        print("no row measured both per-document bases and " + " or ".join(args.methods), file=sys.stderr)
        return 2
    print(table(summary), file=sys.stderr if args.json else sys.stdout)
    res = Result("regenerator_summary", device="cpu")
    for x in summary:
        at = f"{x['ratio']:g}x, {x['documents']} documents"
        if not any(r["name"] == f"{at}, doc: mean KL" for r in res.rows):
            res.row(f"{at}, doc: mean KL", x["mean_kl_doc"], "nats/token")
        res.row(f"{at}, {x['method']}: mean KL", x["mean_kl"], "nats/token", baseline=f"{at}, doc: mean KL",
                **{k: v for k, v in x.items() if k not in ("mean_kl",)})
    res.raw.update(files=[str(f) for f in args.files], summary=summary)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
