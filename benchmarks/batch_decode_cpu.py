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
matmuls; attention left out). ``same text`` checks that both ways gave the same answers.
``--repeat R`` runs the pair R times, alternating, and keeps each way's fastest run (a shared
machine's other load only slows a run down). Batched rows have alone's as their baseline (> 1:
faster). Each way's decode step (ms: its decode time over its forwards) has as its floor the larger of
the weights + every row's mean KV read once at this CPU's measured memory bandwidth and 2 x parameters
x rows FLOPs at its measured fp32 rate (harness.floors.cpu_forward_floor).

    .venv/bin/python benchmarks/batch_decode_cpu.py                 # 8 × (~100 + 64), GPL-3 text
    .venv/bin/python benchmarks/batch_decode_cpu.py --n 4 --new 32 --threads 1
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.model import load_cached  # noqa: E402
from kite.runtime.batch_decode import BatchDecoder  # noqa: E402
from kite.runtime.generate import generate  # noqa: E402
from harness import Result, clock, finish, parse, parser  # noqa: E402
from harness.floors import cpu_forward_floor  # noqa: E402

TEXT = "/usr/share/common-licenses/GPL-3"


def prompts_from(tokenizer, path: str, n: int, tokens: int) -> list[list[int]]:
    ids = tokenizer(Path(path).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    if len(ids) < n * tokens:
        raise SystemExit(f"{path}: {len(ids)} tokens, {n} × {tokens} needed")
    # slightly different lengths, as real requests have
    return [ids[i * tokens:(i + 1) * tokens - (i % 3)] for i in range(n)]


def run_alone(lm, prompts, new_tokens):
    t0 = clock()
    results = [generate(lm, p, max_new_tokens=new_tokens, stop_ids=set()) for p in prompts]
    wall = clock() - t0
    decode_s = sum((r.total_ms - r.ttft_ms) / 1e3 for r in results)
    return results, wall, decode_s, len(prompts) * (new_tokens - 1)   # forwards: one per token after the first


def run_batched(lm, prompts, new_tokens):
    engine = BatchDecoder(lm, max_rows=len(prompts))
    t0 = clock()
    handles = [engine.add(p, max_new_tokens=new_tokens, stop_ids=set()) for p in prompts]
    results = engine.step()          # the prefill: every sequence's first token
    t1 = clock()
    results.update(engine.drain())
    t2 = clock()
    return [results[h] for h in handles], t2 - t0, t2 - t1, new_tokens - 1


def main(argv=None) -> int:
    ap = parser(__doc__, timing=True, repeat=1, warmup=1, device="cpu")
    ap.add_argument("--n", type=int, default=8, help="sequences")
    ap.add_argument("--prompt-tokens", type=int, default=100, help="about this many tokens per prompt")
    ap.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--text", default=TEXT)
    args = parse(ap, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_cached("smollm2-135m")
    prompts = prompts_from(lm.tokenizer, args.text, args.n, args.prompt_tokens)
    params = sum(p.numel() for p in lm.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    for _ in range(args.warmup):
        generate(lm, prompts[0][:8], max_new_tokens=2, stop_ids=set())      # warm up
    alone_runs, batched_runs = [], []
    for _ in range(args.repeat):
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
    res = Result("batch_decode_cpu", device="cpu")
    for key, label in (("decode_tok_s", "decode"), ("e2e_tok_s", "end-to-end")):
        res.row(f"{label}, one at a time", rows["alone"][key], "tokens/s")
        res.row(f"{label}, batched ({args.n} rows)", rows["batched"][key], "tokens/s",
                baseline=f"{label}, one at a time")
    mean_kv = [len(p) + args.new / 2 for p in prompts]        # a row's KV over its decode steps, on average
    one = cpu_forward_floor(lm, 1, sum(mean_kv) / len(mean_kv), what="one row's step")
    res.row("decode step, one at a time", alone_decode_s * 1e3 / alone_forwards, "ms", floor=one[0],
            floor_value=one[1])
    many = cpu_forward_floor(lm, args.n, sum(mean_kv), what=f"a step of {args.n} rows")
    res.row(f"decode step, batched ({args.n} rows)", batch_decode_s * 1e3 / batch_forwards, "ms",
            floor=many[0], floor_value=many[1])
    for name, r in rows.items():
        res.row(f"weights read, {name}", r["weights_gb_s"], "GB/s")
    res.raw.update(out)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
