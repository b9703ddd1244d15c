"""The coded-attention decode kernel alone on synthetic resident states at Qwen2-7B geometry (4 KV
heads, 28 query heads, head_dim 128, 16,384 rows), at the batch a 40 GB budget holds. Sections
(``--sections``): per-head bases (128 code columns a head, one byte a code; 81 sequences): the
stream kernel's configurations (blocks of 2 / 4 tiles, 4 / 8 warps, 2 / 3 pipeline stages, fewer /
more splits; the session-8 head kernel it was measured against is gone since session 9);
nibble-packed per-head codes at the widths measured on random-weight states (benchmarks/coded_ranks.py: keys 64 nibble bytes a head, values 29 + 70 byte
columns; 125 sequences fit); groups of 3 tiles (the stream kernel's blocks halved to 1 tile);
joint-head bases (512 columns, the wide kernels; not run by default). Each section's first
configuration is checked against the torch reference (fp32) on two sequences, the others against it.
Section ``per-head-align`` (session 9b): the session-9 stream kernel (align 1) first, then the stream
kernel with its tables' alignment told to the compiler (``align``: vector loads, asynchronous copies)
with blocks of 1 / 2 / 4 tiles, 2 / 3 stages and a register cap (``maxnreg``). Sections ``coef-bytes``
and ``coef-nibbles`` (session 10): the stream kernel with keys in coefficient space (``keys="coef"``:
post-RoPE key codes, no key rebuilt) against its default rebuild form on the same codes, one byte a
code (81 sequences) and nibble-packed (125), with blocks, stages, warps and splits; each form's first
configuration is checked against the torch reference of its own form, and the whole decode step is
projected from ``--step-json`` (gpu_speed.py's fused-layer steps): step - 28 x (rebuild - coef), the
kernel times scaled to the step's number of sequences. The JSON is rewritten after each
configuration (a run cut short keeps what it measured).

    python3 benchmarks/coded_kernel_speed.py [--json out.json] [--sections ...] [--step-json steps.json]

One layer's codes for every sequence are allocated (well past the L2) and attended ``--layers`` times
(default 1: the figures are per layer; a decode step has 28); CUDA-event medians (triton.testing.do_bench).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HBM_BPS = 4.8e12


def synthetic(N: int, T: int, H: int, d: int, R: int, joint: bool, gen, group_rows: int = 512,
              nib: tuple[int, int] = (0, 0), dev: str = "cuda") -> list:
    """N resident layers of T rows (random codes < 16, groups of ``group_rows`` rows), views of shared
    tensors. ``nib``: nibble bytes a head of keys / values (CodedLayer.k_nib / v_nib: the first 2 Nb
    columns of a head two to a byte, the rest one byte each)."""
    from kite.kernels.coded_attention import TILE, CodedLayer
    from kite.upcycle.load.resident import pack_nibbles

    C = R if joint else H * R
    G = -(-T // group_rows)
    codes_k = torch.randint(0, 16, (N, T, C), dtype=torch.uint8, device=dev, generator=gen)
    codes_v = torch.randint(0, 16, (N, T, C), dtype=torch.uint8, device=dev, generator=gen)
    pos = torch.arange(T, dtype=torch.int32, device=dev)
    tg = (torch.arange(T // TILE, device=dev) * TILE // group_rows).to(torch.int32)

    def tab(lo, hi):
        return torch.rand(G, C, device=dev, generator=gen) * (hi - lo) + lo
    k_scale, k_min, v_scale, v_min = tab(0.02, 0.06), tab(-0.5, -0.3), tab(0.02, 0.06), tab(-0.5, -0.3)
    kb = (torch.randn(H, R, d, device=dev, generator=gen) / math.sqrt(R)).bfloat16()
    vb = (torch.randn(H, R, d, device=dev, generator=gen) / math.sqrt(R)).bfloat16()
    km, vm = torch.randn(G, H, d, device=dev, generator=gen), torch.randn(G, H, d, device=dev, generator=gen)
    empty = torch.zeros(H, 0, d, dtype=torch.bfloat16, device=dev)
    packed = {"k": [(None, codes_k[i]) for i in range(N)], "v": [(None, codes_v[i]) for i in range(N)]}
    for side, nb, codes in (("k", nib[0], codes_k), ("v", nib[1], codes_v)):
        if nb:
            nibs, wide = pack_nibbles(codes.view(N * T, C), H, nb)
            nibs, wide = nibs.view(N, T, -1), wide.view(N, T, -1)
            del codes
            packed[side] = [(nibs[i], wide[i]) for i in range(N)]
    del codes_k, codes_v
    return [CodedLayer(pos=pos, tile_group=tg, k_codes=packed["k"][i][1], k_scale=k_scale, k_min=k_min,
                       v_codes=packed["v"][i][1], v_scale=v_scale, v_min=v_min, k_basis=kb, v_basis=vb, k_mean=km,
                       v_mean=vm, raw_k=empty, raw_v=empty, joint=joint, k_nib=packed["k"][i][0],
                       v_nib=packed["v"][i][0]) for i in range(N)]


def compiled_stats() -> list:
    """The compiler's report per compiled variant of the per-head kernels: registers a thread,
    spills, shared memory, warps, stages and the block / width constants (Triton's kernel caches)."""
    from kite.kernels import coded_attention_triton as tri

    out = []
    for k in tri.PER_HEAD_KERNELS.values():
        try:
            for caches in k.device_caches.values():
                for ck in caches[0].values():
                    consts = str(getattr(getattr(ck, "src", None), "constants", ""))[-300:]
                    out.append({"kernel": k.fn.__name__, "n_regs": ck.n_regs, "n_spills": ck.n_spills,
                                "shared": ck.metadata.shared, "num_warps": ck.metadata.num_warps,
                                "num_stages": ck.metadata.num_stages, "constants": consts})
        except Exception as e:  # noqa: BLE001 - Triton's cache layout differs between versions
            out.append({"kernel": getattr(getattr(k, "fn", None), "__name__", "?"), "error": repr(e)[:200]})
    return out


def project(step: dict, rebuild: tuple[float, str], coef: tuple[float, str], N: int, launches: int,
            layers: int = 28) -> dict:
    """The whole decode step with the coef kernel in place of the rebuild one: gpu_speed.py's
    measured step (CUDA graph, fused layers) minus ``layers`` x (rebuild - coef) per layer, the
    kernel times (per ``launches`` launches of N sequences) scaled to the step's sequences."""
    n_step = step["n_coded"]
    per_layer = {k: ms / launches * n_step / N for k, (ms, _) in (("rebuild", rebuild), ("coef", coef))}
    measured = step["coded_step_ms"]["graph"]
    projected = measured - layers * per_layer["rebuild"] + layers * per_layer["coef"]
    tps = n_step / projected * 1e3
    return {"step_sequences": n_step, "kernel_sequences": N, "step_ms_measured": measured,
            "rebuild_ms_per_layer": per_layer["rebuild"], "coef_ms_per_layer": per_layer["coef"],
            "rebuild_config": rebuild[1], "coef_config": coef[1], "step_ms_projected": projected,
            "tokens_per_s_projected": tps, "raw_tokens_per_s": step["raw_tokens_per_s"],
            "projected_vs_raw_tokens_per_s": tps / step["raw_tokens_per_s"],
            "measured_vs_raw_tokens_per_s": step["coded_vs_raw_tokens_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=1, help="launches timed together (one per layer)")
    ap.add_argument("--sections", nargs="+", default=["per-head", "per-head-nibbles", "per-head-3-tile-groups"],
                    choices=["per-head", "per-head-align", "per-head-nibbles", "per-head-3-tile-groups", "joint",
                             "coef-bytes", "coef-nibbles", "coef-tune", "nibbles-aligned"])
    ap.add_argument("--step-json", type=Path, default=None,
                    help="gpu_speed.py output with the whole decode steps (--fused-steps): the coef sections "
                         "project the step with the coef kernel from it")
    ap.add_argument("--smoke", action="store_true",
                    help="a check of this script on the CPU in Triton's interpreter (turned on here, with the "
                         "tests' interpreter fixes): 2 sequences of 1,024 rows, wall-clock timing, nothing to report")
    ap.add_argument("--profile-one", action="store_true",
                    help="run the stream kernel's default three times on the per-head section and stop (for ncu)")
    args = ap.parse_args()
    if args.smoke:    # before Triton's first import; the interpreter gaps tests/triton_interpreter.py bridges
        import os

        os.environ["TRITON_INTERPRET"] = "1"
        from tests.triton_interpreter import bridge_interpreter_gaps
        bridge_interpreter_gaps()
    from triton.testing import do_bench

    dev = "cpu" if args.smoke else "cuda"
    if args.smoke:
        def do_bench(fn, **_):
            import time
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3

    from kite.kernels.coded_attention import coded_partial_torch, merge
    from kite.kernels.coded_attention_triton import CodedBatch, coded_decode

    H, Hq, d, T = 4, 28, 128, 1024 if args.smoke else 16384
    gen = torch.Generator(device=dev).manual_seed(0)
    P = T + 64
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    ang = torch.arange(P, device=dev)[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    half_cos, half_sin = cos[:, :d // 2].half().contiguous(), sin[:, :d // 2].half().contiguous()
    # (block, stages, cols, warps, kernel, splits factor, fp16 operands[, align, maxnreg]); kernel: "wide" |
    # "stream"; align None: the batch's (CodedBatch.alignment), 1: none (the session-9 form)
    old = ((1, 3, 64, 8, "wide", 1, False), (2, 2, 64, 8, "wide", 1, False), (4, 2, 32, 8, "wide", 1, False))
    stream = ((2, 2, 0, 4, "stream", 1, False), (2, 2, 0, 4, "stream", 1, True), (2, 3, 0, 4, "stream", 1, True),
              (4, 2, 0, 4, "stream", 1, True), (4, 3, 0, 4, "stream", 1, True), (2, 2, 0, 4, "stream", 2, True),
              (2, 2, 0, 8, "stream", 1, True), (4, 2, 0, 8, "stream", 1, True))
    s1 = (2, 2, 0, 4, "stream", 1, True, 1, None)          # the session-9 default, no alignment told
    align = (s1, (2, 2, 0, 4, "stream", 1, True, None, None), (2, 3, 0, 4, "stream", 1, True, None, None),
             (1, 2, 0, 4, "stream", 1, True, None, None), (1, 3, 0, 4, "stream", 1, True, None, None),
             (4, 2, 0, 8, "stream", 1, True, None, None), (2, 2, 0, 4, "stream", 1, True, None, 168),
             (2, 2, 0, 4, "stream", 2, True, None, None), (2, 2, 0, 8, "stream", 1, True, None, None))
    stream = tuple(c + (1, None) for c in stream)         # the per-head section as measured in session 9
    # keys in coefficient space (the 10th field: keys) against the rebuild form's default
    rb, cf = (2, 2, 0, 4, "stream", 1, True, None, None, "rebuild"), (2, 2, 0, 4, "stream", 1, True, None, None, "coef")
    coef_bytes = (rb, cf, (2, 3, 0, 4, "stream", 1, True, None, None, "coef"),
                  (4, 2, 0, 4, "stream", 1, True, None, None, "coef"), (1, 2, 0, 4, "stream", 1, True, None, None, "coef"),
                  (4, 3, 0, 4, "stream", 1, True, None, None, "coef"), (2, 2, 0, 8, "stream", 1, True, None, None, "coef"),
                  (4, 2, 0, 8, "stream", 1, True, None, None, "coef"), (2, 2, 0, 4, "stream", 2, True, None, None, "coef"),
                  (2, 2, 0, 4, "stream", 0.5, True, None, None, "coef"))
    coef_nibbles = (rb, (2, 3, 0, 4, "stream", 1, True, None, None, "rebuild"), cf,
                    (2, 3, 0, 4, "stream", 1, True, None, None, "coef"), (4, 2, 0, 4, "stream", 1, True, None, None, "coef"),
                    (4, 3, 0, 4, "stream", 1, True, None, None, "coef"), (2, 2, 0, 8, "stream", 1, True, None, None, "coef"),
                    (2, 2, 0, 4, "stream", 2, True, None, None, "coef"))
    # session 10's tuning of the coef kernel around its best (blocks of 4 tiles), and nibble-packed
    # sides whose nibble bytes a head are a multiple of 16 (keys 64, values 32; 64 byte columns): the
    # tables' alignment 16 instead of 1 at about the same bytes (163 -> 160 a head and row)
    coef_tune = (rb, (4, 2, 0, 4, "stream", 1, True, None, None, "coef"), (8, 2, 0, 4, "stream", 1, True, None, None, "coef"),
                 (8, 3, 0, 4, "stream", 1, True, None, None, "coef"), (8, 2, 0, 8, "stream", 1, True, None, None, "coef"),
                 (4, 2, 0, 4, "stream", 2, True, None, None, "coef"), (4, 2, 0, 4, "stream", 0.5, True, None, None, "coef"),
                 (4, 2, 0, 4, "stream", 1, True, None, 168, "coef"))
    nib_aligned = (rb, (2, 3, 0, 4, "stream", 1, True, None, None, "rebuild"), cf,
                   (4, 2, 0, 4, "stream", 1, True, None, None, "coef"))
    sections = {
        "per-head": ("per-head bases", 128, False, 81, 512, (0, 0), stream),
        "per-head-align": ("per-head bases", 128, False, 81, 512, (0, 0), align),
        "per-head-nibbles": ("per-head bases, nibble-packed (keys 64 / values 29 nibble bytes a head)", 128, False,
                             125, 512, (64, 29), stream),
        "per-head-3-tile-groups": ("per-head bases, groups of 3 tiles", 128, False, 81, 96, (0, 0),
                                   ((2, 2, 0, 4, "stream", 1, True), (1, 2, 0, 4, "stream", 1, True))),
        "joint": ("joint-head bases", 512, True, 78, 512, (0, 0), old),
        "coef-bytes": ("coef keys, per-head bases", 128, False, 81, 512, (0, 0), coef_bytes),
        "coef-nibbles": ("coef keys, per-head bases, nibble-packed (keys 64 / values 29 nibble bytes a head)", 128,
                         False, 125, 512, (64, 29), coef_nibbles),
        "coef-tune": ("coef keys tuned, per-head bases", 128, False, 81, 512, (0, 0), coef_tune),
        "nibbles-aligned": ("coef keys, per-head bases, nibble-packed aligned (keys 64 / values 32 nibble bytes a head)",
                            128, False, 125, 512, (64, 32), nib_aligned)}
    # the whole decode steps these sections project (gpu_speed.py's rows; None: no projection)
    steps = {"coef-bytes": "coded_concurrency_per-head", "coef-nibbles": "coded_concurrency_per-head, nibble-packed",
             "coef-tune": "coded_concurrency_per-head"}
    step_rows = json.loads(args.step_json.read_text()) if args.step_json else {}
    rows = {}
    if args.profile_one:
        layers = synthetic(81, T, H, d, 128, False, gen, 512, (0, 0), dev)
        batch = CodedBatch(layers)
        q = torch.randn(81, Hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
        for _ in range(3):
            coded_decode(q, batch, half_cos, half_sin, 1 / math.sqrt(d))
        torch.cuda.synchronize()
        return
    for key in args.sections:
        label, R, joint, N, group_rows, nib, configs = sections[key]
        N = 2 if args.smoke else N
        layers = synthetic(N, T, H, d, R, joint, gen, group_rows, nib, dev)
        batch = CodedBatch(layers)
        stream_bytes = layers[0].stream_bytes
        q = torch.randn(N, Hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
        sms = 8 if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
        refs = {}
        best = {}
        keyed = any(len(c) >= 10 for c in configs)      # configurations that name their keys' form
        for block, stages, cols, warps, kernel, split_f, f16, *more in configs:
            al, maxnreg, keys = (more + [None, None, "rebuild"])[:3]
            name = (f"{label}, {kernel} kernel" + (f", {keys} keys" if keyed else "")
                    + f", block {block}, stages {stages}" + (f", cols {cols}" if cols else "")
                    + f", warps {warps}" + (f", splits x{split_f}" if split_f != 1 else "")
                    + (", fp16 operands" if f16 else "")
                    + ("" if kernel != "stream" else f", align {batch.alignment if al is None else al}")
                    + (f", maxnreg {maxnreg}" if maxnreg else ""))
            splits = max(1, min(-(-8 * sms // (N * H)), (T // 32) // (8 * block)))
            splits = max(1, int(splits * split_f))
            c_, s_ = (half_cos, half_sin) if kernel == "stream" else (cos, sin)
            try:
                def run(block=block, stages=stages, cols=cols or 32, warps=warps, kernel=kernel, c_=c_, s_=s_,
                        q=q, batch=batch, splits=splits, f16=f16, al=al, maxnreg=maxnreg, keys=keys):
                    extra = {"align": al, "maxnreg": maxnreg, "keys": keys} if kernel == "stream" else {}
                    return coded_decode(q, batch, c_, s_, 1 / math.sqrt(d), block=block, num_stages=stages, cols=cols,
                                        num_warps=warps, stream=kernel == "stream", splits=splits, f16=f16,
                                        **extra)
                o, lse = run()
                out = merge([(o[:, s], lse[:, s]) for s in range(o.shape[1])])[0]
                if keys not in refs:
                    refs[keys] = out
                    # the section's first configuration (of each keys form) against the torch reference
                    # (fp32) of that form, two sequences
                    errs = []
                    for i in (0, N - 1):
                        want, _ = coded_partial_torch(q[i][:, None].float(), layers[i], cos, sin, 1 / math.sqrt(d),
                                                      keys=keys)
                        errs.append(float((out[i] - want[:, 0]).abs().max() / want.abs().max()))
                    form = f", {keys} keys" if keyed else ""
                    rows[f"{label}{form}: first configuration vs torch reference (max abs diff / max |out|)"] = max(errs)
                    print("vs torch reference", max(errs), flush=True)
                ref = refs[keys]
                ms = do_bench(lambda: [run() for _ in range(args.layers)], warmup=50, rep=300, return_mode="median")
                if keys not in best or ms < best[keys][0]:
                    best[keys] = (ms, name)
                rows[name] = {"ms": ms, "floor_ms": args.layers * N * stream_bytes / HBM_BPS * 1e3, "sequences": N,
                              "stream_bytes_per_layer_and_sequence": stream_bytes, "splits": splits,
                              "vs_first_max_abs_diff": float((out - ref).abs().max()),
                              "max_abs_out": float(ref.abs().max())}
            except Exception as e:  # noqa: BLE001 - a configuration that does not fit is reported
                rows[name] = {"error": repr(e)[:300]}
            print(name, rows[name], flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
        step = step_rows.get(steps.get(key, ""))
        if step and not args.smoke and {"rebuild", "coef"} <= set(best):
            rows[f"{label}: projected decode step"] = project(step, best["rebuild"], best["coef"], N, args.layers)
            print(json.dumps(rows[f"{label}: projected decode step"], indent=1), flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
        del layers, batch
        torch.cuda.empty_cache()
    rows["compiled"] = compiled_stats()
    print("compiled variants:", json.dumps(rows["compiled"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    for k, v in rows.items():
        if isinstance(v, list):     # the compiled variants, printed above
            continue
        if not isinstance(v, dict):
            print(f"{k:<120} {v:.2e}")
            continue
        if "step_ms_projected" in v:
            print(f"{k:<120} {v['step_ms_projected']:9.3f} ms (measured {v['step_ms_measured']:.2f}), "
                  f"{v['tokens_per_s_projected']:.0f} tok/s = {v['projected_vs_raw_tokens_per_s']:.3f}x raw")
            continue
        print(f"{k:<120} " + (f"{v['ms']:9.3f} ms  floor {v['floor_ms']:.2f} ({v['ms'] / v['floor_ms']:.1f}x)  "
                             f"vs first: {v['vs_first_max_abs_diff']:.2e} / {v['max_abs_out']:.2f}"
                             if "ms" in v else v["error"][:120]))


if __name__ == "__main__":
    main()
