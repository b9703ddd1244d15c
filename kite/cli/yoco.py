"""`kite yoco`: check rule files, list the signals rules may read, and show a load decision.

Thin over `kite.yoco`: every command calls library functions and prints their result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from kite.cli._common import (JsonOpt, MkdirOpt, ModelOpt, console, emit_json, err_console, model_spec, new_app,
                              rule_errors_reported, rules_file, user_config)
from kite.errors import BadInput

app = new_app(
    "YOCO rules, signals and load decisions.\n\n"
    "Examples:\n\n"
    "  kite yoco validate rules/yoco_rules.yaml --labels 违约责任,管辖法院 --layers 30\n\n"
    "  kite yoco decide --signals '{\"intent_entropy\": 5.6}' --labels 违约责任=0.8,管辖法院 --json\n\n"
    "  kite yoco fields"
)

RulesOpt = typer.Option(None, "--rules", help="Rule file (default: config yoco.rules_file, found in the working "
                        "folder, $KITE_HOME or the checkout).")
LabelsOpt = typer.Option(None, "--labels", help="The state's cluster labels, comma-separated; "
                         "`label=health` sets a health (0-1), else the health store's prior.")
LayersOpt = typer.Option(None, "--layers", help="The model's layer count (checks `layers:`).")


def _labels(spec: str | None) -> dict[str, float | None] | None:
    """`a,b=0.7` → {"a": None, "b": 0.7}."""
    if spec is None:
        return None
    out: dict[str, float | None] = {}
    for part in spec.split(","):
        name, eq, value = part.strip().partition("=")
        name = name.strip()
        if not name:
            continue
        if not eq:
            out[name] = None
            continue
        try:
            health = float(value)
        except ValueError:
            raise BadInput(f"--labels {part.strip()!r}: health must be a number in 0-1") from None
        if not 0.0 <= health <= 1.0:
            raise BadInput(f"--labels {part.strip()!r}: health must be in 0-1")
        out[name] = health
    return out


def _load(path: Path, labels, n_layers):
    """Load a rule set; on errors print the full report (every error, with carets) first."""
    from kite.yoco.rules import load_rules

    with rule_errors_reported(path):
        return load_rules(path, labels, n_layers)


@app.command("validate")
def validate(
    file: Annotated[Path, typer.Argument(help="The rule file to check.")],
    labels: Optional[str] = LabelsOpt,
    layers: Optional[int] = LayersOpt,
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", help="Check `layers:` against this model's layer count, as `kite serve --model` "
        "does (reads its config, not its weights): HF folder, .gguf file or embedded name.")] = None,
    json_out: bool = JsonOpt,
) -> None:
    """Check a rule file: YAML, fields, operators, types, labels, actions, the default rule, and
    with --model (or --layers) the layers against the model: the errors `kite serve` and a reload
    would give for that model. Every error prints as `file:line:col: message` with the line and a
    caret; exit 2."""
    from kite.yoco.rules import RuleSetError, load_rules

    if model is not None and layers is not None:
        raise BadInput("give --model or --layers, not both (--model reads the layer count from the model)")
    names = None if labels is None else list(_labels(labels) or {})
    n_layers = layers
    if model is not None:
        from kite.model import geometry_from_config, load_config_only

        n_layers = geometry_from_config(load_config_only(model)[2]).n_layers  # its config only, no weights
    if not json_out:
        rs = _load(file, names, n_layers)
        against = (f", layers checked against {n_layers}" if n_layers is not None else
                   ", layers not checked (give --model or --layers)" if any(r.layer_runs for r in rs.rules)
                   else "")
        console().print(f"[green]ok[/] {file}: {len(rs.rules)} rules, version {rs.version}, "
                        f"default {rs.rules[-1].name!r}, sha256 {rs.sha256[:12]}{against}", highlight=False,
                        soft_wrap=True)
        return
    try:
        rs = load_rules(file, names, n_layers)
    except RuleSetError as exc:
        emit_json({"ok": False, "file": str(file), "n_layers": n_layers,
                   "errors": [e.to_dict() for e in exc.errors]})
        raise
    emit_json({"ok": True, "errors": [], **rs.info(), "n_layers": n_layers,
               "rule_names": [r.name for r in rs.rules]})


@app.command("fields")
def fields(json_out: bool = JsonOpt) -> None:
    """The signals a rule's condition may read: name, type, unit, meaning."""
    from kite.yoco.signals import SIGNAL_FIELDS

    if json_out:
        emit_json([{"name": f.name, "type": f.type, "unit": f.unit, "doc": f.doc}
                   for f in SIGNAL_FIELDS.values()])
        return
    from rich.table import Table

    table = Table("field", "type", "unit", "meaning", box=None)
    for f in SIGNAL_FIELDS.values():
        table.add_row(f.name, f.type, f.unit, f.doc)
    console().print(table)


