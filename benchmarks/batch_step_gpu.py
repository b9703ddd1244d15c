"""The batch engine's decode step on a GPU: transformers' forward against KITE's kernel step, eager
and CUDA-graphed (kite.runtime.kernel_step), rows after 16K-token states held raw or in lanes.

    python benchmarks/batch_step_gpu.py                       # H200: Qwen2-7B geometry, 32 rows x 16K
    python benchmarks/batch_step_gpu.py --rows 32 --tokens 16384 --kv-budget-gb 40 --steps 20
    python benchmarks/batch_step_gpu.py --small --tokens 512 --rows 4 --steps 3   # a quick run of the script

Random Qwen2-7B weights (bf16, benchmarks/harness/models.py; fused forwards installed as
`kite serve` loads a model), one random state of --tokens tokens as raw bf16 KV, taken by every row
(each row copies it into its own slots, as the server's rows do). Then BatchDecoder, the engine
`kite serve` drives, runs --steps decode steps (after the rows' first step, which prefills a 16-token
question each and is timed apart) in three ways side by side:

* ``transformers``: the model's forward with the batch's masks (kite.runtime.attention);
* ``kernels, eager``: the written-out forward on KITE's kernels, launched step by step;
* ``kernels, graphed, no step ahead``: the same, replayed from a CUDA graph at the batch's bucket,
  each step launched once the host has the last one's tokens;
* ``kernels, graphed`` (what `kite serve` runs): each decode step launched before the host takes the
  last one's tokens, the rows fed their argmax on the device (KernelStep.again).

Each step's wall time is what the engine sees: launch, GPU work and the argmax's copy to the host.
The floor is the weights a step reads (all but the input embedding) plus every row's KV, read once
at the GPU's HBM bandwidth. Greedy tokens of the graphed run are compared with the eager run's
(bf16: near-ties may flip on random weights).

Then the KV budget (--kv-budget-gb): as many raw rows as fit it, and as many rows held in 4-bit lanes
(kite.kernels.lanes: the state beside each row, the row's slots holding only its live tokens) as fit
it, each decoding in the kernel step; aggregate tokens/s of each, lanes against raw.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Result, Timing, bytes_ms, clock, finish, parse, parser  # noqa: E402
from harness.floors import hbm_text  # noqa: E402
from harness.models import random_qwen2  # noqa: E402

QUERY = 16


class Ids:
    """A tokenizer stand-in: the engine streams text; ids are enough here."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def engine(model, cfg, rows: int, mode: str, max_bytes: int | None = None):
    from kite.model import geometry_from_config
    from kite.runtime import kernel_step
    from kite.runtime.batch_decode import BatchDecoder

    lm = SimpleNamespace(model=model, tokenizer=Ids(), geometry=geometry_from_config(cfg), eos_ids=lambda: set())
    dec = BatchDecoder(lm, rows, max_kv_bytes=max_bytes)
    if mode == "transformers":
        dec.kernels = None
    kernel_step.GRAPHS = mode != "kernels, eager"
    kernel_step.AHEAD = mode != "kernels, graphed, no step ahead"
    return dec


