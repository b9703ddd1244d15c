"""Memory-budgeted long context on the embedded model: PPL at a fixed KV memory, four ways.

A document at least 4× longer than the budget is scored teacher-forced, ``--chunk`` tokens per
forward (every token after the first is predicted once), with

* **full** -- the plain cache (the reference);
* **budget** -- :class:`kite.upcycle.budget.BudgetCache`: at most ``B`` raw tokens (4 sinks + the
  most recent), older tokens compressed in blocks by the `.upc` codec and still attended to;
* **window** -- dropping at the same bytes (StreamingLLM: 4 sinks + as many recent tokens as the
  budget row's bytes hold at 16 bits), one per budget row;
* **quanto** -- transformers' own ``QuantizedCache`` (optimum-quanto backend, int-N in groups of
  64 with a raw residual of 128 tokens), when optimum-quanto imports
  (``.venv/bin/pip install --no-deps optimum-quanto==0.2.7``: pure torch on the CPU; its other
  requirements are already there). Without it the rows are skipped and the error is reported.

Bytes are what each cache holds at the end of the document, raw tokens counted at 16 bits (the
bf16 / fp16 KV a GPU holds): budget = compressed blocks + the codec's per-layer parts (every
stored byte, headers included) + raw tokens; quanto = packed codes + scales and shifts at 16 bits
+ its raw residual. ``ratio`` = bytes / the raw 16-bit KV of every token. PPL is over the whole
document and, as ``PPL>B``, over the tokens past ``--budget`` (where the methods differ).
``@16K`` projects a budget row's bytes ratio to a 16,384-token sequence from its measured bytes
per compressed token (bytes only; the model's context is 8K, so PPL at 16K is not measured).

    .venv/bin/python benchmarks/kv_budget.py                       # GPL-3, 4,096 tokens, budget 1,024
    kite data contracts --n 1 --tokens 4600 --seed 0 --out /tmp/c.jsonl
    .venv/bin/python benchmarks/kv_budget.py --jsonl /tmp/c.jsonl

Rows: each method's PPL, the full cache's the baseline, its bytes and ratio beside it (quality
figures, no floor); with ``--speed``, each configuration's TTFT, decode step (ms a token) and tokens/s,
the plain cache's the baseline; the TTFT's floor the prompt's forward, the step's the weights + the KV
it holds read once, each the larger of its bytes at this CPU's measured memory bandwidth and its
FLOPs at its measured fp32 rate (harness.floors.cpu_forward_floor).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.runtime.cache import new_cache  # noqa: E402
from kite.runtime.generate import forward_tokens  # noqa: E402
from kite.upcycle import (SINK_TOKENS, BudgetCache, BudgetSettings, WindowCache,  # noqa: E402
                          kv_bytes_per_token)
from harness import Result, clock, finish, parse, parser  # noqa: E402
from harness.floors import cpu_forward_floor  # noqa: E402

GPL3 = "/usr/share/common-licenses/GPL-3"
PROJECT_TOKENS = 16384


def load_document(args, tokenizer) -> tuple[str, list[int]]:
    if args.jsonl:
        with open(args.jsonl, encoding="utf-8") as f:
            rec = json.loads(f.readline())
        name, text = f"{Path(args.jsonl).name} ({rec.get('id', 'record 1')})", rec["text"]
    else:
        name, text = Path(args.text).name, Path(args.text).read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < args.tokens:
        sys.exit(f"{name} has {len(ids)} tokens; --tokens {args.tokens} needs more")
    return name, ids[:args.tokens]


@torch.inference_mode()
def score(model, ids: list[int], cache, chunk: int, after: int) -> dict:
    """Teacher-forced NLL, chunked; PPL over all predicted tokens and over targets at positions > after."""
    nll_all, n_all, nll_after, n_after = 0.0, 0, 0.0, 0
    t0 = clock()
    for s in range(0, len(ids), chunk):
        logits = forward_tokens(model, ids[s:s + chunk], cache, s)
        targets = torch.tensor(ids[s + 1:s + chunk + 1])
        if not len(targets):
            break
        nll = -torch.log_softmax(logits[:len(targets)], -1).gather(1, targets[:, None]).squeeze(1).double()
        pos = torch.arange(s + 1, s + 1 + len(targets))
        nll_all += float(nll.sum())
        n_all += len(targets)
        nll_after += float(nll[pos > after].sum())
        n_after += int((pos > after).sum())
    return {"ppl": math.exp(nll_all / n_all), "ppl_after": math.exp(nll_after / max(n_after, 1)),
            "seconds": clock() - t0}


def quanto_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for q in (layer._quantized_keys, layer._quantized_values):
            if q is None:
                continue
            total += q._data._data.numel() * q._data._data.element_size()   # packed codes
            total += (q._scale.numel() + q._shift.numel()) * 2              # at 16 bits
        if layer.keys is not None and layer.keys.dim() == 4:
            total += (layer.keys.numel() + layer.values.numel()) * 2
    return total


def parse_extra(spec: str, default_block: int) -> tuple[int, str, int]:
    parts = spec.split(":")
    budget, codec = int(parts[0]), parts[1]
    block = int(parts[2]) if len(parts) > 2 else default_block
    return budget, codec, block


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--text", default=GPL3, help="a UTF-8 text file (default GPL-3)")
    ap.add_argument("--jsonl", help="a `kite data contracts` JSONL file: its first contract is the document")
    ap.add_argument("--tokens", type=int, default=4096, help="document tokens (at least 4× --budget)")
    ap.add_argument("--budget", type=int, default=1024, help="raw tokens of the budget rows")
    ap.add_argument("--codecs", nargs="*", default=["ratio=4", "ratio=8", "ratio=12", "ratio=16"],
                    help="budget rows at --budget, one per codec spec")
    ap.add_argument("--extra", nargs="*", default=["512:ratio=6", "512:ratio=8", "256:ratio=8:128", "1024:ratio=8:128",
                                                   "1024:ratio=8:512"],
                    help="more budget rows, BUDGET:CODEC[:BLOCK]")
    ap.add_argument("--block", type=int, default=256, help="tokens per compressed block")
    ap.add_argument("--chunk", type=int, default=128, help="tokens per forward")
    ap.add_argument("--quanto", nargs="*", type=int, default=[4, 2], help="QuantizedCache(quanto) bit widths")
    ap.add_argument("--no-window", action="store_true", help="skip the dropping rows")
    ap.add_argument("--max-ratio", type=float, default=1 / 3, help="the memory target (bytes / raw)")
    ap.add_argument("--max-dppl", type=float, default=0.3, help="the quality target (ΔPPL)")
    ap.add_argument("--speed", type=int, metavar="PROMPT_TOKENS",
                    help="instead: generation speed after a prompt of this many document tokens (32 greedy "
                         "tokens): plain cache vs budget --budget with --codecs[0], with and without keep_decoded")
    ap.add_argument("--threads", type=int, default=1)
    args = parse(ap, argv)
    torch.set_num_threads(args.threads)

    from kite.bench.machine import machine_info
    from kite.model import load_cached

    lm = load_cached("smollm2-135m")
    model = lm.model
    name, ids = load_document(args, lm.tokenizer)
    if args.speed:
        return speed(lm, ids[:args.speed], args)
    configs = [(args.budget, c, args.block) for c in args.codecs]
    configs += [parse_extra(e, args.block) for e in args.extra]
    for budget, _, _ in configs:
        if len(ids) < 4 * budget:
            sys.exit(f"the document ({len(ids)} tokens) must be at least 4× every budget ({budget})")
    bpt = kv_bytes_per_token(model.config, 2)
    raw = len(ids) * bpt
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    rows: list[dict] = []

    def add(row: dict) -> dict:
        row["ratio"] = row["kv_bytes"] / raw
        rows.append(row)
        log(f"  {row['method']:<34} {row['kv_bytes']:>12,} B  {row['ratio']:.3f}  PPL {row['ppl']:.3f}  "
            f"({row['seconds']:.0f} s)")
        return row

    log(f"{name}: {len(ids)} tokens, raw 16-bit KV {raw:,} B; chunk {args.chunk}")
    ref = add({"method": "full cache", "kind": "full", "kv_bytes": raw,
               **score(model, ids, new_cache(model), args.chunk, args.budget)})
    windows_done: set[int] = set()
    for budget, codec, block in configs:
        cache = BudgetCache(model, BudgetSettings(budget_tokens=budget, codec=codec, block_tokens=block))
        r = score(model, ids, cache, args.chunk, args.budget)
        st = cache.stats()
        per_tok = st["compressed_bytes"] / max(st["compressed_tokens"], 1)
        proj = (st["raw_bytes"] + st["codec_bytes"] + per_tok * (PROJECT_TOKENS - st["raw_tokens"])) / (
            PROJECT_TOKENS * bpt)
        add({"method": f"budget {budget} {codec} blk {block}", "kind": "budget", "budget_tokens": budget,
             "codec": codec, "block_tokens": block, "kv_bytes": st["kv_bytes"], **r,
             "ratio_16k_projected": proj, "block_ratio": st["compressed_tokens"] * bpt / max(st["compressed_bytes"], 1),
             "stats": st})
        if not args.no_window:
            window = st["kv_bytes"] // bpt - SINK_TOKENS
            if window not in windows_done:
                windows_done.add(window)
                wc = WindowCache(model, window, SINK_TOKENS)
                r = score(model, ids, wc, args.chunk, args.budget)
                add({"method": f"window {SINK_TOKENS}+{window}", "kind": "window", "window_tokens": window,
                     "kv_bytes": wc.stats()["kv_bytes"], **r, "matches": f"budget {budget} {codec} blk {block}"})
    quanto_error = None
    if args.quanto:
        try:
            from transformers import QuantizedCache

            for bits in args.quanto:
                qc = QuantizedCache(backend="quanto", config=model.config, nbits=bits, q_group_size=64,
                                    residual_length=128)
                r = score(model, ids, qc, args.chunk, args.budget)
                add({"method": f"quanto int{bits} g64 res128", "kind": "quanto", "nbits": bits,
                     "kv_bytes": quanto_bytes(qc), **r})
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            quanto_error = f"{type(exc).__name__}: {exc}"
            log(f"  QuantizedCache(quanto) failed: {quanto_error}")
    for row in rows:
        row["dppl"] = row["ppl"] - ref["ppl"]
        row["dppl_after"] = row["ppl_after"] - ref["ppl_after"]
    fits = [r for r in rows if r["kind"] == "budget" and r["ratio"] <= args.max_ratio]
    best = min(fits, key=lambda r: r["dppl"]) if fits else None
    target = {"max_ratio": args.max_ratio, "max_dppl": args.max_dppl,
              "best_budget_row": best["method"] if best else None,
              "ratio": best["ratio"] if best else None, "dppl": best["dppl"] if best else None,
              "met": bool(best and best["dppl"] <= args.max_dppl)}
    doc = {"document": name, "tokens": len(ids), "chunk": args.chunk, "raw_kv_bytes": raw,
           "bytes_per_token_16bit": bpt, "model": str(lm.source.spec), "rows": rows, "target": target,
           "quanto_error": quanto_error,
           "machine": {**machine_info(lm.device), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}}
    res = Result("kv_budget", device="cpu")
    for r in rows:
        res.row(f"{r['method']}: PPL", r["ppl"], "PPL", baseline=None if r is ref else "full cache: PPL",
                kv_bytes=r["kv_bytes"], ratio=r["ratio"], dppl=r["dppl"], ppl_after=r["ppl_after"])
    res.raw.update(doc)
    out = sys.stderr if args.json else sys.stdout
    print(f"\n{name}, {len(ids)} tokens, chunk {args.chunk}; raw 16-bit KV {raw:,} B; "
          f"PPL>B = the tokens past position {args.budget}\n", file=out)
    print("| method | KV bytes | ratio | @16K | PPL | ΔPPL | PPL>B | ΔPPL>B |", file=out)
    print("|---|---:|---:|---:|---:|---:|---:|---:|", file=out)
    for r in rows:
        proj = f"{r['ratio_16k_projected']:.3f}" if "ratio_16k_projected" in r else ""
        print(f"| {r['method']} | {r['kv_bytes']:,} | {r['ratio']:.3f} | {proj} | {r['ppl']:.3f} | "
              f"{r['dppl']:+.3f} | {r['ppl_after']:.3f} | {r['dppl_after']:+.3f} |", file=out)
    if quanto_error:
        print(f"\nQuantizedCache(quanto): {quanto_error}", file=out)
    if best:
        print(f"\nbest budget row at ≤ {args.max_ratio:.3f} of raw: {best['method']} — ratio {best['ratio']:.3f}, "
              f"ΔPPL {best['dppl']:+.3f} ({'meets' if target['met'] else 'misses'} ≤ +{args.max_dppl})", file=out)
    return finish(res, args)


def speed(lm, ids: list[int], args) -> int:
    from kite.runtime.generate import generate
    from kite.upcycle import budget_cache

    codec = args.codecs[0] if args.codecs else "ratio=8"
    runs = [("plain", None, None), (f"plain, prefill chunks of {args.block}", None, args.block),
            (f"budget {args.budget} {codec}", False, args.block),
            (f"budget {args.budget} {codec} keep_decoded", True, args.block)]
    out = []
    for label, keep, chunk in runs:
        cache = None if keep is None else budget_cache(lm, args.budget, codec, args.block, keep_decoded=keep)
        r = generate(lm, ids, max_new_tokens=32, stop_ids=set(), cache=cache, prefill_chunk=chunk)
        st = cache.stats() if cache is not None else {}
        row = {"config": label, "prompt_tokens": len(ids), "ttft_ms": r.ttft_ms, "tokens_per_s": r.tokens_per_s,
               "kv_bytes": st.get("kv_bytes"), "ratio_to_raw": st.get("ratio_to_raw"),
               "decoded_cache_bytes": st.get("decoded_cache_bytes")}
        out.append(row)
        if not args.json:
            print(f"{label:<40} ttft {r.ttft_ms / 1e3:6.1f} s  {r.tokens_per_s:5.2f} tokens/s  "
                  f"decoded cache {row['decoded_cache_bytes'] or 0:,} B", flush=True)
    res = Result("kv_budget", device="cpu")
    for r in out:
        first = r is out[0]
        prefill = cpu_forward_floor(lm, r["prompt_tokens"], what="the prompt's forward")
        res.row(f"{r['config']}: TTFT", r["ttft_ms"], "ms", baseline=None if first else f"{out[0]['config']}: TTFT",
                prompt_tokens=r["prompt_tokens"], floor=prefill[0], floor_value=prefill[1])
        step = cpu_forward_floor(lm, 1, r["prompt_tokens"], what="a one-row step") if r["kv_bytes"] is None else \
            cpu_forward_floor(lm, 1, kv_bytes=r["kv_bytes"], what="a one-row step over the budgeted KV")
        res.row(f"{r['config']}: decode step", 1e3 / r["tokens_per_s"], "ms",
                baseline=None if first else f"{out[0]['config']}: decode step", floor=step[0], floor_value=step[1])
        res.row(f"{r['config']}: decode", r["tokens_per_s"], "tokens/s",
                baseline=None if first else f"{out[0]['config']}: decode",
                **{k: r[k] for k in ("kv_bytes", "ratio_to_raw", "decoded_cache_bytes")})
    res.raw["speed"] = out
    return finish(res, args, label="speed")


if __name__ == "__main__":
    raise SystemExit(main())
