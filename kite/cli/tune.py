"""`kite tune`: sweep KITE's knobs through the bench; list what can be tuned."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

from kite.cli._common import (JsonOpt, MkdirOpt, console, emit_json, kept_on_interrupt, model_spec, new_app,
                              rules_file, user_config)
from kite.errors import BadInput

app = new_app(
    "Sweep compression, clusters, spans, the minimum gain and the rules' thresholds through the bench.\n\n"
    "Examples:\n\n"
    "  kite tune params\n\n"
    "  kite tune auto --param ratio --values 2,4,8 --param cluster_num --min 4 --max 8 --step 4 "
    "--objective qps --constraint \"ppl_delta < 0.5\" --cases cases.jsonl --output best_config.yaml\n\n"
    "  kite tune auto --param yoco_min_hit_gain --min 0.002 --max 0.006 --step 0.001 "
    "--metric \"qps|ppl_delta<0.5\" --output best_config.yaml --resume\n\n"
    "  kite tune auto --param ratio --min 2 --max 16 --param rules.confident_label.label_entropy --min 0 "
    "--max 1 --search optuna --trials 20 --objective f1 --objective bytes --output best.yaml --json"
)

RANGE_FLAGS = {"--min": "min", "--max": "max", "--step": "step", "--values": "values"}


class _KeepsOrder(TyperCommand):
    """Keeps the raw arguments: which --min/--max/--step/--values follow which --param is their
    order on the command line, which the parsed lists lose."""

    def parse_args(self, ctx, args):
        ctx.meta["kite_tune_args"] = list(args)
        return super().parse_args(ctx, args)


@app.callback()
def _group() -> None:
    """Sweep KITE's knobs through the bench (`auto`); list the tunable parameters (`params`)."""


def group_ranges(args: list[str]):
    """`--param NAME` and the range flags after it, in command-line order → RangeSpec list.
    BadInput for a range flag before any --param, or one given twice for a parameter."""
    from kite.tune import RangeSpec

    specs: list[RangeSpec] = []
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--":
            break
        flag, eq, inline = tok.partition("=")
        if flag != "--param" and flag not in RANGE_FLAGS:
            i += 1
            continue
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
        i += 1 if eq else 2
        if flag == "--param":
            specs.append(RangeSpec(str(value)))
            continue
        if not specs:
            raise BadInput(f"{flag} {value} comes before any --param: write --param NAME --min A --max B --step S "
                           f"(or --param NAME --values a,b)")
        field = RANGE_FLAGS[flag]
        if getattr(specs[-1], field) is not None:
            raise BadInput(f"--param {specs[-1].name}: {flag} is given twice")
        setattr(specs[-1], field, value)
    return specs


@app.command("auto", cls=_KeepsOrder, epilog=(
    "Examples: kite tune auto --param ratio --values 4,8 --param cluster_num --min 4 --max 8 --step 4 --objective qps "
    "--constraint \"ppl_delta < 0.5\" --cases cases.jsonl --output best_config.yaml;  kite tune auto --param "
    "yoco_min_hit_gain --min 0.002 --max 0.006 --step 0.0005 --metric \"qps|ppl_delta<0.5\" --output best.yaml "
    "--resume.  docs/tuning.md"))