def _read_signals(spec: str, option: str = "--signals") -> dict[str, Any]:
    """Signals given to `option` as JSON, or `@file.json`; errors name the option (or the file)."""
    where = option
    text = spec
    if spec.startswith("@"):
        path = Path(spec[1:])
        where = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise BadInput(f"{option} {spec}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInput(f"{option} {spec}: cannot read ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{where}:{exc.lineno}:{exc.colno}: not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise BadInput(f"{where}: expected a JSON object of signals")
    return data


def _min_hit_gain(value: float | None) -> float:
    if value is not None:
        return value
    return float(user_config().features.yoco_min_hit_gain)


def _decide_for_signals(rules_path: Path, signals, state, min_hit_gain: float, json_out: bool) -> None:
    """Load the rules (checked against the given labels and layers), decide, print."""
    from kite.yoco.engine import decide

    rs = _load(rules_path, state.labels if state.health else None, state.n_layers)
    if signals.state_health_score is None:
        from dataclasses import replace

        signals = replace(signals, state_health_score=state.health_score())
    plan = decide(rs, signals, state, min_hit_gain)
    if json_out:
        emit_json({"rules": rs.info(), "signals": signals.flat(), "state": {
            "labels": state.health, "n_layers": state.n_layers},
            "min_hit_gain": min_hit_gain, "plan": plan.to_dict()})
        return
    _print_decision(rs, signals, plan, min_hit_gain)


def _print_decision(rs, signals, plan, min_hit_gain: float) -> None:
    """The rule set, the signals, the matched rule and the plan, for people."""
    from rich.markup import escape

    out = console()
    out.print(f"[bold]rules[/]   {rs.source} ({rs.version}, sha256 {rs.sha256[:12]})",
              highlight=False, soft_wrap=True)
    out.print("[bold]signals[/] " + escape(", ".join(f"{k}={v!r}" for k, v in signals.flat().items())),
              highlight=False, soft_wrap=True)
    out.print(f"[bold]matched[/] {escape(plan.matched_rule)}", highlight=False, soft_wrap=True)
    out.print(f"[bold]reason[/]  {escape(plan.reason)}", highlight=False, soft_wrap=True)
    if plan.skipped:
        out.print(f"[bold yellow]skip[/]    {escape(plan.skip_reason or '')}", highlight=False, soft_wrap=True)
    else:
        clusters = plan.clusters if plan.clusters == "all" else ", ".join(plan.clusters)
        layers = "all" if plan.layers is None else _ranges(plan.layers)
        out.print(f"[bold green]load[/]    clusters {escape(clusters)}; layers {layers}; precision "
                  f"{plan.precision or 'as stored'}", highlight=False, soft_wrap=True)
    out.print(f"[bold]gain[/]    predicted {plan.predicted_gain:.4g} (min {min_hit_gain:.4g})"
              + ("; micro-sampling on" if plan.enable_micro_sampling else ""), highlight=False, soft_wrap=True)


def _ranges(layers: list[int]) -> str:
    parts, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(parts)


@app.command("decide")
def decide_cmd(
    signals: Annotated[Optional[str], typer.Option("--signals", help="Signals as JSON, or @file.json "
                                                   "(nested or dotted keys; missing ones default).")] = None,
    state: Annotated[Optional[Path], typer.Option("--state", help="A .upc state: its labels, health "
                                                  "(health store) and layers; needs --query.")] = None,
    query: Annotated[Optional[str], typer.Option("--query", help="The query whose signals the model "
                                                 "computes (with --state).")] = None,
    model: Annotated[Optional[str], ModelOpt] = None,
    rules: Optional[Path] = RulesOpt,
    labels: Optional[str] = LabelsOpt,
    layers: Optional[int] = LayersOpt,
    min_hit_gain: Annotated[Optional[float], typer.Option(
        "--min-hit-gain", min=0.0, help="Skip loads predicted to gain less, >= 0 (default: config "
        "features.yoco_min_hit_gain).")] = None,
    json_out: bool = JsonOpt,
) -> None:
    """Show the rule that matches and the load plan: for explicit --signals, or for a --query
    against a --state (the model computes the query's signals; health from the health store,
    watermark from one sample of the device or host).

    Example: kite yoco decide --state contract.upc --query "who owns the code?" --json
    """
    from kite.yoco.engine import StateInfo
    from kite.yoco.health import health_from_gain, DEFAULT_PRIOR_GAIN
    from kite.yoco.signals import Signals

    if (signals is None) == (state is None):
        raise BadInput("give either --signals, or --state with --query")
    if state is not None:
        if query is None:
            raise BadInput("--state needs --query (the text to decide for)")
        if not query.strip():
            raise BadInput("--query is empty: give the text to decide for")
        if labels is not None or layers is not None:
            raise BadInput("--labels and --layers come from the state with --state; leave them out")
        return _decide_for_state(state, query, model_spec(model), rules_file(rules),
                                 _min_hit_gain(min_hit_gain), json_out)
    if query is not None:
        raise BadInput("--query needs --state (with --signals the query's signals are given)")
    sig = Signals.from_mapping(_read_signals(signals), where="--signals")
    prior = health_from_gain(DEFAULT_PRIOR_GAIN)
    health = {k: (prior if v is None else v) for k, v in (_labels(labels) or {}).items()}
    info = StateInfo(health, layers)
    _decide_for_signals(rules_file(rules), sig, info, _min_hit_gain(min_hit_gain), json_out)


def _model_and_tagger(model: str | None, progress=None):
    """The model and the clause tagger the upcycle config asks for (the one states are tagged with)."""
    from kite.upcycle import open_pipeline

    pipe = open_pipeline(model, progress=progress, kept_fraction=user_config().features.upcycle_compression_ratio)
    return pipe.lm, pipe.tagger


def _decide_for_state(path: Path, query: str, model: str | None, rules_path: Path,
                      min_hit_gain: float, json_out: bool) -> None:
    from kite.cli._progress import progress_bar
    from kite.upcycle import StateFile
    from kite.yoco.fused import plan_for, state_info
    from kite.yoco.health import HealthStore
    from kite.yoco.watermark import WatermarkSampler, default_backend

    # The state (file, magic, header) and the rules checked against its labels and layers come
    # before the model loads.
    with StateFile(path) as st, HealthStore() as health:
        info = state_info(st, health)
        ruleset = _load(rules_path, info.labels, info.n_layers)
        with progress_bar() as progress:
            lm, tagger = _model_and_tagger(model, progress)
        sampler = WatermarkSampler(default_backend())
        try:
            reading = sampler.sample_once()
        finally:
            sampler.close()
        signals, plan, q, info = plan_for(lm, tagger, ruleset, st, query, health=health,
                                          watermark=reading.watermark, min_hit_gain=min_hit_gain)
    if not json_out:
        _print_decision(ruleset, signals, plan, min_hit_gain)
        return
    emit_json({"state": str(path), "state_id": info.state_id, "query": query, "query_tokens": q.tokens,
               "label_probs": q.label_probs, "watermark_source": reading.source, "rules": ruleset.info(),
               "signals": signals.flat(), "state_labels": info.health, "n_layers": info.n_layers,
               "min_hit_gain": min_hit_gain, "matched_rule": plan.matched_rule, "plan": plan.to_dict()})


@app.command("analyze")
def analyze_cmd(
    queries: Annotated[Path, typer.Option("--queries", help="Traffic JSONL: one {\"query\": ...} a line "
                                          "(other fields kept; `family` groups the coverage).")],
    model: Annotated[Optional[str], ModelOpt] = None,
    rules: Optional[Path] = RulesOpt,
    labels: Annotated[Optional[str], typer.Option("--labels", help="Cluster labels the rules may name, "
                                                  "comma-separated (default: the tagger's).")] = None,
    assume: Annotated[Optional[str], typer.Option("--assume", help="The non-query signals coverage "
                                                  "assumes, JSON or @file (default: prior health, idle "
                                                  "hardware), e.g. '{\"hardware_watermark.gpu_mem\": 0.9}'.")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG histogram of intent "
                                                 "entropy with the rules' thresholds.")] = None,
    mkdir: bool = MkdirOpt,
    fast: Annotated[bool, typer.Option("--fast", help="bf16 matmuls: ~1.7x faster on AVX512-BF16 CPUs; "
                                       "entropies move by up to ~0.09 bits, ~0.01 on average "
                                       "(docs/rules-dsl.md).")] = False,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Queries per forward.")] = 64,
    threads: Annotated[Optional[int], typer.Option("--threads", min=1, help="torch threads (default: "
                                                   "1 when the load average is at least the core "
                                                   "count, else torch's).")] = None,
    json_out: bool = JsonOpt,
) -> None:
    """Intent-entropy distribution, query labels, suggested thresholds and rule coverage of a
    traffic sample (one batched entropy pass over every query).

    Example: kite data traffic --n 2000 --out traffic.jsonl && kite yoco analyze --queries traffic.jsonl --plot h.png
    """
    import os
    import sys
    import time

    if "torch" not in sys.modules:  # read once, when torch loads
        # OpenMP threads that sleep while they wait: on a shared machine spinning ones take the
        # time slices the working ones need (3-4x slower, benchmarks/yoco_analyze.py).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from kite.atomic import check_output
    from kite.cli._progress import progress_bar
    from kite.data.jsonl import read_jsonl
    from kite.yoco.analyze import analyze, neutral_signals, plot_entropy

    if plot is not None:
        check_output(plot, mkdir, "--plot")
    from kite.yoco.intent import query_signals
    from kite.yoco.signals import Signals

    model = model_spec(model)
    records = read_jsonl(queries)
    for rec in records:
        if not isinstance(rec.get("query"), str):
            raise BadInput(f"{queries}:{rec['_line']}: expected a \"query\" string")
    base = neutral_signals()
    if assume is not None:
        assumed = _read_signals(assume, "--assume")
        given = Signals.from_mapping(assumed, where="--assume")
        own = [k for k in assumed if k in ("intent_entropy", "query_label", "label_entropy", "query_novelty")]
        if own:
            raise BadInput(f"--assume: {own[0]} is the query's own signal (measured, not assumed)")
        given.state_health_score = (given.state_health_score if given.state_health_score is not None
                                    else base.state_health_score)
        base = given
    import torch

    cores = os.cpu_count() or 1
    if threads is None and os.getloadavg()[0] >= cores:
        # Other jobs already fill the cores: a second thread would wait on the one that shares
        # its core at every op (measured 1.7-2.8x slower than one thread, docs/rules-dsl.md).
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    texts = [rec["query"] for rec in records]
    with progress_bar() as progress:
        lm, tagger = _model_and_tagger(model, progress)
        names = [s.strip() for s in labels.split(",") if s.strip()] if labels is not None else (
            list(tagger.labels) if tagger is not None else None)
        ruleset = _load(rules_file(rules), names, lm.geometry.n_layers)
        t0 = time.perf_counter()
        sigs = query_signals(lm, texts, tagger, batch_size=batch_size, precision="bf16" if fast else "fp32",
                             progress=lambda d, t: progress("entropy", d, t))
        pass_s = time.perf_counter() - t0
    groups = [rec.get("family") for rec in records] if any("family" in rec for rec in records) else None
    report = analyze(sigs, ruleset, queries=texts, base=base, groups=groups)
    report["source"] = {"queries": str(queries), "model": lm.source.spec, "precision": "bf16" if fast else "fp32",
                        "tagger": None if tagger is None else tagger.method,
                        "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    report["timing"] = {"entropy_pass_s": pass_s, "queries_per_s": len(sigs) / pass_s if pass_s else None,
                        "distinct_per_s": report["distinct_queries"] / pass_s if pass_s else None,
                        "tokens_per_s": report["tokens"]["total"] / pass_s if pass_s else None,
                        "load_avg_1m": os.getloadavg()[0]}
    if plot is not None:
        plot_entropy(report, plot, title=f"Intent entropy: {queries.name} ({len(sigs)} queries)")
        report["plot"] = str(plot)
    if json_out:
        emit_json(report)
        return
    _print_analysis(report)


