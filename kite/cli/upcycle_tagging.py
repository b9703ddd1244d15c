"""`kite upcycle eval-tagging`: tagging accuracy against the ground truth of contract cases."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from kite.cli._common import JsonOpt, MkdirOpt, console, emit_json, model_spec
from kite.errors import BadInput


def eval_tagging(
    cases: Annotated[Optional[Path], typer.Option(
        "--cases", help="Contract cases JSONL (`kite data contracts`); every span is scored. "
        "Optional with --queries.")] = None,
    queries: Annotated[Optional[Path], typer.Option(
        "--queries", help="Labeled queries JSONL (`kite data traffic`: {\"query\", \"family\", "
        "\"label\"}): score the query side — the query head calibrated on generated questions "
        "of other phrasings, beside the clause head alone — by family.")] = None,
    n_examples_per_label: Annotated[int, typer.Option(
        "--examples-per-label", help="Labeled examples per label, drawn from generated contracts "
        "other than the scored ones.")] = 4,
    examples: Annotated[Optional[Path], typer.Option(
        "--examples", help="Labeled JSONL ({\"text\", \"label\"} a line) instead of generated "
        "examples.")] = None,
    examples_seed: Annotated[Optional[int], typer.Option(
        "--examples-seed", help="Seed of the contracts examples come from (default: the cases' "
        "seed; their ids are excluded).")] = None,
    model: Annotated[Optional[str], typer.Option(
        "--model", help="HF folder, .gguf file or embedded name (default: config model.default).")]
    = None,
    mode: Annotated[str, typer.Option(
        "--mode", help="standalone (each span embedded alone), in-document (pooled from one "
        "prefill of the contract) or both.")] = "both",
    save_tagger: Annotated[Optional[Path], typer.Option(
        "--save-tagger", help="Write the fitted tagger (JSON) here.")] = None,
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Fit the clause tagger on labeled examples and report accuracy per label and confusion.

    Example: [cyan]kite data contracts --n 20 --tokens 1200 --seed 200 --out c.jsonl &&
    kite upcycle eval-tagging --cases c.jsonl --examples-per-label 4[/]

    Queries: [cyan]kite data traffic --n 1000 --seed 0 --out t.jsonl &&
    kite upcycle eval-tagging --queries t.jsonl[/] (examples from seed 1000, as the default
    upcycle config draws them).
    """
    from kite.atomic import check_output
    from kite.data.contracts import labeled_examples
    from kite.data.jsonl import read_cases, read_labeled

    if save_tagger is not None:
        check_output(save_tagger, mkdir, "--save-tagger")
    model = model_spec(model)
    mode_key = mode.replace("-", "_")
    if mode_key not in ("standalone", "in_document", "both"):
        raise BadInput(f"--mode {mode}: expected standalone, in-document or both")
    if n_examples_per_label < 1:
        raise BadInput(f"--examples-per-label {n_examples_per_label}: need at least 1 per label")
    if cases is None and queries is None:
        raise BadInput("give --cases (clause spans to score), --queries (questions), or both")
    records = read_cases(cases) if cases is not None else []
    query_records = _read_queries(queries) if queries is not None else None
    if examples is not None:
        ex = read_labeled(examples)
        source = str(examples)
    else:
        default_seed = int(records[0].get("seed", 0)) if records else 1000
        seed = examples_seed if examples_seed is not None else default_seed
        ex = labeled_examples(seed, n_examples_per_label, exclude_ids=[r["id"] for r in records])
        source = f"generated contracts of seed {seed}" + (
            f", excluding the {len(records)} scored" if records else "")
    labels_in_cases = {s["label"] for r in records for s in r.get("spans", [])}
    missing = sorted(labels_in_cases - {lab for _, lab in ex})
    if missing:
        raise BadInput(f"{cases}: label {missing[0]!r} has no labeled example")

    import torch

    from kite.cli._progress import progress_bar, say, step
    from kite.model import load_model
    from kite.upcycle import ClauseTagger, calibration_set, evaluate_queries, evaluate_tagging

    with progress_bar() as progress, torch.inference_mode():
        with step(progress, "model"):
            loaded = load_model(model, progress=say)
        t0 = time.perf_counter()
        with step(progress, "fit tagger"):
            tagger = ClauseTagger.fit(loaded.model, loaded.tokenizer, ex)
        fit_s = time.perf_counter() - t0
        calib = calibration_set(tagger.labels)
        if calib:
            with step(progress, "fit query head"):
                tagger.fit_queries(loaded.model, loaded.tokenizer, calib)
        query_fit_s = time.perf_counter() - t0 - fit_s
        if records:
            report = evaluate_tagging(loaded.model, loaded.tokenizer, records, ex, tagger=tagger,
                                      mode=mode_key, progress=progress)
        else:
            report = {"labels": tagger.labels, "method": tagger.method,
                      "embedding_layers": tagger.embedding_layers,
                      "temperature": tagger.temperature, "examples": len(ex),
                      "validation": {k: v for k, v in tagger.validation.items() if k != "trials"}}
        if query_records is not None:
            with step(progress, "queries"):
                report["queries"] = evaluate_queries(loaded.model, loaded.tokenizer, tagger,
                                                     query_records)
            report["queries_file"] = str(queries)
    report["fit_s"] = round(fit_s, 2)
    report["query_fit_s"] = round(query_fit_s, 2)
    report["examples_source"] = source
    report["cases_file"] = str(cases) if cases is not None else None
    if save_tagger is not None:
        from kite.atomic import write_text

        write_text(save_tagger, json.dumps(tagger.to_dict()) + "\n")
        report["tagger_file"] = str(save_tagger)
    if json_out:
        emit_json(report)
        return
    _print(report)


