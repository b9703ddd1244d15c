"""Throughput of `kite yoco analyze`'s entropy pass on the embedded model, variants side by side.

    .venv/bin/python benchmarks/yoco_analyze.py [--n 256] [--repeat 2]

Variants run interleaved (round-robin, `--repeat` rounds) on the same distinct queries of synthetic
traffic (kite.data.traffic), so a shared machine's load drifts over all of them alike:
  before     the pass as first written: full model forward, softmax of the [B, T, V] logits,
             32 queries a batch sorted by characters
  fp32       query_signals: token-length buckets, no KV cache, head on real tokens in chunks
  fp32-1t    the same on one thread (a loaded 2-core machine may favour it)
  bf16       bf16 weights cast once, fp32 between the matmuls (kite.runtime.lowp.bf16_linears):
             `kite yoco analyze --fast`
  bf16-1t    the same on one thread
  autocast   torch.autocast bf16 (the first `--fast`: re-casts every weight on every call)
  int8       dynamically quantized Linear layers (torch.ao), LM head kept fp32 (not shipped:
             see its deviation)
Each variant's row is its pass over the queries (best round, ms), `before` the baseline and the
floor the pass's FLOPs at this CPU's measured fp32 matmul rate (harness.floors.cpu_limits; the bf16
and int8 variants against the same rate), with q/s,
tokens/s, the max and mean |Δ entropy| against fp32 (bits), and the load average when it ran. OpenMP's wait
policy (OMP_WAIT_POLICY, read when torch loads) is printed too: run the script with and without
OMP_WAIT_POLICY=PASSIVE to see what spinning threads cost on a loaded machine.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, clock, finish, parse, parser, time_ms  # noqa: E402
from harness.floors import cpu_flops_ms, cpu_fp32_text, cpu_limits  # noqa: E402


def measured_gemm_gflops(threads: int, dtype: torch.dtype = torch.float32) -> float:
    """What a GEMM of the model's shape reaches right now (the load included)."""
    torch.set_num_threads(threads)
    x, w = torch.randn(512, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
    t = time_ms(lambda: torch.nn.functional.linear(x, w), repeat=20, warmup=1)
    return 2 * 512 * 576 * 1536 / (t.median_ms / 1e3) / 1e9


def flops_per_token(model, mean_tokens: float) -> float:
    """2 × (Linear weights, LM head included) + attention scores and mixing at the mean length."""
    lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = model.config
    attn = 4 * cfg.num_hidden_layers * cfg.hidden_size * mean_tokens / 2  # QK^T and AV, causal
    return 2 * lin + attn


@torch.inference_mode()
def before(lm, queries: list[str], batch_size: int = 32) -> list[float]:
    """The pass as first committed (4074a9d), kept here as the baseline."""
    tok = lm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    order = sorted(range(len(queries)), key=lambda i: len(queries[i]))
    out: dict[int, float] = {}
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        enc = [tok(queries[i], add_special_tokens=False)["input_ids"][:128] or [pad] for i in idx]
        width = max(len(e) for e in enc)
        ids = torch.full((len(enc), width), pad, dtype=torch.long)
        mask = torch.zeros((len(enc), width), dtype=torch.long)
        for row, e in enumerate(enc):
            ids[row, :len(e)] = torch.tensor(e)
            mask[row, :len(e)] = 1
        res = lm.model(input_ids=ids, attention_mask=mask)
        probs = torch.softmax(res.logits.float(), dim=-1)
        ent = -(probs * torch.log2(probs.clamp_min(1e-12))).sum(-1)
        for row, i in enumerate(idx):
            out[i] = float(ent[row][mask[row].bool()].mean())
    return [out[i] for i in range(len(queries))]


def int8_model(lm):
    """`lm` with its decoder's Linear layers dynamically quantized to int8 (torch.ao)."""
    import copy
    import warnings
    from dataclasses import replace

    from torch.ao.quantization import quantize_dynamic

    model = copy.deepcopy(lm.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.model = quantize_dynamic(model.model, {torch.nn.Linear}, dtype=torch.qint8)
    return replace(lm, model=model)


def main(argv=None) -> int:
    ap = parser(__doc__, timing=True, repeat=2, warmup=1, device="cpu")
    ap.add_argument("--n", type=int, default=256, help="queries per variant per round")
    ap.add_argument("--variants", default="before,fp32,fp32-1t,bf16,bf16-1t,autocast,int8")
    args = parse(ap, argv)

    from kite.data.traffic import generate_traffic
    from kite.model import load_model
    from kite.yoco.intent import query_signals

    lm = load_model(None)
    # Distinct texts only: query_signals runs a repeated text once, which would flatter q/s.
    pool = dict.fromkeys(r["query"] for r in generate_traffic(max(10_000, 20 * args.n), args.seed))
    queries = list(pool)[:args.n]
    tokens = sum(len(e) for e in lm.tokenizer(queries, add_special_tokens=False)["input_ids"])
    threads = torch.get_num_threads()
    lm8 = int8_model(lm) if "int8" in args.variants else None

    def signals(model, **kw):
        return [s.intent_entropy for s in query_signals(model, queries, **kw)]

    def autocast_signals():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return signals(lm)

    runs = {
        "before": lambda: before(lm, queries),
        "fp32": lambda: signals(lm),
        "fp32-1t": lambda: signals(lm),
        "bf16": lambda: signals(lm, precision="bf16"),
        "bf16-1t": lambda: signals(lm, precision="bf16"),
        "autocast": lambda: autocast_signals(),
        "int8": lambda: signals(lm8),
    }
    names = [v for v in args.variants.split(",") if v in runs]
    reference = signals(lm)  # also warms up
    times: dict[str, list[float]] = {v: [] for v in names}
    loads: dict[str, list[float]] = {v: [] for v in names}
    dev: dict[str, float] = {}
    mean_dev: dict[str, float] = {}
    for _ in range(args.repeat):
        for v in names:
            torch.set_num_threads(1 if v.endswith("-1t") else threads)
            t = clock()
            ent = runs[v]()
            times[v].append(clock() - t)
            loads[v].append(os.getloadavg()[0])
            dev[v] = max(abs(a - b) for a, b in zip(ent, reference))
            mean_dev[v] = statistics.mean(abs(a - b) for a, b in zip(ent, reference))
    torch.set_num_threads(threads)
    peak = cpu_limits().fp32_flops / 1e9
    flop_tok = flops_per_token(lm.model, tokens / len(queries))
    rows = []
    for v in names:
        best = min(times[v])
        rows.append({"variant": v, "queries": len(queries), "tokens": tokens,
                     "q_per_s": len(queries) / best, "tokens_per_s": tokens / best,
                     "q_per_s_median": len(queries) / statistics.median(times[v]),
                     "gflops": tokens * flop_tok / best / 1e9,
                     "ratio_to_fp32_rate": tokens * flop_tok / best / 1e9 / peak,
                     "max_abs_dev_bits": dev[v],
                     "mean_abs_dev_bits": mean_dev[v], "load_avg_1m": statistics.mean(loads[v])})
    base = next((r for r in rows if r["variant"] == "before"), None)
    gemm = measured_gemm_gflops(threads)
    gemm_bf16 = measured_gemm_gflops(threads, torch.bfloat16)
    # The most a pass can do if it were nothing but GEMMs at the bf16 rate just measured.
    ceiling = gemm_bf16 * 1e9 / (flop_tok * tokens / len(queries))
    report = {"gemm_gflops_now": gemm,
              "gemm_bf16_gflops_now": gemm_bf16, "q_per_s_ceiling_bf16_gemm": ceiling,
              "flop_per_token": flop_tok, "mean_tokens": tokens / len(queries), "threads": threads,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
              "load_avg": os.getloadavg(), "rows": rows}
    res = Result("yoco_analyze", device="cpu")
    floor = cpu_flops_ms(tokens * flop_tok)
    for r in sorted(rows, key=lambda r: r is not base):
        res.row(f"{r['variant']}: entropy pass of {len(queries)} queries", len(queries) / r["q_per_s"] * 1e3, "ms",
                baseline=f"before: entropy pass of {len(queries)} queries" if base and r is not base else None,
                floor=f"{tokens * flop_tok / 1e9:.1f} GFLOP {cpu_fp32_text()}", floor_value=floor,
                **{k: v for k, v in r.items() if k != "variant"})
    res.raw.update(report)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