def _print_analysis(report: dict) -> None:
    import math

    from rich.markup import escape
    from rich.table import Table

    out = console()
    d = report["intent_entropy"]
    src = report["source"]
    out.print(f"[bold]{report['queries']}[/] queries, {report['tokens']['mean']:.1f} tokens each "
              f"({src['model']}, {src['precision']}, {src['threads']} threads)", highlight=False)
    t = report["timing"]
    out.print(f"  entropy pass {t['entropy_pass_s']:.1f} s: {t['queries_per_s']:.1f} queries/s "
              f"({report['distinct_queries']} distinct texts, {t['distinct_per_s']:.1f}/s; load average "
              f"{t['load_avg_1m']:.2f})", highlight=False)
    out.print(f"[bold]intent entropy[/] (bits) mean {d['mean']:.3f}, std {d['std']:.3f}, "
              f"min {d['min']:.3f}, max {d['max']:.3f}", highlight=False)
    out.print("  " + "  ".join(f"{k} {v:.3f}" for k, v in d["quantiles"].items()), highlight=False)
    peak = max(d["histogram"]["counts"]) or 1
    edges = d["histogram"]["edges"]
    width = edges[1] - edges[0]  # enough decimals that neighbouring edges differ
    prec = max(2, 1 - math.floor(math.log10(width))) if width > 0 else 2
    for k, c in enumerate(d["histogram"]["counts"]):
        out.print(f"  {edges[k]:.{prec}f}-{edges[k + 1]:<.{prec}f} {c:>7}  {'█' * round(40 * c / peak)}",
                  highlight=False)
    labels = Table("label", "queries", "share", "mean label entropy", box=None, title="query labels",
                   title_justify="left")
    for row in report["labels"]:
        labels.add_row(escape(row["label"] or "(no label)"), str(row["count"]), f"{100 * row['share']:.1f}%",
                       f"{row['mean_label_entropy']:.3f}")
    out.print(labels)
    cuts = report["cuts"]
    out.print("[bold]suggested intent_entropy cuts[/] (share at or below | above)", highlight=False)
    for c in cuts["quantiles"]:
        out.print(f"  p{round(100 * c['quantile']):<3} {c['value']:7.3f}  {100 * c['below']:5.1f}% | "
                  f"{100 * c['above']:5.1f}%", highlight=False)
    if cuts["otsu"]:
        o = cuts["otsu"]
        out.print(f"  Otsu {o['value']:7.3f}  {100 * o['below']:5.1f}% | {100 * o['above']:5.1f}%  (group means "
                  f"{o['mean_below']:.2f} / {o['mean_above']:.2f}, separation {o['separation']:.2f})",
                  highlight=False)
    for c in cuts["rules"]:
        out.print(f"  rule {escape(c['rule'])}: intent_entropy {c['op']} {c['value']:g}  "
                  f"{100 * c['below']:5.1f}% | {100 * c['above']:5.1f}%", highlight=False)
    if "by_group" in report:
        groups = Table("family", "queries", "mean", "p10", "p50", "p90", box=None,
                       title="intent entropy by family", title_justify="left")
        for g, st in report["by_group"].items():
            groups.add_row(escape(g), str(st["count"]), *(f"{st[k]:.3f}" for k in ("mean", "p10", "p50", "p90")))
        out.print(groups)
    cov = report["coverage"]
    table = Table("rule", "queries", "share", box=None, title=f"coverage ({cov['rules_version']}, assuming "
                  + ", ".join(f"{k}={v}" for k, v in cov["assumed"].items() if v) + ")", title_justify="left")
    for row in cov["rules"]:
        table.add_row(escape(row["rule"]) + (" (default)" if row["default"] else ""), str(row["count"]),
                      f"{100 * row['share']:.1f}%")
    out.print(table)
    if cov["unmatched_rules"]:
        out.print(f"[yellow]never hit[/]: {escape(', '.join(cov['unmatched_rules']))}", highlight=False)
    if "plot" in report:
        out.print(f"wrote {report['plot']}", highlight=False)


