"""`kite upcycle train`: the regenerator and the reader adapter of a model, from training pairs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kite.cli._common import JsonOpt, MkdirOpt, console, emit_json, model_spec
from kite.errors import BadInput


def train(
    data_path: Annotated[Path, typer.Option("--data-path", help="Training pairs, JSONL: {context, prompt, response} "
                                            "(or {prompt, response} with the document before a blank line); "
                                            "`kite data pairs` makes some.")],
    output_dir: Annotated[Path, typer.Option("--output-dir", help="Where the run goes: regenerator/, adapter/, "
                                             "states/, checkpoints/, train_report.json, loss.png.")],
    model_path: Annotated[Optional[str], typer.Option("--model-path", "--model", "-m",
                                                      help="HF folder, .gguf file or embedded name "
                                                      "(default: config model.default).")] = None,
    config: Annotated[Optional[Path], typer.Option(help="upcycle_config.yaml (adapter.* for --mode custom; "
                                                   "default configs/upcycle_config.yaml).")] = None,
    mode: Annotated[str, typer.Option(help="auto: LoRA shape chosen from the model and the data (the report says "
                                      "which and why); custom: upcycle_config's adapter.*.")] = "auto",
    seed: Annotated[int, typer.Option(help="Seed of the held-out split, the data order and dropout.")] = 0,
    ratio: Annotated[Optional[list[float]], typer.Option(
        "--ratio", help="Training ratio (repeatable): states at this ratio are what the adapter learns to "
        "read (default 8).")] = None,
    eval_fraction: Annotated[float, typer.Option(help="Share of the documents held out (never trained on) for "
                                                 "the report.")] = 0.1,
    epochs: Annotated[int, typer.Option(min=1, help="Passes over the training pairs.")] = 2,
    checkpoint_every: Annotated[int, typer.Option(min=1, help="Steps between checkpoints (--resume continues "
                                                  "from the newest).")] = 25,
    pairs_per_step: Annotated[int, typer.Option(min=1, help="Pairs in one step of the adapter (one batched forward "
                                                "and backward, their mean loss); 1: a step per pair.")] = 1,
    resume: Annotated[bool, typer.Option(help="Continue the run in --output-dir from its newest checkpoint.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Start over in an --output-dir that holds a run.")] = False,
    regenerator_only: Annotated[bool, typer.Option(help="Fit the regenerator only (no adapter).")] = False,
    regenerator: Annotated[Optional[Path], typer.Option(
        help="A regenerator folder of this model to code the training states with, instead of fitting one: the "
        "adapter learns to read the states it will be used with.")] = None,
    layer_group: Annotated[Optional[str], typer.Option(
        help="Layers one calibrated basis spans (their keys, or values, coded together; a divisor of the "
        "model's layers, e.g. all of them for one basis over the whole state; 1: a basis per layer). Bases across "
        "layers weigh each layer's features by what attention feels of them and each layer by the layer weights. "
        "auto: the groupings measured, widest first until one is no better, on training documents the first "
        "calibration leaves out (KL of their continuations at the training ratios) and the best kept (the default "
        "when no --regenerator is given).")] = None,
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Fit the regenerator (calibrated per-model bases) and train the reader adapter (a LoRA distilled from
    the full-context model) on training pairs; report on held-out documents.

    Example: kite data pairs --n 6 --out pairs.jsonl && kite upcycle train --data-path pairs.jsonl --output-dir runs/smol
    """
    from kite.atomic import check_output_folder
    from kite.cli._progress import progress_bar
    from kite.upcycle import TrainRequest, load_upcycle_config, read_pairs, train_upcycle

    if resume and overwrite:
        raise BadInput("--resume --overwrite: use one of them")
    # a whole number or "auto"; anything else TrainRequest.check refuses, naming the flag
    if layer_group is None:
        group = 1 if regenerator is not None else "auto"
    else:
        group = int(layer_group) if layer_group.strip().lstrip("-").isdigit() else layer_group.strip()
    if regenerator_only and regenerator is not None:
        raise BadInput("--regenerator-only --regenerator: a given regenerator leaves only the adapter to train")
    model = model_spec(model_path)
    check_output_folder(output_dir, mkdir, "--output-dir")
    ucfg = load_upcycle_config(config)
    pairs = read_pairs(data_path)
    req = TrainRequest(data_path=str(data_path), output_dir=output_dir, mode=mode, seed=seed,
                       ratios=[float(r) for r in (ratio or [8.0])], eval_fraction=eval_fraction, epochs=epochs,
                       checkpoint_every=checkpoint_every, pairs_per_step=pairs_per_step,
                       resume=resume, overwrite=overwrite, adapter=not regenerator_only, regenerator=regenerator,
                       layer_group=group)
    req.check(pairs)     # flags and the split, before the model loads
    from kite.model import load_model

    with progress_bar() as progress:
        lm = load_model(model)
        report = train_upcycle(lm, pairs, ucfg[0], req, progress=progress)
    if json_out:
        emit_json(report)
        return
    out = console()
    reg = report["regenerator"]
    out.print(f"[bold green]trained[/] {output_dir}: {report['train_pairs']} pairs of {report['train_documents']} "
              f"documents ({report['held_out_pairs']} held out)", highlight=False)
    spans = reg.get("layer_groups")
    bases = f", one basis per {spans[0][1] - spans[0][0]} layers" if spans else ""
    if reg.get("layer_group_choice"):
        bases = (bases or ", a basis per layer") + f" ({choice_text(reg['layer_group_choice'])})"
    out.print(f"  regenerator {reg['fingerprint'][9:21]}  ({reg['calibration']['tokens']:,} calibration tokens{bases})  "
              f"{reg['folder']}", highlight=False)
    if "adapter" in report:
        s = report["adapter"]["settings"]
        out.print(f"  adapter r {s['r']} on {', '.join(s['target_modules'])}  ({s['chosen_by']})", highlight=False)
        for r, tr in report["training"].items():
            out.print(f"  at {r}x: {report['adapter']['folders'][r]}  {tr['steps']} steps, final loss "
                      f"{tr['final_loss']:.4f}, {tr['tokens_per_s']} response tokens/s", highlight=False)
        for r, h in report["held_out"].items():
            out.print(f"  held out at {r}x: PPL full {h['ppl_full']} · state {h['ppl_state']} · state + adapter "
                      f"{h['ppl_state_adapter']} (gap recovered {h['gap_recovered']}) · F1 {h['f1_state']} → "
                      f"{h['f1_state_adapter']}", highlight=False)
            if h.get("adapter_helps") is False:
                out.print(f"  [yellow]at {r}x the adapter reads held-out states worse than none[/] (PPL gap or answer "
                          f"F1): compress states of this ratio without it (upcycle_config adapter.path unset)",
                          highlight=False)
    out.print("  " + "  ".join(f"{k} {v}" for k, v in report["timings"].items()), highlight=False)
    for name, st in report["stages"].items():
        per = f"  ({st['per_unit_s']:.3f} s per {st['unit']})" if st["count"] else ""
        detail = ("; of it " + ", ".join(f"{k} {v / 1e3:.2f} s" for k, v in st["detail_ms"].items())
                  if st.get("detail_ms") else "")
        out.print(f"    {name:<18} {st['seconds']:9.2f} s  {st['count']:>6} × {st['unit']}{per}{detail}",
                  highlight=False)
    sp = report["speed"]
    per_pair = (f", {sp['seconds_per_pair_epoch']:.3f} s per training pair and epoch"
                if sp["seconds_per_pair_epoch"] is not None else "")
    out.print(f"  speed: {sp['seconds_per_state']} s per state{per_pair}", highlight=False)


def choice_text(choice: dict) -> str:
    """``--layer-group auto``'s measurement in words: each grouping's KL, and those not measured."""
    n = choice["documents"]
    text = f"KL on {n} measured document{'s' * (n != 1)}: " + ", ".join(
        f"{r['layer_group']} layer{'s' * (r['layer_group'] != 1)} {r['kl']:.4f}" for r in choice["candidates"])
    if choice.get("not_measured"):
        last = min(r["layer_group"] for r in choice["candidates"])
        text += f"; {', '.join(map(str, choice['not_measured']))} not measured, {last} being no better"
    return text
