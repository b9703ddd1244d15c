"""Batched decoding against one-at-a-time generate() on the embedded model (CPU, fp32).

N prompts of about P tokens each (consecutive windows of a text), greedy, exactly M new tokens
each (no end token stops them), run twice in one process:

* **alone** -- ``generate()`` once per prompt, one after the other;
* **batched** -- one :class:`kite.runtime.batch_decode.BatchDecoder` with N rows: every prompt
  added, the first step prefills them together, the later steps decode all N at once.

Decode tokens/s counts the tokens after each sequence's first (the first comes from the prefill)
over the time after it; end-to-end counts every new token over the whole run, prefill included.
``weights GB/s`` is the model's weight bytes read per decode forward × forwards per second:
decoding one token at a time is bound by reading the weights, and batching reads them once for
N tokens, so it turns toward compute: ``GFLOP/s`` is 2 × parameters × decode tokens/s (the
matmuls; attention left out). ``same text`` checks that both ways gave the same answers. ``--repeat R`` runs the pair R
times, alternating, and keeps each way's fastest run (a shared machine's other load only slows a
run down).

    .venv/bin/python benchmarks/batch_decode_cpu.py                 # 8 × (~100 + 64), GPL-3 text
    .venv/bin/python benchmarks/batch_decode_cpu.py --n 4 --new 32 --threads 1 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.model import load_cached  # noqa: E402
from kite.runtime.batch_decode import BatchDecoder  # noqa: E402
from kite.runtime.generate import generate  # noqa: E402

TEXT = "/usr/share/common-licenses/GPL-3"


def prompts_from(tokenizer, path: str, n: int, tokens: int) -> list[list[int]]:
    ids = tokenizer(Path(path).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    if len(ids) < n * tokens:
        raise SystemExit(f"{path}: {len(ids)} tokens, {n} × {tokens} needed")
    # slightly different lengths, as real requests have
    return [ids[i * tokens:(i + 1) * tokens - (i % 3)] for i in range(n)]


def run_alone(lm, prompts, new_tokens):
    t0 = time.perf_counter()
    results = [generate(lm, p, max_new_tokens=new_tokens, stop_ids=set()) for p in prompts]
    wall = time.perf_counter() - t0
    decode_s = sum((r.total_ms - r.ttft_ms) / 1e3 for r in results)
    return results, wall, decode_s, len(prompts) * (new_tokens - 1)   # forwards: one per token after the first


def run_batched(lm, prompts, new_tokens):
    engine = BatchDecoder(lm, max_rows=len(prompts))
    t0 = time.perf_counter()
    handles = [engine.add(p, max_new_tokens=new_tokens, stop_ids=set()) for p in prompts]
    results = engine.step()          # the prefill: every sequence's first token
    t1 = time.perf_counter()
    results.update(engine.drain())
    t2 = time.perf_counter()
    return [results[h] for h in handles], t2 - t0, t2 - t1, new_tokens - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8, help="sequences")
    ap.add_argument("--prompt-tokens", type=int, default=100, help="about this many tokens per prompt")
    ap.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=1, help="run both ways this many times, keep the fastest")
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_cached("smollm2-135m")
    prompts = prompts_from(lm.tokenizer, args.text, args.n, args.prompt_tokens)
    params = sum(p.numel() for p in lm.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    generate(lm, prompts[0][:8], max_new_tokens=2, stop_ids=set())          # warm up
    alone_runs, batched_runs = [], []
    for _ in range(max(args.repeat, 1)):
        alone_runs.append(run_alone(lm, prompts, args.new))
        batched_runs.append(run_batched(lm, prompts, args.new))
    alone, alone_wall, alone_decode_s, alone_forwards = min(alone_runs, key=lambda r: r[2])
    batched, batch_wall, batch_decode_s, batch_forwards = min(batched_runs, key=lambda r: r[2])
    decode_tokens = args.n * (args.new - 1)
    all_tokens = args.n * args.new
    rows = {
        "alone": {"decode_tok_s": decode_tokens / alone_decode_s, "e2e_tok_s": all_tokens / alone_wall,
                  "wall_s": alone_wall, "weights_gb_s": weight_bytes * alone_forwards / alone_decode_s / 1e9,
                  "gflop_s": 2 * params * decode_tokens / alone_decode_s / 1e9},
        "batched": {"decode_tok_s": decode_tokens / batch_decode_s, "e2e_tok_s": all_tokens / batch_wall,
                    "wall_s": batch_wall, "weights_gb_s": weight_bytes * batch_forwards / batch_decode_s / 1e9,
                    "gflop_s": 2 * params * decode_tokens / batch_decode_s / 1e9},
    }
    out = {"model": "smollm2-135m (fp32, CPU)", "threads": torch.get_num_threads(), "repeat": args.repeat,
           "sequences": args.n,
           "prompt_tokens": [len(p) for p in prompts], "new_tokens": args.new, **rows,
           "decode_ratio": rows["batched"]["decode_tok_s"] / rows["alone"]["decode_tok_s"],
           "e2e_ratio": rows["batched"]["e2e_tok_s"] / rows["alone"]["e2e_tok_s"],
           "same_text": sum(a.text == b.text for a, b in zip(alone, batched))}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{out['model']}, {out['threads']} threads, best of {args.repeat}: {args.n} sequences, prompts of "
          f"{min(out['prompt_tokens'])}-{max(out['prompt_tokens'])} tokens, {args.new} new tokens each")
    print(f"{'':8} {'decode tok/s':>13} {'end-to-end tok/s':>17} {'wall s':>8} {'weights GB/s':>13} "
          f"{'GFLOP/s':>8}")
    for name, r in rows.items():
        print(f"{name:8} {r['decode_tok_s']:13.1f} {r['e2e_tok_s']:17.1f} {r['wall_s']:8.2f} "
              f"{r['weights_gb_s']:13.2f} {r['gflop_s']:8.1f}")
    print(f"batched / alone: decode {out['decode_ratio']:.2f}x, end-to-end {out['e2e_ratio']:.2f}x; "
          f"same text {out['same_text']}/{args.n}")


if __name__ == "__main__":
    main()