# -- talking to a running `kite serve` ---------------------------------------------------------

ServerOpt = typer.Option(None, "--server", help="The server's URL (default: http://server.host:server.port "
                         "from the config).")
TokenOpt = typer.Option(None, "--token", help="Admin token (default: config server.admin_token or "
                        "KITE_ADMIN_TOKEN).")


def _admin(server: str | None, token: str | None):
    from kite.serve.client import AdminClient, default_server_url

    cfg = user_config() if server is None or token is None else None
    return AdminClient(server or default_server_url(cfg), token or (cfg.server.admin_token if cfg else None))


def _rules_call(call, json_out: bool) -> dict:
    """Run one admin call; a refused rule set prints its full report (or JSON) before the error line."""
    from kite.serve.client import RulesRejected

    try:
        return call()
    except RulesRejected as exc:
        if json_out:
            emit_json({"ok": False, "error": str(exc), "errors": exc.errors, "report": exc.report})
        else:
            err_console().print(exc.report, markup=False, highlight=False, soft_wrap=True)
        raise


def _print_active(verb: str, info: dict) -> None:
    import datetime as dt

    when = dt.datetime.fromtimestamp(info["loaded_at"], dt.timezone.utc).isoformat(timespec="seconds")
    console().print(f"[green]{verb}[/] rules {info['version']} ({info['rules']} rules, sha256 "
                    f"{info['sha256'][:12]}) from {info['source']}, loaded {when}", highlight=False,
                    soft_wrap=True)


