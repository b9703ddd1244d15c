"""`kite upcycle weigh`: measure a model's layer weights (kite.upcycle.codec.LayerWeights)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kite.cli._common import JsonOpt, MkdirOpt, console, emit_json, kept_on_interrupt, model_spec, read_document
from kite.errors import BadInput

# calibration licenses of kite.upcycle.study (never its held-out ones), with a generated contract of
# the calibration seed: what the weights in docs/compression.md were measured on
DEFAULT_LICENSES = ("MPL-2.0", "LGPL-2.1")


def weigh(
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the layer weights (JSON).")],
    input: Annotated[Optional[list[str]], typer.Option(
        "--input", "-i", help="A calibration document (repeatable; never one you will judge the weights on). "
        "Default: MPL-2.0 and LGPL-2.1 (calibration licenses, never held out) and a generated contract "
        "of the calibration seed.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="HF folder, .gguf file or embedded name "
                                                 "(default: config model.default).")] = None,
    ratio: Annotated[float, typer.Option(min=2, help="The ratio the codec's error is measured at.")] = 16.0,
    context_tokens: Annotated[int, typer.Option(min=64, help="Tokens of each document coded.")] = 1536,
    continuation_tokens: Annotated[int, typer.Option(min=16, help="Tokens scored after them.")] = 256,
    alpha: Annotated[Optional[float], typer.Option(min=0.01, max=2.0, help="The measured cost per unit error, to this "
                                                   "power (1: first order; lower: gentler; default 0.75, KITE's).")] = None,
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Measure how much each layer's keys' and values' errors cost the model at --ratio, and write the
    weights the state-wide bit allocation gives them (use with --layer-weights, or layer_weights: in
    upcycle_config.yaml). Each calibration document is coded and decoded, each layer side in turn put
    back exact, the continuation's KL gained per unit of its relative error measured (one forward a
    layer side: minutes on a CPU).

    Example: kite upcycle weigh --output smollm2.weights.json && kite upcycle compress -i doc.txt -o doc.upc --ratio 16 --layer-weights smollm2.weights.json
    """
    from kite.atomic import check_output

    check_output(output, mkdir, "--output")
    texts = dict((name, text) for text, name in (read_document(p) for p in input)) if input else None
    if input and len(texts) != len(input):
        raise BadInput("--input: two calibration documents share a file name")
    model = model_spec(model)
    from kite.cli._progress import progress_bar
    from kite.model import load_model
    from kite.upcycle import measure_layer_weights
    from kite.upcycle.study import LICENSES

    if texts is None:
        from kite.data.contracts import generate_contracts

        texts = {name: (LICENSES / name).read_text() for name in DEFAULT_LICENSES}
        rec = generate_contracts(1, tokens=2700, seed=1000)[0]
        texts[rec["id"]] = rec["text"]
    with kept_on_interrupt(f"nothing written to {output}"), progress_bar() as progress:
        lm = load_model(model)
        weights = measure_layer_weights(lm, texts, ratio, context_tokens=context_tokens,
                                        continuation_tokens=continuation_tokens, progress=progress,
                                        **({} if alpha is None else {"alpha": alpha}))
        weights.save(output)
    if json_out:
        emit_json({"path": str(output), "fingerprint": weights.fingerprint, **weights.to_json()})
        return
    out = console()
    out.print(f"[bold green]wrote[/] {output}: layer weights {weights.fingerprint.removeprefix('kite-fp1:')[:12]} "
              f"of {weights.n_layers} layers, measured at {ratio:g}× on {len(texts)} documents", highlight=False)
    for side, w in (("keys", weights.k), ("values", weights.v)):
        out.print(f"  {side:<6} " + " ".join(f"{x:.2f}" for x in w), highlight=False)
