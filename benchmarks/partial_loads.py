"""What a load restricted to some layers, or held at a lower precision, costs: the data behind the
rule that warns of loads far from what a state was tuned for (kite/upcycle/load/fidelity.py).

A text's first ``--context`` tokens are compressed into a state (default settings and also
``exact``), then the next ``--continuation`` tokens are scored teacher-forced after loads of that
state into every layer, into some layers (the others hold no prefix), and at each load precision.
Rows: PPL over continuation tokens 2..N, full-context prefill's the baseline, next to the same
text with no context at all (what a useless load falls to; ``x_none`` beside each row). Quality
figures: no floor.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/partial_loads.py            # GPL-3, 2,048 + 512
    .venv/bin/python benchmarks/partial_loads.py --input doc.txt
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, clock, finish, parse, parser  # noqa: E402


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--input", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--continuation", type=int, default=512)
    ap.add_argument("--settings", nargs="+", default=["ratio=4", "exact"])
    ap.add_argument("--threads", type=int, default=None)
    args = parse(ap, argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from kite.model import load_cached
    from kite.runtime.cache import new_cache
    from kite.runtime.generate import forward_tokens
    from kite.upcycle import CompressSettings, codec_settings, compress_document, full_logits, load_prefix, tokenize_document

    lm = load_cached(args.model)
    L = lm.geometry.n_layers
    ids, _ = tokenize_document(lm.tokenizer, Path(args.input).read_text())
    if len(ids) < args.context + args.continuation:
        raise SystemExit(f"{args.input}: {len(ids)} tokens, fewer than --context + --continuation")
    ctx, cont = ids[:args.context], ids[args.context:args.context + args.continuation]
    targets = torch.tensor(cont[1:])

    def ppl(prefix=None, start=0) -> float:
        cache = new_cache(lm.model, prefix)
        logits = forward_tokens(lm.model, cont, cache, start)[:-1]
        nll = -torch.log_softmax(logits.float(), -1).gather(1, targets[:, None])
        return math.exp(float(nll.mean()))

    with torch.inference_mode():
        logits = full_logits(lm, ctx, cont)
        full = math.exp(float(-torch.log_softmax(logits.float(), -1).gather(1, targets[:, None]).mean()))
        none = ppl()
    rows = [{"state": "-", "load": "full-context prefill", "layers": L, "ppl": full},
            {"state": "-", "load": "no context", "layers": 0, "ppl": none}]
    half = L // 2
    layer_sets = {
        "all": None,
        "all but the last": list(range(L - 1)),
        "all but the first 2": list(range(2, L)),
        "all but the last 2": list(range(L - 2)),
        "first 3/4": list(range(3 * L // 4)),
        "first half": list(range(half)),
        "last half": list(range(L - half, L)),
        "every other": list(range(0, L, 2)),
        "first third": list(range(L // 3)),
        "0,2,4": [0, 2, 4],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.settings:
            path = Path(tmp) / f"{spec}.upc"
            settings = CompressSettings(codec=codec_settings(spec))
            compress_document(lm, lm.tokenizer.decode(ctx), path, settings, ids=ctx)
            for name, layers in layer_sets.items():
                t = clock()
                with torch.inference_mode():
                    prefix, _ = load_prefix(path, lm, layers=layers)
                    value = ppl(prefix, prefix.next_position)
                rows.append({"state": spec, "load": f"layers {name}", "layers": len(layers or range(L)),
                             "ppl": value, "s": round(clock() - t, 1)})
                print(rows[-1], file=sys.stderr, flush=True)
            for precision in ("fp16", "fp8", "int8", "int4"):
                with torch.inference_mode():
                    prefix, _ = load_prefix(path, lm, precision=precision)
                    value = ppl(prefix, prefix.next_position)
                rows.append({"state": spec, "load": f"precision {precision}", "layers": L, "ppl": value})
                print(rows[-1], file=sys.stderr, flush=True)
            with torch.inference_mode():
                prefix, _ = load_prefix(path, lm, layers=[0, 2, 4], precision="int4")
                value = ppl(prefix, prefix.next_position)
            rows.append({"state": spec, "load": "layers 0,2,4 at int4", "layers": 3, "ppl": value})
    res = Result("partial_loads", device="cpu")
    for r in rows:
        name = f"{r['state']}: {r['load']}" if r["state"] != "-" else r["load"]
        res.row(f"{name}: PPL", r["ppl"], "PPL", baseline=None if r is rows[0] else "full-context prefill: PPL",
                layers=r["layers"], x_none=round(r["ppl"] / none, 4), **({"s": r["s"]} if "s" in r else {}))
    res.raw.update(input=args.input, model=args.model, context=len(ctx), continuation=len(cont), layers=L,
                   full=full, none=none)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