def auto(
    ctx: typer.Context,
    output: Annotated[Path, typer.Option("--output", "-o", help="Where the best point goes: a KITE config file "
                                         "(`kite config validate` accepts it), written atomically.")],
    param: Annotated[Optional[list[str]], typer.Option("--param", help="A parameter to vary (`kite tune params`), "
                                                       "followed by its --min/--max/--step or --values.")] = None,
    min_: Annotated[Optional[list[str]], typer.Option("--min", help="The last --param's lowest value.")] = None,
    max_: Annotated[Optional[list[str]], typer.Option("--max", help="The last --param's highest value.")] = None,
    step: Annotated[Optional[list[str]], typer.Option("--step", help="The last --param's step (must divide "
                                                      "max - min; optional with --search optuna).")] = None,
    values: Annotated[Optional[list[str]], typer.Option("--values", help="The last --param's values, comma-"
                                                        "separated (the only form for precision).")] = None,
    objective: Annotated[Optional[list[str]], typer.Option("--objective", help="What to optimize: qps, ttft_ms, "
                                                           "f1, ppl_delta, bytes or any bench metric; twice for a "
                                                           "Pareto front of two.")] = None,
    constraint: Annotated[Optional[list[str]], typer.Option("--constraint", help="A condition every point must "
                                                            "meet, in the rules' language: \"ppl_delta < 0.5\".")] = None,
    metric: Annotated[Optional[str], typer.Option("--metric", help="The seed's form: \"OBJECTIVE|CONSTRAINT\", "
                                                  "e.g. \"qps|ppl_delta<0.5\".")] = None,
    cases: Annotated[Optional[str], typer.Option("--cases", help="Cases JSONL (default configs/bench_cases.jsonl).")] = None,
    search: Annotated[str, typer.Option("--search", help="grid (every combination) or optuna (TPE; NSGA-II for "
                                        "two objectives).")] = "grid",
    trials: Annotated[Optional[int], typer.Option("--trials", help="Points Optuna runs (--search optuna).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Optuna's sampler seed.")] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="Read the points the results file holds instead of "
                                         "running them again.")] = False,
    no_reuse: Annotated[bool, typer.Option("--no-reuse", help="Run every point from scratch (model load, full "
                                           "prefill, states): to measure what reuse saves.")] = False,
    results: Annotated[Optional[Path], typer.Option("--results", help="Results JSON (default OUTPUT's name "
                                                    "+ .tune.json).")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Pareto PNG (default OUTPUT's name + .pareto.png).")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="HF folder, .gguf or embedded name.")] = None,
    upcycle: Annotated[Optional[Path], typer.Option("--upcycle", help="States folder, shared with kite bench run "
                                                    "(default $KITE_HOME/bench-states).")] = None,
    yoco_rules: Annotated[Optional[Path], typer.Option("--yoco-rules", help="Rule file (default rules/yoco_rules.yaml).")] = None,
    upcycle_config: Annotated[Optional[Path], typer.Option("--upcycle-config", help="upcycle_config.yaml (default "
                                                           "configs/upcycle_config.yaml).")] = None,
    families: Annotated[Optional[str], typer.Option(help="Only these case families.")] = None,
    per_family: Annotated[Optional[int], typer.Option(min=1, help="At most N questions per family per contract.")] = None,
    max_cases: Annotated[Optional[int], typer.Option(min=1, help="Stop after N cases.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per answer.")] = 32,
    device: Annotated[Optional[str], typer.Option(help="cpu | cuda (default: cuda when present).")] = None,
    threads: Annotated[Optional[int], typer.Option(min=1, help="torch CPU threads.")] = None,
    ray: Annotated[bool, typer.Option("--ray", help="Measure the grid's points at once on a Ray cluster's workers "
                                      "(a local Ray head unless --ray-address). docs/scale-out.md")] = False,
    ray_address: Annotated[Optional[str], typer.Option(help="With --ray: an existing Ray cluster.")] = None,
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Run a sweep: each point is a bench run (full prefill + the fused pipeline) that reuses the
    model, full prefill's answers and every state made at the same settings. Writes the results,
    a Pareto PNG and the best point as a config; exit 1 when no point meets the constraints."""
    from kite.atomic import check_output, check_output_folder
    from kite.bench.cases import default_cases_path
    from kite.cli._progress import progress_bar
    from kite.tune import (TuneSettings, parse_constraint, parse_metric, parse_objective, parse_ranges, run_tune,
                           tunable_params)

    specs = group_ranges(ctx.meta.get("kite_tune_args", []))
    given = [len(x or []) for x in (param, min_, max_, step, values)]
    if given != [len(specs), *(sum(getattr(s, f) is not None for s in specs) for f in RANGE_FLAGS.values())]:
        raise BadInput("--param and its --min/--max/--step/--values could not be matched up; write each "
                       "as --param NAME --min A --max B --step S")
    objectives = [parse_objective(o) for o in objective or []]
    constraints = [parse_constraint(c) for c in constraint or []]
    if metric is not None:
        obj, more = parse_metric(metric)
        if objectives:
            raise BadInput(f"--metric {metric!r} names an objective and so does --objective; give one of them")
        objectives, constraints = [obj], [*more, *constraints]
    if not objectives:
        raise BadInput("give --objective (qps, ttft_ms, f1, ppl_delta, bytes, ...) or --metric \"qps|ppl_delta<0.5\"")
    if len({o.name for o in objectives}) != len(objectives):
        raise BadInput(f"--objective {objectives[0].name} is given twice")
    from kite.tune.search import check_search

    check_search(search, len(objectives), trials)
    cfg = user_config()
    ranges = parse_ranges(specs, tunable_params(rules_file(yoco_rules), upcycle_config, cfg), continuous_ok=search == "optuna")
    if cases is None:
        found = default_cases_path()
        if found is None:
            raise BadInput("--cases: give a cases JSONL (kite bench cases --out FILE makes one)")
        cases = str(found)
    check_output(output, mkdir, "--output")
    results = results or output.with_name(f"{output.stem}.tune.json")
    plot = plot or output.with_name(f"{output.stem}.pareto.png")
    check_output(results, mkdir, "--results")
    check_output(plot, mkdir, "--plot")
    if upcycle is None:
        from kite.paths import kite_home

        upcycle = kite_home() / "bench-states"
    check_output_folder(upcycle, mkdir, "--upcycle")
    s = TuneSettings(cases=cases, output=str(output), results=str(results),
                     workdir=str(output.with_name(f"{output.stem}.tune")), ranges=ranges, objectives=objectives,
                     constraints=constraints, plot=str(plot), search=search, trials=trials, seed=seed, resume=resume,
                     reuse=not no_reuse, model=model_spec(model), upcycle_dir=str(upcycle),
                     rules=str(rules_file(yoco_rules)),
                     upcycle_config=str(upcycle_config) if upcycle_config else None,
                     families=[f.strip() for f in families.split(",")] if families else None,
                     per_family=per_family, max_cases=max_cases, max_new_tokens=max_new_tokens, device=device,
                     kept_fraction=cfg.features.upcycle_compression_ratio,
                     min_hit_gain=cfg.features.yoco_min_hit_gain, ray=ray or ray_address is not None,
                     ray_address=ray_address)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    with kept_on_interrupt(lambda: _kept(results)), progress_bar() as progress:
        doc = run_tune(s, progress)
    written = _write_outputs(doc, s)
    if json_out:
        emit_json({**doc, "written": written})
    else:
        _print(doc, written)
    if doc["best"] is None:
        raise typer.Exit(1)


def _kept(results: Path) -> str:
    import json

    try:
        doc = json.loads(results.read_text(encoding="utf-8"))
        n = len(doc["points"])
    except (OSError, ValueError, KeyError):
        return f"no point had finished; {results} not written"
    return (f"{n} point{'s' if n != 1 else ''} finished, kept in {results}; run the same command with --resume "
            "to go on from there")


def _write_outputs(doc: dict, s) -> list[str]:
    """The Pareto PNG and, when a point won, the best config and its companions."""
    from kite.tune import pareto_png, write_best_config
    from kite.upcycle import load_upcycle_config

    written = [s.results, pareto_png(doc, s.plot)]
    if doc["best"] is not None:
        written += write_best_config(doc, s.output, *load_upcycle_config(s.upcycle_config))
    return written


def _print(doc: dict, written: list[str]) -> None:
    from rich.markup import escape

    from kite.tune import points_table, reuse_line
    from kite.tune.judge import params_text

    out = console()
    out.print(points_table(doc))
    for item in doc["skipped"]:
        out.print(f"[yellow]skipped[/] {escape(params_text(item['params']))}: {escape(item['why'])}", highlight=False)
    for item in doc["broken"]:
        if item["points"]:
            out.print(f"[red]{escape(item['constraint'])}[/] broken by "
                      + "; ".join(f"{p['id']} ({escape(params_text(p['params']))}: {escape(p['why'])})"
                                  for p in item["points"]), highlight=False)
    out.print(escape(reuse_line(doc)), highlight=False)
    best = doc["best"]
    if best is None:
        out.print(f"[red]no point meets the constraints[/] ({len(doc['points'])} points); no config written. "
                  f"Results: {escape(written[0])}, plot {escape(written[1])}", highlight=False)
        return
    out.print(f"[green]best[/] {best['id']}: {escape(params_text(best['params']))}", highlight=False)
    for line in best["why"]:
        out.print(f"  {escape(line)}", highlight=False)
    out.print(f"wrote {escape(', '.join(written))} ({doc['wall_s']} s)", highlight=False)


@app.command("params")
def params(
    yoco_rules: Annotated[Optional[Path], typer.Option("--yoco-rules", help="Rule file whose thresholds are listed "
                                                       "(default rules/yoco_rules.yaml).")] = None,
    upcycle_config: Annotated[Optional[Path], typer.Option("--upcycle-config", help="upcycle_config.yaml whose "
                                                           "values are shown as the current ones.")] = None,
    json_out: bool = JsonOpt,
) -> None:
    """List what `kite tune auto --param` takes: name, type, range, the value in force now, and
    whether it acts on the state (new states per value) or the request (states reused)."""
    from kite.tune import metrics, tunable_params

    found = tunable_params(rules_file(yoco_rules), upcycle_config, user_config())
    if json_out:
        emit_json({"params": [p.to_dict() for p in found], "metrics": metrics()})
        return
    from rich.table import Table

    t = Table(title="tunable parameters (kite tune auto --param NAME ...)", box=None)
    for col in ("name", "type", "range", "now", "acts on", "meaning"):
        t.add_column(col)
    for p in found:
        now = "-" if p.current is None else (f"{p.current:g}" if isinstance(p.current, float) else str(p.current))
        t.add_row(p.name, p.kind, p.bounds(), now, p.acts_on, p.doc)
    console().print(t)
    console().print("objectives and constraints may name: " + ", ".join(metrics()), highlight=False)
