"""Whole decode steps from states resident in nibble lanes vs raw bf16 KV, at one KV budget, in one run
(the decode target: tokens/s >= 2x raw at raw's largest batch).

    python benchmarks/lanes_decode.py [--tokens 16384] [--kv-budget-gb 40] [--lanes 128 64]
    python benchmarks/lanes_decode.py --cpu-smoke        # tiny model on the CPU: the script runs

Random-weight Qwen2-7B geometry (benchmarks/gpu_speed.py's make_model: 28 layers, 28 query / 4 KV
heads, head_dim 128, bf16) with the fused layers ``load_model`` installs on a GPU. Per lane count R
(``--lanes``; R = 128 lanes a row is 4 bits an element, 64 is 2; K:V for keys and values apart):
one 16K-token state of random KV is coded (kite.upcycle.codec.encode_lanes, timed warm: encode_s), copied into as
many states as the budget holds (each its own memory; one pointer table a layer), and checked against the torch reference at three layers; then the kernel
alone over all layers (its configurations, against its byte floor: what it reads at HBM bandwidth) and
the whole decode step (one new token a state, the model's forward, CUDA-graphed) against raw bf16
KV at its largest batch in the same run. Random KV has a flat spectrum, so every component gets
the same lanes: the speed is the form's, the quality is measured on the embedded model
(benchmarks/lanes_quality.py). Rows: raw's decode step and tokens/s (the baselines), each form's
step and tokens/s against them, its kernel's best configuration; floors: the weights and what each
step's attention reads, once, at the H200's HBM bandwidth (harness.floors).
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_speed as gs  # noqa: E402
from kite.kernels import lanes as L  # noqa: E402
from kite.upcycle.codec import encode_lanes  # noqa: E402
from harness import Result, bytes_ms, finish, parse, parser, wall  # noqa: E402
from harness.floors import hbm_text  # noqa: E402


def stacked(one: L.Lanes, n: int) -> L.Lanes:
    """n copies of a one-state layer, each in its own memory."""
    import dataclasses

    big = {f.name: getattr(one, f.name).expand(n, *getattr(one, f.name).shape[1:]).clone()
           for f in dataclasses.fields(one) if torch.is_tensor(getattr(one, f.name))}
    return dataclasses.replace(one, **big)


def kernel_bytes(one: L.Lanes) -> int:
    """Bytes the kernel and its projections read per state and layer: codes, per-group tables, bases."""
    return sum(getattr(one, f"{s}_{f}").numel() * getattr(one, f"{s}_{f}").element_size()
               for s in "kv" for f in ("codes", "weight", "const", "basis"))


def main(argv=None) -> int:
    ap = parser(__doc__, device="cuda")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--kv-budget-gb", type=float, default=40.0)
    ap.add_argument("--lanes", nargs="+", default=["128", "64"],
                    help="lanes a row: R for keys and values, or K:V (keys K, values V)")
    ap.add_argument("--group", type=int, default=512)
    ap.add_argument("--sinks", type=int, default=1, help="first tokens kept exact (raw rows)")
    ap.add_argument("--splits", type=int, nargs="*", default=[0], help="0: the kernel's default")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = parse(ap, argv)
    if args.cpu_smoke:
        gs.DEV = "cpu"
        args.tokens, args.kv_budget_gb, args.lanes, args.group = 600, 0.002, ["32", "16:32"], 128
    warnings.filterwarnings("ignore")
    dev = gs.DEV
    T = args.tokens
    cfg, model = gs.make_model(T, args.cpu_smoke)
    Lyr, H, Hq = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads
    d = cfg.hidden_size // Hq
    scale = 1 / math.sqrt(d)
    n_params = sum(p.numel() for p in model.model.layers.parameters()) + cfg.vocab_size * cfg.hidden_size
    weights_floor = bytes_ms(n_params * 2)
    raw_bytes = 2 * Lyr * H * T * d * 2
    budget = args.kv_budget_gb * 1e9
    n_raw = max(1, int(budget // raw_bytes))
    report = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__,
              "tokens": T, "budget_gb": args.kv_budget_gb, "raw_bytes_per_seq": raw_bytes, "n_raw": n_raw,
              "weights_floor_ms": weights_floor, "forms": {}}
    from kite.kernels.partials import merge, raw_partial
    from kite.kernels.lanes_triton import LanesPlan, lanes_decode
    from kite.model import fused
    from transformers import AttentionInterface

    if dev == "cuda":
        fused.fuse_forward(model)
        fused.ENABLED = True
    gen = torch.Generator(device=dev).manual_seed(3)
    state: dict = {}

    def lanes_attn(module, query, key, value, attention_mask, scaling=None, **kw):
        li = module.layer_idx
        lay, plan = state["plans"][li]
        extra_k = torch.cat((lay.raw_k, key.to(lay.raw_k.dtype)), dim=2)       # the sinks, the new token itself
        extra_v = torch.cat((lay.raw_v, value.to(lay.raw_v.dtype)), dim=2)
        if dev == "cuda":
            out = lanes_decode(query[:, :, 0], plan, scaling, extra_k, extra_v, **state["kernel"])[0]
        else:
            o, lse = L.lanes_partial_torch(query[:, :, 0], lay, scaling)
            ro, rl = raw_partial(query, extra_k, extra_v, scaling)
            out = merge([(o, lse), (ro[:, :, 0], rl[:, :, 0])])[0]
        return out[:, None].to(query.dtype), None

    AttentionInterface.register("bench_lanes", lanes_attn)
    AttentionInterface.register("bench_raw", gs.raw_step_attention(state, T))

    def step_ms(name, n):
        eager, graphed = gs.decode_step_ms(model, cfg, name, n, T, gen, graph=not args.no_graph)
        return {"eager": eager, "graph": graphed, "best": min(x for x in (eager, graphed) if x)}

    with torch.inference_mode():
        ct, st = model.model.rotary_emb(torch.zeros(1, device=dev), torch.arange(T, device=dev)[None])
    cos, sin = ct[0].float(), st[0].float()
    for R in args.lanes:
        rk, rv = (int(x) for x in (R.split(":") if ":" in R else (R, R)))
        torch.cuda.empty_cache() if dev == "cuda" else None
        keys, values = [], []
        for _ in range(Lyr):    # one state: random KV per layer, keys rotated as the cache holds them
            k = torch.randn(H, T, d, device=dev, generator=gen)
            keys.append(k * cos + torch.cat((-k[..., d // 2:], k[..., :d // 2]), -1) * sin)
            values.append(torch.randn(H, T, d, device=dev, generator=gen))
        encode_lanes(keys[:1], values[:1], rk, rv, group=args.group, sinks=args.sinks)   # warm: kernels, solver handles
        with wall(dev) as took:     # coding the state, as kite serve --resident lanes codes a load
            ones = [x.to(basis_dtype=torch.bfloat16)
                    for x in encode_lanes(keys, values, rk, rv, group=args.group, sinks=args.sinks)]
        del keys, values
        per_seq = sum(o.nbytes() for o in ones)
        stream = sum(kernel_bytes(o) for o in ones)
        n_cod = max(1, int(budget // per_seq))
        form = {"lanes": R, "k_lanes": rk, "v_lanes": rv, "group": args.group, "sinks": args.sinks, "encode_s": round(took.s, 2),
                "state_bytes": per_seq, "raw_over_state": round(raw_bytes / per_seq, 3), "n_states": n_cod,
                "states_over_raw_batch": round(n_cod / n_raw, 3), "kernel_bytes_per_seq": stream}
        print(f"lanes {R}:", json.dumps(form), flush=True)
        # correctness: kernel vs the torch reference, 4 states of this form, three layers
        errs = {}
        for li in (0, Lyr // 2, Lyr - 1):
            four = L.stack([ones[li]] * 4)
            qc = torch.randn(4, Hq, d, device=dev, generator=gen, dtype=torch.bfloat16) * 2
            want, wl = L.lanes_partial_torch(qc, four, scale)
            got, gl = lanes_decode(qc, four, scale) if dev == "cuda" else (want, wl)
            errs[li] = {"max_abs_diff": float((got - want).abs().max()), "max_abs_out": float(want.abs().max()),
                        "lse_max_abs_diff": float((gl - wl).abs().max())}
        form["kernel_vs_reference"] = errs
        print("kernel vs reference:", json.dumps(errs), flush=True)
        state["plans"] = [(x, LanesPlan(x)) for x in (stacked(o, n_cod) for o in ones)]
        qn = torch.randn(n_cod, Hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
        floor = bytes_ms(n_cod * stream)
        variants = {}
        if dev == "cuda":
            for sp in args.splits:
                kw = dict(splits=sp or None)
                name = f"splits{sp}"
                try:
                    variants[name] = gs.cuda_ms(
                        lambda kw=kw: [lanes_decode(qn, p, scale, **kw) for _, p in state["plans"]], reps=3)
                except Exception as e:  # noqa: BLE001
                    variants[name] = repr(e)[:200]
            print("kernel variants (ms, all layers):", variants, flush=True)
            best = min((v, k) for k, v in variants.items() if isinstance(v, float))[1]
            state["kernel"] = dict(splits=int(best[len("splits"):]) or None)
            form.update({"kernel_variants_ms": variants, "kernel_best": best,
                         "kernel_ms_all_layers": variants[best], "kernel_floor_ms": floor,
                         "kernel_over_floor": round(variants[best] / floor, 2)})
        else:
            state["kernel"] = {}
        step = step_ms("bench_lanes", n_cod)
        form.update({"step_ms": step, "step_floor_ms": weights_floor + floor,
                     "tokens_per_s": n_cod / step["best"] * 1e3})
        report["forms"][str(R)] = form
        state.pop("plans")
        print(f"lanes {R} step:", json.dumps(step), flush=True)
    torch.cuda.empty_cache() if dev == "cuda" else None
    state["kv"] = [torch.randn(2, n_raw, H, T + 1, d, device=dev, dtype=torch.bfloat16, generator=gen)
                   for _ in range(Lyr)]
    raw = step_ms("bench_raw", n_raw)
    state.clear()
    fused.ENABLED = False
    report["raw_step_ms"] = raw
    report["raw_tokens_per_s"] = n_raw / raw["best"] * 1e3
    report["raw_step_floor_ms"] = weights_floor + bytes_ms(n_raw * raw_bytes)
    for R, form in report["forms"].items():
        form["vs_raw_tokens_per_s"] = round(form["tokens_per_s"] / report["raw_tokens_per_s"], 3)
    print(f"raw bf16, {n_raw} sequences: {raw['best']:.2f} ms/step, {report['raw_tokens_per_s']:.0f} tok/s "
          f"(floor {report['raw_step_floor_ms']:.2f} ms)")
    for R, form in report["forms"].items():
        kern = f", kernel {form['kernel_ms_all_layers']:.2f} ms = {form['kernel_over_floor']}x its floor" \
            if "kernel_ms_all_layers" in form else ""
        print(f"lanes {R}: {form['n_states']} states ({form['raw_over_state']}x fewer bytes), "
              f"{form['step_ms']['best']:.2f} ms/step, {form['tokens_per_s']:.0f} tok/s = {form['vs_raw_tokens_per_s']}x raw"
              f" (floor {form['step_floor_ms']:.2f} ms){kern}")
    res = Result("lanes_decode", device=dev)

    def fl(what: str, ms: float) -> dict:     # the floors are a GPU's: none on the CPU smoke run
        return {"floor": what, "floor_value": ms} if dev == "cuda" else {}

    raw_step = f"decode step, raw bf16, {n_raw} x {T}-token sequences"
    res.row(raw_step, raw["best"], "ms", **fl(f"weights + {n_raw} raw KV read once {hbm_text()}",
                                             report["raw_step_floor_ms"]), eager_ms=raw["eager"], graph_ms=raw["graph"])
    res.row("tokens/s, raw bf16", report["raw_tokens_per_s"], "tokens/s")
    for R, form in report["forms"].items():
        n = form["n_states"]
        res.row(f"decode step, lanes {R}, {n} states", form["step_ms"]["best"], "ms", baseline=raw_step,
                **fl(f"weights + {n} lanes states' kernel bytes read once {hbm_text()}", form["step_floor_ms"]),
                state_bytes=form["state_bytes"])
        res.row(f"tokens/s, lanes {R}", form["tokens_per_s"], "tokens/s", baseline="tokens/s, raw bf16")
        if "kernel_ms_all_layers" in form:
            res.row(f"lanes {R} kernel, all layers ({form['kernel_best']})", form["kernel_ms_all_layers"], "ms",
                    **fl(f"{n} states' codes, tables and bases read once {hbm_text()}", form["kernel_floor_ms"]))
    res.raw.update(report)
    return finish(res, args, label="smoke" if args.cpu_smoke else None)


if __name__ == "__main__":
    sys.exit(main())
