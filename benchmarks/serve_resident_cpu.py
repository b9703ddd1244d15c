"""`server.resident` on the CPU, every registered resident form: what the prefix cache's loads hold
and how a batch step after them runs (a form held beside the rows through its torch reference).

A document is compressed at ratio 4 twice (the ratio codecs' joint-head bases, and per-head bases);
each state is loaded as `kite serve` loads it (``resident_form(name).load``, kite.upcycle.RESIDENT_FORMS),
then ``--rows`` rows after the same loaded state decode ``--steps`` greedy tokens together in a
BatchDecoder: the step's median and minimum, the bytes each form holds, and whether the first row's
greedy text and prompt NLL agree with raw's.

    OMP_NUM_THREADS=2 PYTHONPATH=. .venv/bin/python benchmarks/serve_resident_cpu.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def _steps(lm, prefix, prompt, rows: int, steps: int):
    from kite.runtime.batch_decode import BatchDecoder

    dec = BatchDecoder(lm, max_rows=rows)
    handles = [dec.add(prompt, prefix=prefix, max_new_tokens=steps + 1, stop_ids=set()) for _ in range(rows)]
    results = dec.step()   # the prompts' prefill (not timed)
    took = []
    while dec._active:
        t = time.perf_counter()
        results.update(dec.step())
        took.append(time.perf_counter() - t)
    took.sort()
    return results[handles[0]], {"median_ms": round(took[len(took) // 2] * 1e3, 1), "min_ms": round(took[0] * 1e3, 1),
                                 "steps": len(took)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--copies", type=int, default=6, help="copies of the tests' contract text in the document")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from kite.model import load_cached
    from kite.upcycle import RESIDENT_FORMS, CompressSettings, StateFile, codec, compress_document, resident_form
    from tests.tiny_models import CORPUS

    lm = load_cached(args.model)
    prompt = lm.tokenizer(" What does the contract say about payment?", add_special_tokens=False)["input_ids"]
    doc = "\n\n".join([CORPUS] * args.copies)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in (("joint heads", codec.settings_for(4)), ("per head", codec.settings_for(4, joint_heads=False))):
            path = Path(tmp) / "state.upc"
            compress_document(lm, doc, path, CompressSettings(codec=spec, n_clusters=3), device="cpu")
            with StateFile(path) as state:
                loads = {form: resident_form(form).load(state, lm) for form in RESIDENT_FORMS}
            row = {"bases": name, "state_tokens": loads["raw"][1].tokens, "rows": args.rows}
            gens = {}
            for form, (prefix, report) in loads.items():
                gens[form], row[f"{form}_step"] = _steps(lm, prefix, prompt, args.rows, args.steps)
                row[f"{form}_bytes"] = report.resident_bytes
                row[f"{form}_load_ms"] = report.load_ms
            for form in gens.keys() - {"raw"}:
                row[f"{form}_same_text"] = gens["raw"].text == gens[form].text
                row[f"{form}_prompt_nll_diff_bits"] = abs(gens["raw"].prompt_nll_bits - gens[form].prompt_nll_bits)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        from kite.atomic import write_text

        write_text(args.json, json.dumps({"model": args.model, "threads": torch.get_num_threads(), "rows": rows},
                                         indent=1) + "\n")


if __name__ == "__main__":
    main()