def decode(dec, prefix, rows: int, steps: int, seed: int = 1) -> dict:
    """``rows`` requests after ``prefix``, a 16-token question each: the first step (prefills) and
    ``steps`` decode steps, each step's wall time; the greedy tokens of every row."""
    g = torch.Generator().manual_seed(seed)
    vocab = dec.lm.geometry.vocab_size
    handles = [dec.add(torch.randint(vocab, (QUERY,), generator=g).tolist(), prefix=prefix,
                       max_new_tokens=steps + 2) for _ in range(rows)]
    torch.cuda.synchronize()
    t0 = clock()
    out = dec.step()
    first_ms = (clock() - t0) * 1e3
    times = []
    for _ in range(steps):
        t0 = clock()
        out.update(dec.step())
        times.append((clock() - t0) * 1e3)
    out.update(dec.drain())
    return {"first_step_ms": first_ms, "steps_ms": times, "texts": [out[h].text for h in handles]}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=32, help="rows decoding together in the side-by-side")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of the state every row follows")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per run")
    ap.add_argument("--kv-budget-gb", type=float, default=40.0, help="the KV budget of the raw / lanes rows (0: skip)")
    ap.add_argument("--lane-bits", type=int, default=4)
    ap.add_argument("--splits", default="", help="also time the graphed step with the attention's keys cut into "
                    "these numbers of chunks, e.g. 0,2,4,8 (0: the kernel's plan)")
    ap.add_argument("--attention-configs", default="", help="also time the graphed step with the attention kernel's "
                    "launch by row at one tile of 16 query rows (a decode step) set to these 'keys a tile,warps,stages,blocks an SM' configurations, space-separated, "
                    "e.g. '64,8,2,16 128,4,3,16'")
    ap.add_argument("--profile", action="store_true", help="also record the GPU kernels of a few eager steps (the "
                    "rows' question prefill and decode steps, raw at --rows and lanes at 1 row): time per step by kernel")
    ap.add_argument("--small", action="store_true", help="the tiny geometry (a quick run of the script)")
    args = parse(ap, argv)
    if args.device != "cuda":
        ap.error("the kernel step runs on a GPU")
    from kite.model import fused
    from kite.runtime.attention import register
    from kite.runtime.cache import KVPrefix

    res = Result("batch_step_gpu", device=args.device)
    cfg, model = random_qwen2("cuda", small=args.small)
    cfg._attn_implementation = register()
    fused.fuse_forward(model)
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = cfg.hidden_size // cfg.num_attention_heads
    T = args.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    keys = [torch.randn(H, T, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(L)]
    values = [torch.randn(H, T, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(L)]
    prefix = KVPrefix(keys, values, T)
    # what a decode step reads of the weights: all but the input embedding (a row each is gathered)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - \
        model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    slot = 2 * L * H * d * 2                      # bytes a token's K and V take over every layer

    def floor(rows: int, kv_bytes_per_row: float) -> float:
        return bytes_ms(weights + rows * kv_bytes_per_row)

    raw = {"rows": args.rows, "tokens": T, "steps": args.steps}
    runs = {}
    for mode in ("transformers", "kernels, eager", "kernels, graphed, no step ahead", "kernels, graphed"):
        torch.cuda.empty_cache()
        dec = engine(model, cfg, args.rows, mode)
        decode(dec, prefix, args.rows, 2)          # warm: kernels compiled, buffers grown, graphs captured
        run = decode(dec, prefix, args.rows, args.steps)
        run["captures"] = dec.kernels.captures if dec.kernels else 0
        runs[mode] = run
        print(f"{mode}: step {Timing.of(run['steps_ms']).median_ms:.2f} ms, first step {run['first_step_ms']:.1f} ms",
              flush=True)
        dec = None
    kv_row = slot * (T + QUERY + args.steps // 2)
    step_floor = floor(args.rows, kv_row)
    base = f"decode step, {args.rows} rows x {T}-token states, transformers' forward"
    res.timing(base, Timing.of(runs["transformers"]["steps_ms"]), floor=f"weights + {args.rows} rows' KV read once at "
               f"{hbm_text()}", floor_value=step_floor)
    for mode in ("kernels, eager", "kernels, graphed, no step ahead", "kernels, graphed"):
        res.timing(f"decode step, {args.rows} rows x {T}-token states, {mode}", Timing.of(runs[mode]["steps_ms"]),
                   baseline=base, floor=f"weights + {args.rows} rows' KV read once at {hbm_text()}",
                   floor_value=step_floor)
    res.row(f"first step (16-token question prefills), {args.rows} rows, transformers' forward",
            runs["transformers"]["first_step_ms"], "ms", no_floor="one sample: row copies, prefills and first tokens")
    res.row(f"first step (16-token question prefills), {args.rows} rows, kernels",
            runs["kernels, graphed"]["first_step_ms"], "ms",
            baseline=f"first step (16-token question prefills), {args.rows} rows, transformers' forward",
            no_floor="one sample: row copies, prefills and first tokens")
    same_ahead = [a == b for a, b in zip(runs["kernels, graphed"]["texts"], runs["kernels, graphed, no step ahead"]["texts"])]
    raw["ahead_equals_one_at_a_time_rows"] = f"{sum(same_ahead)} of {len(same_ahead)}"
    same = [a == b for a, b in zip(runs["kernels, graphed"]["texts"], runs["kernels, eager"]["texts"])]
    same_hf = [a == b for a, b in zip(runs["kernels, graphed"]["texts"], runs["transformers"]["texts"])]
    raw["graphed_equals_eager_rows"] = f"{sum(same)} of {len(same)}"
    raw["graphed_equals_transformers_rows"] = f"{sum(same_hf)} of {len(same_hf)}"
    raw["runs"] = {m: {k: v for k, v in r.items() if k != "texts"} for m, r in runs.items()}

    if args.splits:
        from kite.runtime import kernel_step

        sweep = {}
        for n in [int(x) for x in args.splits.split(",")]:
            kernel_step.SPLITS = n or None
            sweep[n] = graphed_step_ms(model, cfg, prefix, args)
            print(f"graphed, splits {n or 'planned'}: step {sweep[n]:.2f} ms", flush=True)
        kernel_step.SPLITS = None
        raw["splits_sweep_ms"] = sweep
    if args.attention_configs:
        raw["attention_configs_ms"] = attention_sweep(model, cfg, prefix, args)
    if args.profile:
        raw["profile"] = profiles(model, cfg, prefix, args)
    if args.kv_budget_gb > 0:
        budget = args.kv_budget_gb * 1e9
        budget_rows(res, raw, model, cfg, prefix, budget, args, floor, slot)
    res.raw.update(raw)
    return finish(res, args)


def graphed_step_ms(model, cfg, prefix, args) -> float:
    """The median graphed step of --rows rows after ``prefix`` on a new engine (its graphs captured first)."""
    torch.cuda.empty_cache()
    dec = engine(model, cfg, args.rows, "kernels, graphed")
    decode(dec, prefix, args.rows, 2)
    return Timing.of(decode(dec, prefix, args.rows, args.steps)["steps_ms"]).median_ms


def attention_sweep(model, cfg, prefix, args) -> dict:
    """The graphed step at --rows with the attention kernel's decode launch set to each configuration
    (keys a tile, warps, stages, blocks an SM): median step ms by configuration."""
    from kite.kernels import split_attention_triton as sa

    default = (sa.ROW_BLOCK_N, sa.ROW_WARPS, sa.ROW_STAGES, sa.BY_ROW_BLOCKS_PER_SM)
    out = {}
    try:
        for text in args.attention_configs.split():
            sa.ROW_BLOCK_N, sa.ROW_WARPS, sa.ROW_STAGES, sa.BY_ROW_BLOCKS_PER_SM = map(int, text.split(","))
            out[text] = graphed_step_ms(model, cfg, prefix, args)
            print(f"graphed, attention {text}: step {out[text]:.2f} ms", flush=True)
    finally:
        sa.ROW_BLOCK_N, sa.ROW_WARPS, sa.ROW_STAGES, sa.BY_ROW_BLOCKS_PER_SM = default
    return out


def kernel_table(prof, steps: int, top: int = 14) -> dict:
    """GPU time per step by kernel (ms, the ``top`` largest and the rest), from a torch profile of ``steps`` steps."""
    times: dict[str, list] = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0.0)
        if not us or e.key.startswith(("ProfilerStep", "cudaGraphLaunch")) or getattr(e, "device_type", None) is None:
            continue
        if str(e.device_type).endswith("CPU"):
            continue
        times[e.key[:90]] = [us / 1e3 / steps, e.count / steps]
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])
    table = {k: {"ms": round(v[0], 4), "launches": round(v[1], 2)} for k, v in ranked[:top]}
    table["(the rest)"] = {"ms": round(sum(v[0] for _, v in ranked[top:]), 4),
                           "launches": round(sum(v[1] for _, v in ranked[top:]), 2)}
    table["(all kernels)"] = {"ms": round(sum(v[0] for v in times.values()), 4),
                              "launches": round(sum(v[1] for v in times.values()), 2)}
    return table


