"""What a load restricted to some layers, or held at a lower precision, costs: the data behind the
rule that warns of loads far from what a state was tuned for (kite/upcycle/load/fidelity.py).

A text's first ``--context`` tokens are compressed into a state (default settings and also
``exact``), then the next ``--continuation`` tokens are scored teacher-forced after loads of that
state into every layer, into some layers (the others hold no prefix), and at each load precision.
Rows print PPL over continuation tokens 2..N and its ratio to full-context prefill, next to the
same text with no context at all (the floor a useless load falls to).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/partial_loads.py            # GPL-3, 2,048 + 512
    .venv/bin/python benchmarks/partial_loads.py --input doc.txt --json out/partial_loads.json
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--continuation", type=int, default=512)
    ap.add_argument("--settings", nargs="+", default=["ratio=4", "exact"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="Also write the rows here.")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from kite.model import load_cached
    from kite.runtime.cache import new_cache
    from kite.runtime.generate import forward_tokens
    from kite.upcycle import CompressSettings, codec_settings, compress_document, load_prefix, tokenize_document

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
        cache = new_cache(lm.model)
        forward_tokens(lm.model, ctx, cache, 0)
        logits = forward_tokens(lm.model, cont, cache, len(ctx))[:-1]
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
                t = time.perf_counter()
                with torch.inference_mode():
                    prefix, _ = load_prefix(path, lm, layers=layers)
                    value = ppl(prefix, prefix.next_position)
                rows.append({"state": spec, "load": f"layers {name}", "layers": len(layers or range(L)),
                             "ppl": value, "s": round(time.perf_counter() - t, 1)})
                print(rows[-1], flush=True)
            for precision in ("fp16", "fp8", "int8", "int4"):
                with torch.inference_mode():
                    prefix, _ = load_prefix(path, lm, precision=precision)
                    value = ppl(prefix, prefix.next_position)
                rows.append({"state": spec, "load": f"precision {precision}", "layers": L, "ppl": value})
                print(rows[-1], flush=True)
            with torch.inference_mode():
                prefix, _ = load_prefix(path, lm, layers=[0, 2, 4], precision="int4")
                value = ppl(prefix, prefix.next_position)
            rows.append({"state": spec, "load": "layers 0,2,4 at int4", "layers": 3, "ppl": value})
    print(f"\n{args.input}: {len(ctx)} context + {len(cont)} continuation tokens, {args.model} ({L} layers)")
    print(f"{'state':<9} {'load':<24} {'layers':>6} {'PPL':>8} {'x full':>7} {'x none':>7}")
    for r in rows:
        print(f"{r['state']:<9} {r['load']:<24} {r['layers']:>6} {r['ppl']:>8.3f} {r['ppl'] / full:>7.3f} "
              f"{r['ppl'] / none:>7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "full": full, "none": none, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
