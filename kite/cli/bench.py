"""`kite bench`: the fused pipeline against full prefill and equal-size baselines; results history."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kite.cli._common import (JsonOpt, MkdirOpt, console, emit_json, kept_on_interrupt, model_spec, new_app, rules_file,
                              user_config)
from kite.errors import BadInput

app = new_app(
    "Benchmark the fused pipeline against full prefill and baselines.\n\n"
    "Examples:\n\n"
    "  kite bench run --upcycle out/bench-states --cases configs/bench_cases.jsonl --output out/bench.json\n\n"
    "  kite bench run --baselines full,window,kivi --thresholds configs/bench.yaml --plot out/plots --json\n\n"
    "  kite bench history --json"
)


@app.callback()
def _group() -> None:
    """Benchmark the fused pipeline against full prefill and baselines; list past runs."""


@app.command("run")
def run(
    output: Annotated[Path, typer.Option("--output", "-o", help="Results JSON (rewritten after every case).")],
    cases: Annotated[Optional[str], typer.Option("--cases", help="Cases JSONL (docs/bench-cases.md); "
                                                 "default configs/bench_cases.jsonl.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="HF folder, .gguf or embedded name "
                                                 "(default: config model.default).")] = None,
    upcycle: Annotated[Optional[Path], typer.Option("--upcycle", help="Folder of the documents' .upc states "
                                                    "(made when missing, reused when they match; default "
                                                    "$KITE_HOME/bench-states).")] = None,
    yoco_rules: Annotated[Optional[Path], typer.Option("--yoco-rules", help="YOCO rule file "
                                                       "(default: config yoco.rules_file).")] = None,
    upcycle_config: Annotated[Optional[Path], typer.Option("--upcycle-config", help="upcycle_config.yaml "
                                                            "(default configs/upcycle_config.yaml).")] = None,
    baselines: Annotated[str, typer.Option(help="Comma list of full,window,kivi,snapkv,state,kvpress,budget (full "
                                           "is always run: it is the reference).")] = "full,window,kivi,snapkv,state,kvpress",
    thresholds: Annotated[Optional[Path], typer.Option(help="bench.yaml with `thresholds:` (default "
                                                       "configs/bench.yaml, else the defaults; the section of the run's device class, cpu or gpu).")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write PNG plots into this folder.")] = None,
    families: Annotated[Optional[str], typer.Option(help="Only these families (summary,multihop,fuzzy,needle,qa).")] = None,
    per_family: Annotated[Optional[int], typer.Option(min=1, help="At most N questions per family per contract.")] = None,
    max_cases: Annotated[Optional[int], typer.Option(min=1, help="Stop after N cases.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per answer.")] = 32,
    ratio: Annotated[Optional[float], typer.Option(help="State compression ratio (default: 1 / config "
                                                   "features.upcycle_compression_ratio when set, else the "
                                                   "upcycle config's).")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu | cuda (default: cuda when present).")] = None,
    threads: Annotated[Optional[int], typer.Option(min=1, help="torch CPU threads (on a loaded machine "
                                                   "1 is often fastest).")] = None,
    health_store: Annotated[Optional[Path], typer.Option(help="Health store the fused pipeline learns in "
                                                         "(default: a fresh one for this run).")] = None,
    kv_budget_tokens: Annotated[Optional[int], typer.Option("--kv-budget-tokens", help="Also run `budget`: the "
                                                            "memory-budgeted cache holding N tokens raw "
                                                            "(docs/kv-budget.md; default 1024 when --baselines "
                                                            "names budget).")] = None,
    concurrency: Annotated[Optional[int], typer.Option(min=1, help="Also answer the cases from their states to N "
                                                        "clients at once, batched and one at a time: aggregate "
                                                        "tokens/s and time to first token.")] = None,
    ray: Annotated[bool, typer.Option("--ray", help="Spread the cases over a Ray cluster's workers (one task per "
                                      "group of documents; a local Ray head unless --ray-address). "
                                      "docs/scale-out.md")] = False,
    ray_address: Annotated[Optional[str], typer.Option(help="With --ray: an existing Ray cluster.")] = None,
    ray_workers: Annotated[Optional[int], typer.Option(min=1, help="With --ray: tasks at once (default: the "
                                                       "cluster's CPUs).")] = None,
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Run every case through full prefill, the baselines and the fused pipeline; exit 1 when a
    threshold fails (or a case fails: the cases finished are still written)."""
    from kite.bench.cases import default_cases_path
    from kite.bench.history import append_run, record_of
    from kite.bench.runner import BenchSettings, run_bench
    from kite.cli._progress import progress_bar

    if cases is None:
        found = default_cases_path()
        if found is None:
            raise BadInput("--cases: give a cases JSONL (kite bench cases --out FILE makes one)")
        cases = str(found)
    if upcycle is None:
        from kite.paths import kite_home

        upcycle = kite_home() / "bench-states"
    from kite.atomic import check_output, check_output_folder

    check_output(output, mkdir, "--output")
    check_output_folder(upcycle, mkdir, "--upcycle")
    if plot is not None:
        check_output_folder(plot, mkdir, "--plot")
    if health_store is not None:
        check_output(health_store, mkdir, "--health-store")
    cfg = user_config()
    s = BenchSettings(cases=cases, output=str(output), model=model_spec(model), upcycle_dir=str(upcycle),
                      rules=str(rules_file(yoco_rules)),
                      upcycle_config=str(upcycle_config) if upcycle_config else None,
                      baselines=[b.strip() for b in baselines.split(",") if b.strip()],
                      thresholds=str(thresholds) if thresholds else None,
                      families=[f.strip() for f in families.split(",")] if families else None,
                      per_family=per_family, max_cases=max_cases, max_new_tokens=max_new_tokens,
                      ratio=ratio, kept_fraction=cfg.features.upcycle_compression_ratio,
                      min_hit_gain=cfg.features.yoco_min_hit_gain, device=device,
                      health_store=str(health_store) if health_store else None,
                      kv_budget_tokens=kv_budget_tokens, concurrency=concurrency)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    ended: list[dict] = []   # the run's one result, however it ends: recorded once

    def record(result: dict) -> None:
        ended.append(result)
        append_run(record_of(result, str(output)))

    with kept_on_interrupt(lambda: _kept(ended, output)), progress_bar() as progress:
        if ray or ray_address:
            from kite.bench.on_ray import run_bench_ray

            result = run_bench_ray(s, workers=ray_workers, address=ray_address, threads=threads or 1,
                                   progress=progress)
            record(result)
        else:
            result = run_bench(s, progress, record=record)
    plots = []
    if plot is not None:
        from kite.bench.plots import write_plots

        plots = write_plots(result, plot)
    if json_out:
        emit_json({**result, "plots": plots})
    else:
        _print(result, output, plots)
    if not result["passed"]:
        raise typer.Exit(1)