def profiles(model, cfg, prefix, args) -> dict:
    """The GPU kernels of eager kernel steps: a 16-token question's prefill and decode steps, raw rows at
    --rows and a row held in lanes (kite.kernels.lanes) alone."""
    from torch.profiler import ProfilerActivity, profile

    from kite.upcycle import lanes_of

    d = prefix.keys[0].shape[-1]
    lanes = lanes_of(prefix, d, "cuda", lane_bits=(args.lane_bits, args.lane_bits))
    out = {}
    for name, pre, rows in (("raw", prefix, args.rows), ("lanes", lanes, 1)):
        torch.cuda.empty_cache()
        dec = engine(model, cfg, rows, "kernels, eager")
        decode(dec, pre, rows, 2)                      # compiled, buffers grown
        g = torch.Generator().manual_seed(3)
        for _ in range(rows):
            dec.add(torch.randint(cfg.vocab_size, (QUERY,), generator=g).tolist(), prefix=pre, max_new_tokens=12)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec.step()
            torch.cuda.synchronize()
        first = kernel_table(prof, 1)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                dec.step()
            torch.cuda.synchronize()
        out[f"{name}, {rows} rows"] = {"question prefill": first, "decode step": kernel_table(prof, 5)}
        dec.drain()
        for part, table in out[f"{name}, {rows} rows"].items():
            print(f"{name}, {rows} rows, {part}:", flush=True)
            for k, v in table.items():
                print(f"  {v['ms']:8.3f} ms  x{v['launches']:<6g} {k}", flush=True)
        dec = None
    from kite.runtime import kernel_step
    kernel_step.GRAPHS = True
    out["query pass"] = query_pass_profile(model, cfg)
    return out


