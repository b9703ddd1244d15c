"""Quality through the coded attention: PPL of a continuation after a state read from its coded form
(``load_coded_prefix`` + the batch engine's coded rows) against the same state rebuilt (``load_prefix``).

A text's first ``--context`` tokens are compressed into a state per setting; the next
``--continuation`` tokens are scored teacher-forced, PPL over tokens 2..N, three ways: the rebuilt
prefix through the plain forward (as benchmarks/partial_loads.py), the rebuilt prefix in a batch
row, and the coded prefix in a batch row (kite.runtime.attention.coded_rows). On the CPU the coded
rows run the torch reference; on a GPU the prompt's forward runs it too (the kernel is decode-only).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/coded_quality.py --json docs/coded_quality_cpu.json
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
    ap.add_argument("--settings", nargs="+", default=["ratio=4", "ratio=8", "per-head"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="Also write the rows here.")
    args = ap.parse_args()

    from kite.model import load_cached, load_model
    from kite.runtime.batch_cache import BatchKVCache
    from kite.runtime.batch_decode import forward_rows
    from kite.runtime.cache import new_cache
    from kite.runtime.generate import forward_tokens
    from kite.upcycle import CompressSettings, codec_settings, compress_document, load_prefix, tokenize_document
    from kite.upcycle.codec import settings_for
    from kite.upcycle.load import load_coded_prefix

    lm = load_cached(args.model) if args.device == "cpu" else load_model(args.model, device=args.device)
    ids, _ = tokenize_document(lm.tokenizer, Path(args.input).read_text())
    ctx, cont = ids[:args.context], ids[args.context:args.context + args.continuation]
    targets = torch.tensor(cont[1:])

    def ppl_of(logits) -> float:
        nll = -torch.log_softmax(logits[:-1].float().cpu(), -1).gather(1, targets[:, None])
        return math.exp(float(nll.mean()))

    def in_batch(prefix) -> float:
        cache = BatchKVCache(lm.model, 1)
        row = cache.take(prefix)
        return ppl_of(forward_rows(lm.model, cache, [row], [cont], [prefix.next_position])[0])

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.settings:
            s = settings_for(4, joint_heads=False) if spec == "per-head" else codec_settings(spec)
            path = Path(tmp) / "s.upc"
            compress_document(lm, lm.tokenizer.decode(ctx), path, CompressSettings(codec=s), ids=ctx)
            with torch.inference_mode():
                rebuilt, _ = load_prefix(path, lm)
                plain = ppl_of(forward_tokens(lm.model, cont, new_cache(lm.model, rebuilt), rebuilt.next_position))
                t0 = time.perf_counter()
                batch_rebuilt = in_batch(rebuilt)
                t1 = time.perf_counter()
                coded = load_coded_prefix(path, lm)
                batch_coded = in_batch(coded)
                t2 = time.perf_counter()
            rows.append({"setting": spec, "ppl_rebuilt_forward": plain, "ppl_rebuilt_batch_row": batch_rebuilt,
                         "ppl_coded_batch_row": batch_coded, "coded_minus_rebuilt": batch_coded - batch_rebuilt,
                         "coded_bytes": coded.nbytes, "s_rebuilt_row": round(t1 - t0, 1),
                         "s_coded_row": round(t2 - t1, 1)})
            print(rows[-1], flush=True)
    print(f"\n{args.input}: {len(ctx)} context + {len(cont)} continuation tokens, {args.model}, {args.device}")
    print(f"{'setting':<9} {'rebuilt fwd':>11} {'rebuilt row':>11} {'coded row':>10} {'diff':>10}")
    for r in rows:
        print(f"{r['setting']:<9} {r['ppl_rebuilt_forward']:>11.4f} {r['ppl_rebuilt_batch_row']:>11.4f} "
              f"{r['ppl_coded_batch_row']:>10.4f} {r['coded_minus_rebuilt']:>10.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