def _kept(ended: list[dict], output: Path) -> str:
    """What an interrupted `bench run` kept."""
    if not ended:
        return f"no case had started; nothing recorded, {output} not written"
    r = ended[-1]
    done = [row["id"] for row in r["cases"]]
    which = f" ({', '.join(done)})" if done else ""
    return (f"{len(done)} of {r['cases_total']} cases finished{which}: kept in {output}, recorded in "
            "`kite bench history` as interrupted")


def _print(result: dict, output: Path, plots: list[str]) -> None:
    from kite.bench.report import family_table, results_table, targets_table, threshold_table

    out = console()
    out.print(results_table(result))
    out.print(family_table(result))
    for note in result["notes"]:
        out.print(f"[yellow]note[/] {note}", highlight=False)
    fused = result["summary"]["fused"]
    out.print(f"fused: regenerate rate {fused.get('upcycle_regenerate_rate')} MB/1K tokens · yoco_hit_rate "
              f"{fused.get('yoco_hit_rate')} ({fused.get('loads')} loads; reference PPL better than no "
              f"document in {fused.get('load_helped_rate')} of them) · memory peak "
              f"{result['cases'][-1]['memory_peak_gb']:.2f} GB ({result['cases'][-1]['memory_source']})",
              highlight=False)
    out.print(targets_table(result))
    c = result.get("concurrency")
    if c:
        b, one = c["batched"], c["one_at_a_time"]
        out.print(f"{c['clients']} clients, {c['requests']} requests from states: batched {b['tokens_per_s']} tokens/s "
                  f"(TTFT p50 {b['ttft_p50_ms']} ms, p95 {b['ttft_p95_ms']} ms) vs one at a time "
                  f"{one['tokens_per_s']} tokens/s (p50 {one['ttft_p50_ms']} ms): {c['throughput_ratio']}×; answers "
                  + ("identical" if c["identical_answers"] else f"[red]differ[/] in {c['differing']}"),
                  highlight=False)
    out.print(threshold_table(result))
    if result.get("error"):
        out.print(f"[red]partial run[/]: {result['error']}", highlight=False)
    out.print(f"wrote {output}" + (f", plots {', '.join(plots)}" if plots else ""), highlight=False)
    verdict = "[green]PASS[/]" if result["passed"] else "[red]FAIL[/]"
    out.print(f"{verdict} ({len(result['cases'])} cases, {result['wall_s']} s)")


