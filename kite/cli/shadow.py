"""`kite shadow`: a candidate config against the golden one on the same cases (the seed's shadow
validation); exit 1 when substantive differences pass the golden config's own noise by more than
--max-substantive."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kite.cli._common import JsonOpt, MkdirOpt, console, emit_json, model_spec


def shadow(
    golden: Annotated[Path, typer.Option("--golden", help="The golden pipeline's YAML (method, ratio, rules, temperature ...).")],
    candidate: Annotated[Path, typer.Option("--candidate", help="The candidate pipeline's YAML.")],
    cases: Annotated[str, typer.Option("--cases", help="Cases JSONL (docs/bench-cases.md).")],
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="HF folder, .gguf or embedded name "
                                                 "(default: config model.default).")] = None,
    upcycle: Annotated[Optional[Path], typer.Option("--upcycle", help="Folder of states (default $KITE_HOME/bench-states).")] = None,
    max_substantive: Annotated[float, typer.Option(help="Largest substantive-diff rate above the noise floor that passes.")] = 0.05,
    max_cases: Annotated[Optional[int], typer.Option(min=1, help="Only the first N cases.")] = None,
    threads: Annotated[Optional[int], typer.Option(min=1, help="torch CPU threads.")] = None,
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Both pipelines answer the same cases; token diffs are classified identical /
    whitespace-punctuation / stop-words / substantive; the golden config run twice (next sampling
    seed) gives the noise floor.

    Example: kite shadow --golden configs/shadow_golden.yaml --candidate new.yaml --cases configs/bench_cases.jsonl
    """
    from kite.bench.shadow import run_shadow
    from kite.cli._progress import progress_bar

    model = model_spec(model)
    if upcycle is not None:
        from kite.atomic import check_output_folder

        check_output_folder(upcycle, mkdir, "--upcycle")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    with progress_bar() as progress:
        report = run_shadow(golden, candidate, cases, model=model, states_dir=upcycle,
                            max_substantive=max_substantive, max_cases=max_cases, progress=progress)
    if json_out:
        emit_json(report.to_dict())
    else:
        _print(report)
    if not report.passed:
        raise typer.Exit(1)


def _print(report) -> None:
    from rich.markup import escape
    from rich.table import Table

    out = console()
    t = Table("class", f"{report.golden} vs {report.candidate}", f"{report.golden} vs itself (noise)", box=None)
    for k in report.rates:
        t.add_row(k, f"{report.rates[k]:.1%}", f"{report.noise_rates[k]:.1%}")
    out.print(t)
    for ex in report.examples:
        out.print(f"[bold]{escape(ex['id'])}[/] {escape(ex['question'])}", highlight=False)
        for d in ex["diff"][:5]:
            out.print(f"  [red]- {escape(d['golden'])}[/]  [green]+ {escape(d['candidate'])}[/]", highlight=False)
    verdict = "[green]PASS[/]" if report.passed else "[red]FAIL[/]"
    out.print(f"{verdict}: substantive {report.substantive_rate:.1%}, noise floor {report.noise_floor:.1%}, "
              f"excess {report.excess:.1%} (max {report.max_substantive:.1%}) over {report.cases} cases",
              highlight=False)
