"""`kite data`: synthetic contracts with ground truth (the bench cases), and training pairs."""

from __future__ import annotations

import hashlib
import sys
from collections import Counter
from typing import Annotated, Optional

import typer

from kite.cli._common import JsonOpt, MkdirOpt, console, emit_json, model_spec, new_app
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
    "\"response\"} a line): every question with a one-fact answer of N synthetic contracts, and with --texts "
    "continuation pairs of real documents (a window of a text as the context, the text after it as the "
    "responses).\n\n"
    "Example: [cyan]kite data pairs --n 6 --tokens 2000 --seed 0 --out pairs.jsonl[/]\n\n"
    "Example: [cyan]kite data pairs --n 20 --texts /usr/share/doc --exclude held_out.txt --out pairs.jsonl[/]",
)
def pairs(
    n: Annotated[Optional[int], typer.Option("--n", help="Number of contracts (about 16 pairs each; default 6, "
                                             "0 with --texts).")] = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Target length of each contract, in tokens.")] = 2000,
    seed: Annotated[int, typer.Option("--seed", help="Same seed, byte-identical output.")] = 0,
    texts: Annotated[Optional[list[str]], typer.Option(
        "--texts", help="A text file or a folder of them (recursive; .gz read; not UTF-8: skipped); repeatable.")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option(
        "--exclude", help="A text the pairs must not contain (a document a measurement holds out): a window "
        "with over 1% of its 13-word runs in one is dropped; repeatable.")] = None,
    window_tokens: Annotated[int, typer.Option("--window-tokens", help="With --texts: the context's tokens.")] = 2048,
    pairs_per_window: Annotated[int, typer.Option("--pairs-per-window", help="With --texts: pairs after each "
                                                  "window, one after the other.")] = 4,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="With --texts: each pair's prompt.")] = 8,
    response_tokens: Annotated[int, typer.Option("--response-tokens", help="With --texts: each pair's "
                                                 "response.")] = 120,
    windows_per_text: Annotated[int, typer.Option("--windows-per-text", help="With --texts: at most this many "
                                                  "windows of one text (drawn by --seed).")] = 2,
    max_windows: Annotated[Optional[int], typer.Option("--max-windows", help="With --texts: at most this many "
                                                       "windows in all (drawn by --seed).")] = None,
    model: Annotated[Optional[str], typer.Option(
        "--model", help="The tokenizer that counts tokens (HF folder, .gguf or embedded name; default: the "
        "config's model.default).")] = None,
    out: Annotated[str, typer.Option("--out", help="Output JSONL file; '-' for stdout.")] = "-",
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    from kite.data.contracts import to_jsonl
    from kite.data.pairs import contract_pairs

    n = (0 if texts else 6) if n is None else n
    _check_out(n, "contract", out, json_out, mkdir, "pairs", least=0 if texts else 1)   # with --texts, 0 is fine
    made = None
    if texts:
        from kite.cli._progress import progress_bar
        from kite.data.texts import read_texts, text_pairs

        with progress_bar() as progress:
            docs = read_texts(texts, "--texts", progress)     # the paths checked now, the texts read as used
            held = [text for _, text in read_texts(exclude or [], "--exclude")]
            if exclude and not held:
                raise BadInput(f"--exclude {exclude[0]}: no text read (a file under 2,000 characters, or not UTF-8)")
            tok = _tokenizer(model_spec(model))
            made = text_pairs(docs, lambda t: tok(t, add_special_tokens=False)["input_ids"], tok.decode,
                              window_tokens=window_tokens, pairs_per_window=pairs_per_window,
                              prompt_tokens=prompt_tokens, response_tokens=response_tokens,
                              windows_per_text=windows_per_text, max_windows=max_windows, exclude=held, seed=seed)
        if not made.records:
            raise BadInput(f"--texts: no window of {window_tokens} tokens and its pairs in {made.texts} texts "
                           f"({made.too_short} too short, {made.excluded} windows excluded)")
    records = contract_pairs(n, tokens, seed) if n else []
    records += made.records if made else []
    data = to_jsonl(records)
    if _write(out, data):
        return
    families = Counter(r["meta"]["family"] for r in records)
    summary = {"out": out, "contracts": n, "seed": seed, "pairs": len(records),
               "pairs_per_family": dict(sorted(families.items())), "bytes": len(data.encode("utf-8")),
               "sha256": hashlib.sha256(data.encode("utf-8")).hexdigest()}
    if made:
        summary["texts"] = made.summary()
    if json_out:
        emit_json(summary)
        return
    line = f"wrote [bold]{len(records)}[/] pairs to {out} ("
    line += ", ".join(f"{k} {v}" for k, v in summary["pairs_per_family"].items()) + ")"
    if made:
        t = made.summary()
        line += (f"; texts: {t['windows']} windows of {t['texts']} texts, {t['too_short']} too short, "
                 f"{t['excluded_windows']} windows excluded")
    console().print(line, highlight=False)


def _check_out(n: int, unit: str, out: str, json_out: bool, mkdir: bool, what: str, least: int = 1) -> None:
    """The checks every generator runs before it generates: a count (at least ``least``), and where
    the records go."""
    from kite.atomic import check_output

    if n < least:
        raise BadInput(f"--n {n}: need at least {'one ' + unit if least == 1 else f'{least} {unit}s'}")
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


def _tokenizer(spec: str):
    """`spec`'s tokenizer (HF folder, .gguf or embedded name), without its weights."""
    from transformers import AutoTokenizer

    from kite.model.sources import hf_folder, resolve

    return AutoTokenizer.from_pretrained(hf_folder(resolve(spec)))


def _token_counter(spec: str):
    """Tokens of a text under `spec`'s tokenizer (no special tokens)."""
    tok = _tokenizer(spec)
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])