def query_pass_profile(model, cfg, counts=(1, 64, 158), length: int = 16) -> dict:
    """YOCO's pass over N queries of ``length`` tokens alone (kite.runtime.kernel_pass.hidden_pass and the
    head's entropies and NLL, kite.yoco.intent.head_entropy_bits), as the server's decision runs it: wall ms
    (median of 5 after a warm-up) and the GPU kernels of one pass."""
    from torch.profiler import ProfilerActivity, profile

    from kite.runtime.kernel_pass import hidden_pass
    from kite.yoco.intent import head_entropy_bits

    head = model.get_output_embeddings()
    out = {}
    for n in counts:
        ids = torch.randint(cfg.vocab_size, (n, length))
        targets = torch.randint(cfg.vocab_size, (n * length,))

        @torch.inference_mode()
        def one():
            last, _ = hidden_pass(model, ids)
            return head_entropy_bits(head, last.reshape(n * length, -1), targets=targets)
        one()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = clock()
            one()
            times.append((clock() - t0) * 1e3)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            one()
            torch.cuda.synchronize()
        out[f"{n} queries"] = {"wall_ms": round(sorted(times)[2], 3), "kernels": kernel_table(prof, 1)}
        print(f"query pass, {n} queries of {length} tokens: {out[f'{n} queries']['wall_ms']} ms", flush=True)
        for k, v in out[f"{n} queries"]["kernels"].items():
            print(f"  {v['ms']:8.3f} ms  x{v['launches']:<6g} {k}", flush=True)
    return out


def budget_rows(res, raw, model, cfg, prefix, budget, args, floor, slot) -> None:
    """Raw rows and lanes rows at one KV budget, each as many as fit, decoding in the graphed / kernel
    step: aggregate tokens/s."""
    from kite.upcycle import lanes_of

    T, d = args.tokens, prefix.keys[0].shape[-1]
    live = QUERY + args.steps + 4
    n_raw = int(budget // (slot * (T + live)))
    lanes = lanes_of(prefix, d, "cuda", lane_bits=(args.lane_bits, args.lane_bits))
    per_lanes = lanes.nbytes() + slot * live
    n_lanes = int(budget // per_lanes)
    out = {"budget_gb": args.kv_budget_gb, "raw_rows": n_raw, "lanes_rows": n_lanes,
           "lanes_bytes_per_row": lanes.nbytes(), "raw_bytes_per_row": slot * T}
    timings = {}
    for name, pre, n in (("raw", prefix, n_raw), ("lanes", lanes, n_lanes)):
        torch.cuda.empty_cache()
        dec = engine(model, cfg, n, "kernels, graphed")
        decode(dec, pre, n, 2)
        run = decode(dec, pre, n, args.steps)
        t = Timing.of(run["steps_ms"])
        timings[name] = t
        out[name] = {"rows": n, "step_ms": t.median_ms, "tokens_per_s": n / (t.median_ms / 1e3),
                     "first_step_ms": run["first_step_ms"], "steps_ms": run["steps_ms"]}
        print(f"{name} at {args.kv_budget_gb:g} GB: {n} rows, step {t.median_ms:.2f} ms", flush=True)
        dec = None
    kv_lanes = out["lanes_bytes_per_row"] + slot * live
    res.timing(f"decode step at a {args.kv_budget_gb:g} GB KV budget, {n_raw} raw rows, kernel step",
               timings["raw"],
               floor=f"weights + {n_raw} rows' KV read once at the HBM bandwidth",
               floor_value=floor(n_raw, slot * (T + live)))
    res.timing(f"decode step at a {args.kv_budget_gb:g} GB KV budget, {n_lanes} lanes rows, kernel step",
               timings["lanes"],
               floor=f"weights + {n_lanes} rows' lanes and slots read once at the HBM bandwidth",
               floor_value=floor(n_lanes, kv_lanes))
    raw_tps = out["raw"]["tokens_per_s"]
    res.row(f"tokens/s at a {args.kv_budget_gb:g} GB KV budget, raw rows ({n_raw})", raw_tps, "tokens/s")
    res.row(f"tokens/s at a {args.kv_budget_gb:g} GB KV budget, lanes rows ({n_lanes}), x raw", out["lanes"]["tokens_per_s"],
            "tokens/s", baseline=f"tokens/s at a {args.kv_budget_gb:g} GB KV budget, raw rows ({n_raw})")
    raw["kv_budget"] = out


if __name__ == "__main__":
    raise SystemExit(main())
