"""`kite demo`: the demo's questions asked from a contract's state, each answer beside the contract's fact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kite.cli._common import JsonOpt, console, emit_json, model_spec


def demo(
    contract: Annotated[Path, typer.Option("--contract", help="The contracts file (`kite data contracts` output) "
                                           "the state's document comes from.")],
    state: Annotated[Path, typer.Option("--state", help="The .upc state of one of those contracts "
                                        "(`kite upcycle compress`).")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="The model the state was made with "
                                              "(default: config model.default).")] = None,
    json_out: bool = JsonOpt,
) -> None:
    """Ask the demo's questions from a contract's state (no document prefill) and check each answer
    against the fact the contract states. Exit 1 when an answer disagrees, 2 on bad input.

    An answer agrees when the fact, normalized (lower case, no punctuation or articles), occurs as
    whole words in the answer's first sentence.

    Example (what `make demo` runs):
      kite data contracts --n 1 --tokens 2000 --seed 7 --out contract.jsonl
      kite upcycle compress --input contract.txt --output contract.upc
      kite demo --contract contract.jsonl --state contract.upc
    """
    from kite.bench.demo import QUESTIONS, answer_question, read_contract_and_state

    record, upc = read_contract_and_state(contract, state)   # bad files fail before the model loads
    model = model_spec(model)
    from kite.model import load_model

    lm = load_model(model)
    answers = []
    with upc:
        for q in QUESTIONS:
            a = answer_question(lm, upc, record, q)
            answers.append(a)
            if not json_out:
                _print_answer(a, q.source)
    right = sum(a.agrees for a in answers)
    if json_out:
        emit_json({"contract": record.get("id"), "state": str(state), "model": lm.source.spec,
                   "answers": [a.to_dict() for a in answers], "agree": right, "total": len(answers)})
    else:
        colour = "green" if right == len(answers) else "red"
        console().print(f"\n[bold {colour}]{right} of {len(answers)} answers agree with the contract[/]",
                        highlight=False)
    if right < len(answers):
        raise typer.Exit(1)


def _print_answer(a, source: str) -> None:
    from rich.markup import escape

    out = console()
    verdict = "[green]agrees[/]" if a.agrees else "[bold red]DISAGREES[/]"
    out.print(f"\n[bold]{escape(a.question)}[/] [dim](from {escape(source)}: {a.tokens_loaded:,} tokens, "
              f"load {a.load_ms:.0f} ms, answer {a.generate_ms:.0f} ms)[/]", highlight=False)
    out.print(f"  asked as  {escape(a.prompt)} …", highlight=False)
    out.print(f"  answer    {escape(a.answer)}", highlight=False)
    out.print(f"  contract  {escape(a.fact)}", highlight=False)
    out.print(f"  {verdict}", highlight=False)
