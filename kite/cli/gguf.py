"""`kite gguf`: ship states inside a GGUF model file; list and extract them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kite.cli._common import JsonOpt, MkdirOpt, console, emit_json, new_app
from kite.errors import BadInput

app = new_app("Embed .upc states in a GGUF model file; list and extract them.")

GgufArg = typer.Argument(help="A GGUF file (or an embedded model's name, smollm2-135m).")


def parse_state_args(specs: list[str]) -> list[tuple[str, Path]]:
    """`STATE.upc` (its id: the file's stem) or `ID=STATE.upc` → (id, path); a value that names an
    existing file is a path even if it holds '='."""
    out = []
    for spec in specs:
        sid, eq, rest = spec.partition("=")
        if eq and not Path(spec).exists():
            if not sid or not rest:
                raise BadInput(f"{spec!r}: expected STATE.upc or ID=STATE.upc")
            out.append((sid, Path(rest)))
        else:
            out.append((Path(spec).stem, Path(spec)))
    return out


@app.command("embed")
def embed(
    model: Annotated[str, GgufArg],
    states: Annotated[list[str], typer.Argument(help="The .upc states to embed: STATE.upc (id: the file's stem) or "
                                                "ID=STATE.upc.", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="The GGUF file to write (may be MODEL itself).")],
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Copy MODEL (tensors and metadata) to --output with each state added under `kite.upc.<id>`.

    Only states made with MODEL are taken: their fingerprints must be the one `kite model info --model
    MODEL` prints. `kite generate --model OUT.gguf --upc ID` and `kite serve --model OUT.gguf` then offer
    them by id.

    Example: kite gguf embed model.gguf contract.upc nda=nda-v2.upc -o model+states.gguf
    """
    from kite.atomic import check_output
    from kite.cli._common import kept_on_interrupt
    from kite.cli._progress import say

    pairs = parse_state_args(states)
    check_output(output, mkdir, "--output")
    from kite.store import embed_states

    with kept_on_interrupt(f"nothing written to {output} (the file is written whole, then renamed into place)"):
        report = embed_states(model, pairs, output, progress=say)
    if json_out:
        emit_json(report.to_dict())
        return
    out = console()
    grown = report.output_bytes - report.model_bytes
    out.print(f"[bold green]wrote[/] {output}: {report.model.name} ({report.model_bytes:,} B) + "
              f"{len(report.added)} state{'s' if len(report.added) != 1 else ''} = {report.output_bytes:,} B "
              f"(+{grown:,} B); model {report.model_fingerprint.removeprefix('kite-fp1:')[:12]}", highlight=False)
    for s in report.added:
        out.print(f"  {s.id:<24} {s.meta['tokens']:>7,} tokens  {s.upc_bytes:>12,} B .upc → {s.stored_bytes:>12,} B "
                  f"in the file  {', '.join(s.meta['labels'])}", highlight=False)
    if report.kept:
        out.print(f"  kept the {len(report.kept)} state{'s' if len(report.kept) != 1 else ''} {report.model.name} "
                  f"already embedded: {', '.join(report.kept)}", highlight=False)


@app.command("list")
def list_states(
    file: Annotated[str, GgufArg],
    json_out: bool = JsonOpt,
) -> None:
    """The states a GGUF file embeds: id, tokens, clusters, labels, sizes, fingerprint."""
    from kite.store import embedded_states, gguf_file

    path = gguf_file(file)
    states = embedded_states(path)
    if json_out:
        emit_json({"file": str(path), "bytes": path.stat().st_size, "states": [s.to_dict() for s in states]})
        return
    out = console()
    if not states:
        out.print(f"{path.name}: no embedded states (`kite gguf embed` adds them)", highlight=False)
        return
    from rich.table import Table

    table = Table(title=f"{path.name}: {len(states)} embedded state{'s' if len(states) != 1 else ''}",
                  title_justify="left")
    for col, right in (("id", False), ("tokens", True), ("clusters", True), ("labels", False), (".upc bytes", True),
                       ("in file", True), ("fingerprint", False), ("source", False)):
        table.add_column(col, justify="right" if right else "left")
    for s in states:
        m = s.meta
        table.add_row(s.id, f"{m['tokens']:,}", str(m["clusters"]), ", ".join(m["labels"]), f"{s.upc_bytes:,}",
                      f"{s.stored_bytes:,}", (m.get("fingerprint") or "-").removeprefix("kite-fp1:")[:12],
                      m.get("source") or "-")
    out.print(table)


@app.command("extract")
def extract(
    file: Annotated[str, GgufArg],
    state: Annotated[str, typer.Option("--state", "-s", help="The id of the embedded state (`kite gguf list`).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the .upc state.")],
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Write an embedded state back to a .upc file, byte for byte as it was embedded.

    Example: kite gguf extract model+states.gguf --state contract -o contract.upc
    """
    from kite.atomic import check_output
    from kite.store import extract_state, gguf_file

    check_output(output, mkdir, "--output")
    embedded = extract_state(gguf_file(file), state, output)
    if json_out:
        emit_json({"output": str(output), **embedded.to_dict()})
        return
    console().print(f"[bold green]wrote[/] {output}: state {embedded.id}, {embedded.upc_bytes:,} B, "
                    f"{embedded.meta['tokens']:,} tokens (sha256 {embedded.sha256[:16]}…)", highlight=False)