@app.command("reload-rules")
def reload_rules(
    file: Annotated[Optional[str], typer.Argument(help="A rule file inside the server's rules folder "
                                                  "(default: the active file, re-read).")] = None,
    server: Optional[str] = ServerOpt,
    token: Optional[str] = TokenOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Ask the running server to recompile its rules (or FILE) and swap them in. A bad file is
    refused with all its errors and the old set keeps serving (exit 2).

    Example: kite yoco reload-rules rules/yoco_rules.yaml --server http://127.0.0.1:8088
    """
    path = file
    if file is not None and Path(file).exists():
        path = str(Path(file).resolve())  # the server runs here too: name the same file
    info = _rules_call(lambda: _admin(server, token).reload(path), json_out)
    if json_out:
        emit_json(info)
        return
    _print_active("reloaded", info)


@app.command("switch-rules")
def switch_rules(
    version: Annotated[str, typer.Argument(help="A version: v2 → yoco_rules_v2.yaml (v1 → yoco_rules.yaml).")],
    server: Optional[str] = ServerOpt,
    token: Optional[str] = TokenOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Switch the running server to another versioned rule set, atomically.

    Example: kite yoco switch-rules v2
    """
    info = _rules_call(lambda: _admin(server, token).switch(version), json_out)
    if json_out:
        emit_json(info)
        return
    _print_active("switched to", info)


@app.command("rules-status")
def rules_status(
    server: Optional[str] = ServerOpt,
    token: Optional[str] = TokenOpt,
    json_out: bool = JsonOpt,
) -> None:
    """The running server's active rule set (version, sha256, when it loaded) and the last reload error."""
    info = _admin(server, token).status()
    if json_out:
        emit_json(info)
        return
    _print_active("active", info)
    err = info.get("last_error")
    if err:
        import datetime as dt

        when = dt.datetime.fromtimestamp(err["when"], dt.timezone.utc).isoformat(timespec="seconds")
        console().print(f"[yellow]last error[/] {when} ({err['source']}):", highlight=False, soft_wrap=True)
        console().print(err["message"], markup=False, highlight=False, soft_wrap=True)