def _read_queries(path: Path) -> list[dict]:
    from kite.data.jsonl import read_jsonl
    from kite.data.clauses import LABELS

    out = []
    for rec in read_jsonl(path):
        q, lab = rec.get("query"), rec.get("label")
        if not isinstance(q, str) or not q.strip():
            raise BadInput(f"{path}:{rec['_line']}: expected a non-empty \"query\" string")
        if lab is not None and lab not in LABELS:
            raise BadInput(f"{path}:{rec['_line']}: label {lab!r} is not a clause type "
                           f"({', '.join(LABELS)}) or null")
        out.append({"query": q, "family": rec.get("family", "all"), "label": lab})
    if not out:
        raise BadInput(f"{path}: no queries")
    return out


def _print_queries(out, report: dict) -> None:
    from rich.table import Table

    q = report["queries"]
    fit = q.get("query_head_fit")
    if fit:
        out.print(f"query head: hidden state {fit['layers']}, T={fit['temperature']:.3g}, "
                  f"{fit['queries']} calibration questions of {fit['phrasings']} phrasings; "
                  f"cross-validation (by phrasing) {fit['accuracy']:.1%}; fit "
                  f"{report['query_fit_s']} s", highlight=False)
    heads = [h for h in ("clause_head", "query_head") if h in q]
    table = Table(title=f"query tagging on {report['queries_file']} (accuracy / label entropy "
                        "median, bits / share with no label)")
    table.add_column("family")
    table.add_column("n", justify="right")
    for h in heads:
        table.add_column(h.replace("_", " "), justify="right")
    for fam in q[heads[0]]:
        row = [fam, str(q[heads[0]][fam]["n"])]
        for h in heads:
            st = q[h][fam]
            row.append(f"{st['accuracy']:.1%} / {st['label_entropy_median']:.2f} / "
                       f"{st['no_label']:.0%}")
        table.add_row(*row)
    out.print(table)


def _print(report: dict) -> None:
    from rich.table import Table

    out = console()
    if "queries" in report:
        _print_queries(out, report)
    if report.get("cases_file") is None:
        return
    v = report["validation"]
    cv = f"{v['accuracy']:.1%} over {v['folds']} folds" if v.get("accuracy") is not None \
        else "not validated (1 example of some label)"
    out.print(f"tagger: [bold]{report['method']}[/] on hidden state(s) "
              f"{report['embedding_layers']}, T={report['temperature']:.3g}, "
              f"{report['examples']} examples ({report['examples_source']}); "
              f"cross-validation {cv}; fit {report['fit_s']} s", highlight=False)
    modes = [m for m in ("standalone", "in_document") if m in report]
    table = Table(title=f"clause tagging on {report['cases_file']}")
    table.add_column("label")
    for m in modes:
        table.add_column(f"{m.replace('_', '-')} acc", justify="right")
        table.add_column("n", justify="right")
    for lab in report["labels"]:
        row = [lab]
        for m in modes:
            p = report[m]["per_label"][lab]
            row += ["-" if p["accuracy"] is None else f"{p['accuracy']:.1%}", str(p["n"])]
        table.add_row(*row)
    row = ["[bold]overall[/]"]
    for m in modes:
        row += [f"[bold]{report[m]['accuracy']:.1%}[/]", str(report[m]["n"])]
    table.add_row(*row)
    out.print(table)
    for m in modes:
        out.print(mode_summary(m, report[m]), highlight=False)


def mode_summary(mode: str, r: dict) -> str:
    """One line per tagging mode: how many right, the mean confidence of the right and of the wrong
    answers (`none wrong` / `none right` when there are none), the most confused pairs."""
    errors = [(t, p, n) for t, preds in r["confusion"].items() for p, n in preds.items() if p != t and n]
    errors.sort(key=lambda e: -e[2])
    right, wrong = r["mean_confidence_correct"], r["mean_confidence_wrong"]
    confidence = ", ".join([f"{right} right" if right is not None else "none right",
                            f"{wrong} wrong" if wrong is not None else "none wrong"])
    confused = "; most confused: " + ", ".join(f"{t}→{p} ×{n}" for t, p, n in errors[:3]) if errors else ""
    return (f"{mode.replace('_', '-')}: {r['correct']}/{r['n']} correct in {r['s']} s; mean confidence "
            f"{confidence}{confused}")
