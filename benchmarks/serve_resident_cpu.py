"""`server.resident` on the CPU, every registered resident form: what the prefix cache's loads hold
and how a batch step after them runs (a form held beside the rows through its torch reference).

A document is compressed at ratio 4 twice (the ratio codecs' joint-head bases, and per-head bases);
each state is loaded as `kite serve` loads it (``resident_form(name).load``, kite.upcycle.RESIDENT_FORMS),
then ``--rows`` rows after the same loaded state decode ``--steps`` greedy tokens together in a
BatchDecoder: the step's median and minimum, the bytes each form holds, and whether the first row's
greedy text and prompt NLL agree with raw's. Rows: per bases and form the step (median of the --steps steps)
and the bytes held, raw's the baseline; a step's floor is the larger of the weights + the form's bytes
held read once at this CPU's measured memory bandwidth and 2 x parameters x rows FLOPs at its measured
fp32 rate (harness.floors.cpu_forward_floor).

    OMP_NUM_THREADS=2 PYTHONPATH=. .venv/bin/python benchmarks/serve_resident_cpu.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, finish, parse, parser, time_ms  # noqa: E402
from harness.floors import cpu_forward_floor  # noqa: E402


def _steps(lm, prefix, prompt, rows: int, steps: int):
    from kite.runtime.batch_decode import BatchDecoder

    dec = BatchDecoder(lm, max_rows=rows)
    handles = [dec.add(prompt, prefix=prefix, max_new_tokens=steps + 1, stop_ids=set()) for _ in range(rows)]
    results = dec.step()   # the prompts' prefill (not timed)
    t = time_ms(lambda: results.update(dec.step()), repeat=steps, warmup=0)
    return results[handles[0]], t


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--copies", type=int, default=6, help="copies of the tests' contract text in the document")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    args = parse(ap, argv)
    from kite.model import load_cached
    from kite.upcycle import RESIDENT_FORMS, CompressSettings, StateFile, codec, compress_document, resident_form
    from kite.testing.corpus import CORPUS

    lm = load_cached(args.model)
    prompt = lm.tokenizer(" What does the contract say about payment?", add_special_tokens=False)["input_ids"]
    doc = "\n\n".join([CORPUS] * args.copies)
    rows = []
    res = Result("serve_resident_cpu", device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in (("joint heads", codec.settings_for(4)), ("per head", codec.settings_for(4, joint_heads=False))):
            path = Path(tmp) / "state.upc"
            compress_document(lm, doc, path, CompressSettings(codec=spec, n_clusters=3), device="cpu")
            with StateFile(path) as state:
                loads = {form: resident_form(form).load(state, lm) for form in RESIDENT_FORMS}
            row = {"bases": name, "state_tokens": loads["raw"][1].tokens, "rows": args.rows}
            gens = {}
            for form, (prefix, report) in loads.items():
                gens[form], t = _steps(lm, prefix, prompt, args.rows, args.steps)
                row[f"{form}_step"] = t.to_dict()
                row[f"{form}_bytes"] = report.resident_bytes
                row[f"{form}_load_ms"] = report.load_ms
                first = form == "raw"
                floor, floor_ms = cpu_forward_floor(lm, args.rows, kv_bytes=report.resident_bytes,
                                                    what=f"a step of {args.rows} rows after the {form} state")
                res.timing(f"{name}, {form}: decode step of {args.rows} rows", t,
                           baseline=None if first else f"{name}, raw: decode step of {args.rows} rows",
                           floor=floor, floor_value=floor_ms)
                res.row(f"{name}, {form}: bytes held", report.resident_bytes, "B",
                        baseline=None if first else f"{name}, raw: bytes held", load_ms=report.load_ms)
            for form in gens.keys() - {"raw"}:
                row[f"{form}_same_text"] = gens["raw"].text == gens[form].text
                row[f"{form}_prompt_nll_diff_bits"] = abs(gens["raw"].prompt_nll_bits - gens[form].prompt_nll_bits)
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    res.raw.update(model=args.model, threads=torch.get_num_threads(), rows=rows)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
