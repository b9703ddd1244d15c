"""`kite report`: what many bench runs say together.

Thin over `kite.bench.correlate`: gather the runs, compute, print, plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kite.cli._common import JsonOpt, MkdirOpt, console, emit_json, new_app

app = new_app(
    "Reports across bench runs.\n\n"
    "Examples:\n\n"
    "  kite report correlate\n\n"
    "  kite report correlate --results out/bench/results.json --results out/bench8/results.json --json"
)


@app.command("correlate")
def correlate_cmd(
    results: Annotated[Optional[list[Path]], typer.Option(
        "--results", help="A bench result JSON (kite bench run --output) or a results history (bench.jsonl); "
        "repeat for more.")] = None,
    history: Annotated[bool, typer.Option(
        "--history/--no-history", help="Also read the recorded runs ($KITE_HOME/results/bench.jsonl, "
        "as kite bench history lists them).")] = True,
    knee: Annotated[float, typer.Option(
        "--knee", min=0.0, help="Where to test for a knee, in MB of .upc per 1,000 tokens (the seed claims "
        "0.85).")] = 0.85,
    hit_rate: Annotated[str, typer.Option(
        "--hit-rate", help="Which hit rate: yoco_hit_rate (the seed's: loads whose measured gain was > 0) or "
        "load_helped_rate (loads whose reference PPL beat no document).")] = "yoco_hit_rate",
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="The PNG to write (default $KITE_HOME/results/correlate.png).")] = None,
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    """The correlation between the regenerate rate (MB of .upc per 1,000 context tokens) and YOCO's
    hit rate across bench runs: the runs behind it, Pearson and Spearman with 95 % intervals, a test
    for a knee at --knee (a hinge there against a straight line) and anywhere (sup-F, bootstrapped),
    and a plot (none without runs). Each part says when there are too few runs for it."""
    from kite.atomic import check_output
    from kite.bench.correlate import collect, correlate, write_plot
    from kite.bench.history import history_path, results_dir

    plot = plot or results_dir() / "correlate.png"
    check_output(plot, mkdir=mkdir, flag="--plot")
    points, skipped = collect(list(results or []), history_path() if history else None, hit_rate)
    c = correlate(points, skipped, knee_at=knee, hit_rate=hit_rate)
    written = write_plot(c, plot) if c.points else None     # no runs: nothing to plot
    if json_out:
        emit_json({**c.to_dict(), "plot": written})
        return
    _print(c, written)


def _print(c, plot: str | None) -> None:
    from rich.table import Table

    out = console()
    if c.points:
        t = Table("run", "model", "status", "ratio", "regenerate MB/1k", c.hit_rate, "loads", "source",
                  box=None, title="1 run" if c.runs == 1 else f"{c.runs} runs")
        for p in sorted(c.points, key=lambda p: p.regenerate_rate):
            t.add_row(p.run_id, p.model[9:21], p.status, "-" if p.ratio is None else f"{p.ratio:g}",
                      f"{p.regenerate_rate:.3f}", f"{p.hit_rate:.3f}", "-" if p.loads is None else str(p.loads),
                      p.source)
        out.print(t)
    for s in c.skipped:
        out.print(f"[dim]left out {s.run_id} ({s.source}): {s.why}[/]", highlight=False, soft_wrap=True)
    out.print(f"[bold]correlation[/]: {c.verdict}", highlight=False, soft_wrap=True)
    claim = c.knee.get("at_claim")
    if claim and "p" in claim:
        out.print(f"[bold]knee at {claim['knee']:g}[/]: slope {claim['slope_below']:+.3g} below, "
                  f"{claim['slope_above']:+.3g} above; against a straight line F = {claim['f']:.3g}, "
                  f"p {_p(claim['p'])} ({claim['runs_below']} runs at or below, {claim['runs_above']} above)",
                  highlight=False, soft_wrap=True)
    elif claim:
        out.print(f"[bold]knee at {claim['knee']:g}[/]: not tested: {claim['why_not']}", highlight=False,
                  soft_wrap=True)
    out.print(f"[bold]knee anywhere[/]: {c.knee.get('verdict', '')}", highlight=False, soft_wrap=True)
    if c.knee.get("caveat"):
        out.print(f"[yellow]caveat[/]: {c.knee['caveat']}", highlight=False, soft_wrap=True)
    out.print(f"plot: {plot or 'none (no runs to plot)'}", highlight=False, soft_wrap=True)


def _p(p: float) -> str:
    return "< 0.0001" if p < 1e-4 else f"= {p:.3g}"