@app.command("show")
def show(
    results: Annotated[Path, typer.Argument(help="A results JSON written by `kite bench run`.")],
    markdown: Annotated[bool, typer.Option("--markdown", help="Markdown tables (for docs).")] = False,
    json_out: bool = JsonOpt,
) -> None:
    """Print a results file's tables again (figures recomputed from its cases)."""
    import json

    from kite.bench.report import summarize, targets

    try:
        result = json.loads(results.read_text(encoding="utf-8"))
        result["summary"] = summarize(result["cases"], result["methods"])
    except FileNotFoundError:
        raise BadInput(f"{results}: no such file") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"{results}: not a kite bench results file ({exc})") from None
    result["targets"] = targets(result["summary"])
    if json_out:
        emit_json(result)
        return
    if markdown:
        import sys

        from kite.bench.report import markdown as to_markdown

        sys.stdout.write(to_markdown(result))
        return
    _print(result, results, [])


@app.command("history")
def history(
    limit: Annotated[int, typer.Option(min=1, help="Show the last N runs.")] = 20,
    json_out: bool = JsonOpt,
) -> None:
    """List recorded bench runs ($KITE_HOME/results/bench.jsonl), newest last."""
    from kite.bench.history import history_path, read_history

    runs = read_history()[-limit:]
    if json_out:
        emit_json({"path": str(history_path()), "runs": runs})
        return
    out = console()
    if not runs:
        out.print(f"no bench runs recorded yet ({history_path()})", highlight=False)
        return
    from rich.table import Table

    t = Table("run", "finished", "model", "status", "cases", "fused F1", "full F1", "fused TTFT ms",
              "full TTFT ms", box=None, caption="figures are over the cases that finished" if any(
                  r.get("cases_total") not in (None, r["cases"]) for r in runs) else None)
    for r in runs:
        f, g = r["figures"].get("fused", {}), r["figures"].get("full", {})
        total = r.get("cases_total")
        t.add_row(r["run_id"], str(r["finished_at"]), r["model"]["fingerprint"][9:21],
                  f"[{_STATUS_COLOUR[r['status']]}]{r['status']}[/]",
                  f"{r['cases']}/{total}" if total is not None else str(r["cases"]),
                  _n(f.get("f1")), _n(g.get("f1")), _n(f.get("ttft_ms"), ".0f"), _n(g.get("ttft_ms"), ".0f"))
    out.print(t)


_STATUS_COLOUR = {"passed": "green", "failed": "red", "error": "red", "interrupted": "yellow"}


def _n(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


@app.command("cases")
def cases_cmd(
    out: Annotated[Path, typer.Option("--out", help="Where to write the cases JSONL.")],
    n: Annotated[int, typer.Option("--n", min=1, help="Contracts.")] = 2,
    tokens: Annotated[int, typer.Option(min=1, help="Tokens per contract (words × 1.45 estimate).")] = 1500,
    seed: Annotated[int, typer.Option(help="Same seed, same file.")] = 0,
    per_family: Annotated[int, typer.Option(min=1, help="Questions kept per family per contract.")] = 1,
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Write a small deterministic case set (the bundled configs/bench_cases.jsonl is --n 2
    --tokens 1500 --seed 0 --per-family 1)."""
    from kite.atomic import check_output, write_text
    from kite.bench.cases import make_default_cases
    from kite.data.contracts import to_jsonl

    check_output(out, mkdir, "--out")
    records = make_default_cases(n, tokens, seed, per_family)
    write_text(out, to_jsonl(records))
    info = {"out": str(out), "contracts": n, "questions": sum(len(r["questions"]) for r in records)}
    if json_out:
        emit_json(info)
    else:
        console().print(f"wrote {info['questions']} questions on {n} contracts to {out}", highlight=False)
