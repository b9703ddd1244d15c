"""`kite data`: synthetic contracts with ground truth (the bench cases)."""

from __future__ import annotations

import hashlib
import sys
from collections import Counter
from typing import Annotated, Optional

import typer

from kite.cli._common import JsonOpt, MkdirOpt, console, emit_json, new_app
from kite.errors import BadInput

app = new_app("Synthetic contracts and benchmark cases.")


@app.callback()
def _group() -> None:
    """Synthetic contracts and benchmark cases (deterministic, with ground truth)."""


@app.command(
    "contracts",
    help="Generate deterministic synthetic contracts (JSONL bench cases, docs/bench-cases.md).\n\n"
    "Example: [cyan]kite data contracts --n 20 --tokens 2000 --seed 0 --out cases.jsonl[/]",
)
def contracts(
    n: Annotated[int, typer.Option("--n", help="Number of contracts.")] = 10,
    tokens: Annotated[int, typer.Option("--tokens", help="Target length of each contract, in "
                                        "tokens (words x 1.45 estimate).")] = 2000,
    seed: Annotated[int, typer.Option("--seed", help="Same seed, byte-identical output.")] = 0,
    out: Annotated[str, typer.Option("--out", help="Output JSONL file; '-' for stdout.")] = "-",
    model: Annotated[Optional[str], typer.Option(
        "--model", help="Count tokens exactly with this model's tokenizer (HF folder, .gguf or "
        "embedded name) instead of estimating.")] = None,
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    from kite.data.contracts import generate_contracts, to_jsonl

    _check_out(n, "contract", out, json_out, mkdir, "cases")
    count_tokens = _token_counter(model) if model else None
    records = generate_contracts(n, tokens, seed, count_tokens=count_tokens)
    data = to_jsonl(records)
    _write(out, data)
    families = Counter(q["family"] for r in records for q in r["questions"])
    labels = Counter(s["label"] for r in records for s in r["spans"])
    toks = [r["tokens"] for r in records]
    summary = {
        "out": out, "contracts": n, "seed": seed, "tokens_target": tokens,
        "tokens_min": min(toks), "tokens_mean": round(sum(toks) / len(toks), 1),
        "tokens_max": max(toks), "tokens_measured_by": records[0]["tokens_measured_by"],
        "spans": sum(labels.values()), "spans_per_label": dict(sorted(labels.items())),
        "questions": sum(families.values()), "questions_per_family": dict(sorted(families.items())),
        "bytes": len(data.encode("utf-8")),
        "sha256": hashlib.sha256(data.encode("utf-8")).hexdigest(),
    }
    if json_out:
        emit_json(summary)
        return
    if out == "-":
        return  # stdout holds the cases; say nothing else there
    c = console()
    c.print(f"wrote [bold]{n}[/] contracts to {out} ({summary['bytes']:,} bytes, "
            f"sha256 {summary['sha256'][:12]})", highlight=False)
    c.print(f"  tokens     {summary['tokens_min']}-{summary['tokens_max']} "
            f"(mean {summary['tokens_mean']}, target {tokens}, {summary['tokens_measured_by']})",
            highlight=False)
    c.print("  spans      " + ", ".join(f"{k} {v}" for k, v in summary["spans_per_label"].items()),
            highlight=False)
    c.print("  questions  " + ", ".join(f"{k} {v}" for k, v in
                                        summary["questions_per_family"].items()), highlight=False)


@app.command(
    "traffic",
    help="Generate deterministic synthetic query traffic (JSONL, one {\"query\", \"family\", \"label\"} a "
    "line) for `kite yoco analyze`: precise, fuzzy, needle, whole-contract and off-topic queries.\n\n"
    "Example: [cyan]kite data traffic --n 2000 --seed 0 --out traffic.jsonl[/]",
)
def traffic(
    n: Annotated[int, typer.Option("--n", help="Number of queries.")] = 1000,
    seed: Annotated[int, typer.Option("--seed", help="Same seed, byte-identical output.")] = 0,
    out: Annotated[str, typer.Option("--out", help="Output JSONL file; '-' for stdout.")] = "-",
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    from kite.data.traffic import generate_traffic, to_jsonl

    _check_out(n, "query", out, json_out, mkdir, "traffic")
    records = generate_traffic(n, seed)
    data = to_jsonl(records)
    if _write(out, data):
        return
    families = dict(sorted(Counter(r["family"] for r in records).items()))
    summary = {"out": out, "queries": n, "seed": seed, "families": families,
               "bytes": len(data.encode("utf-8")),
               "sha256": hashlib.sha256(data.encode("utf-8")).hexdigest()}
    if json_out:
        emit_json(summary)
        return
    console().print(f"wrote [bold]{n}[/] queries to {out} ({summary['bytes']:,} bytes, sha256 "
                    f"{summary['sha256'][:12]}): " + ", ".join(f"{k} {v}" for k, v in families.items()),
                    highlight=False)


@app.command(
    "pairs",
    help="Generate deterministic training pairs for `kite upcycle train` (JSONL, one {\"context\", \"prompt\", "
    "\"response\"} a line): every question with a one-fact answer of N synthetic contracts.\n\n"
    "Example: [cyan]kite data pairs --n 6 --tokens 2000 --seed 0 --out pairs.jsonl[/]",
)
def pairs(
    n: Annotated[int, typer.Option("--n", help="Number of contracts (about 16 pairs each).")] = 6,
    tokens: Annotated[int, typer.Option("--tokens", help="Target length of each contract, in tokens.")] = 2000,
    seed: Annotated[int, typer.Option("--seed", help="Same seed, byte-identical output.")] = 0,
    out: Annotated[str, typer.Option("--out", help="Output JSONL file; '-' for stdout.")] = "-",
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    from kite.data.contracts import to_jsonl
    from kite.data.pairs import contract_pairs

    _check_out(n, "contract", out, json_out, mkdir, "pairs")
    records = contract_pairs(n, tokens, seed)
    data = to_jsonl(records)
    if _write(out, data):
        return
    families = Counter(r["meta"]["family"] for r in records)
    summary = {"out": out, "contracts": n, "seed": seed, "pairs": len(records),
               "pairs_per_family": dict(sorted(families.items())), "bytes": len(data.encode("utf-8")),
               "sha256": hashlib.sha256(data.encode("utf-8")).hexdigest()}
    if json_out:
        emit_json(summary)
        return
    console().print(f"wrote [bold]{len(records)}[/] pairs of {n} contracts to {out} "
                    f"({', '.join(f'{k} {v}' for k, v in summary['pairs_per_family'].items())})", highlight=False)


def _check_out(n: int, unit: str, out: str, json_out: bool, mkdir: bool, what: str) -> None:
    """The checks every generator runs before it generates: a count, and where the records go."""
    from kite.atomic import check_output

    if n < 1:
        raise BadInput(f"--n {n}: need at least one {unit}")
    if out == "-" and json_out:
        raise BadInput(f"--json with --out -: both would go to stdout; write the {what} to a file")
    if out != "-":
        check_output(out, mkdir, "--out")


def _write(out: str, data: str) -> bool:
    """The records to `out` (atomically) or to stdout for '-'; True when they went to stdout."""
    from kite.atomic import write_text

    if out == "-":
        sys.stdout.write(data)
        sys.stdout.flush()
        return True
    write_text(out, data)
    return False


def _token_counter(spec: str):
    """Tokens of a text under `spec`'s tokenizer (no special tokens)."""
    from transformers import AutoTokenizer

    from kite.model.sources import hf_folder, resolve

    tok = AutoTokenizer.from_pretrained(hf_folder(resolve(spec)))
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])
