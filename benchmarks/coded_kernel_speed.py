"""The coded-attention decode kernel alone on synthetic resident states at Qwen2-7B geometry (4 KV
heads, 28 query heads, head_dim 128, 16,384 rows): one tile per step vs blocks of 2 and 4 tiles, with
per-head bases (128 code columns per head) and joint-head ones (512), at the batch a 40 GB budget
holds; the block variants checked against the one-tile kernel on the same inputs. For per-head bases
also the head kernel (``head=True``: the basis held on chip, all columns in one product, scales as one
row where a block lies in one quantization group), with fp32 or fp16 RoPE tables, and on states whose
groups are 3 tiles long (every 4-tile block straddles two groups: its slow path).

    python3 benchmarks/coded_kernel_speed.py [--json out.json]

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


def synthetic(N: int, T: int, H: int, d: int, R: int, joint: bool, gen, group_rows: int = 512) -> list:
    """N resident layers of T rows (random codes < 16, groups of ``group_rows`` rows), views of shared
    tensors."""
    from kite.kernels.coded_attention import TILE, CodedLayer

    C = R if joint else H * R
    G = -(-T // group_rows)
    dev = "cuda"
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
    return [CodedLayer(pos=pos, tile_group=tg, k_codes=codes_k[i], k_scale=k_scale, k_min=k_min, v_codes=codes_v[i],
                       v_scale=v_scale, v_min=v_min, k_basis=kb, v_basis=vb, k_mean=km, v_mean=vm, raw_k=empty,
                       raw_v=empty, joint=joint) for i in range(N)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=1, help="launches timed together (one per layer)")
    args = ap.parse_args()
    from triton.testing import do_bench

    from kite.kernels.coded_attention import merge
    from kite.kernels.coded_attention_triton import CodedBatch, coded_decode

    H, Hq, d, T = 4, 28, 128, 16384
    gen = torch.Generator(device="cuda").manual_seed(0)
    P = T + 64
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    ang = torch.arange(P, device="cuda")[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    half_cos, half_sin = cos[:, :d // 2].half().contiguous(), sin[:, :d // 2].half().contiguous()
    old = ((1, 3, 64, 8, False, False), (2, 2, 64, 8, False, False), (2, 2, 32, 8, False, False),
           (4, 1, 32, 8, False, False), (4, 2, 32, 8, False, False))
    head = ((4, 2, 0, 8, True, False), (4, 2, 0, 8, True, True), (4, 1, 0, 8, True, True), (4, 3, 0, 8, True, True),
            (4, 2, 0, 4, True, True), (2, 2, 0, 4, True, True), (2, 2, 0, 8, True, True), (8, 1, 0, 8, True, True))
    rows = {}
    for label, R, joint, N, group_rows, configs in (
            ("per-head bases", 128, False, 81, 512, old + head),
            ("per-head bases, groups of 3 tiles", 128, False, 81, 96, ((4, 2, 32, 8, False, False),) + head[:2]),
            ("joint-head bases", 512, True, 78, 512, old)):
        layers = synthetic(N, T, H, d, R, joint, gen, group_rows)
        batch = CodedBatch(layers)
        stream = sum(t.numel() * t.element_size() for t in (layers[0].k_codes, layers[0].v_codes, layers[0].pos))
        q = torch.randn(N, Hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = None
        for block, stages, cols, warps, use_head, half in configs:
            name = (f"{label}, {'head kernel' if use_head else 'wide kernel'}, block {block}, stages {stages}"
                    + (f", cols {cols}" if cols else "") + f", warps {warps}" + (", fp16 RoPE tables" if half else ""))
            c_, s_ = (half_cos, half_sin) if half else (cos, sin)
            try:
                def run(block=block, stages=stages, cols=cols or 32, warps=warps, use_head=use_head, c_=c_, s_=s_,
                        q=q, batch=batch):
                    return coded_decode(q, batch, c_, s_, 1 / math.sqrt(d), block=block, num_stages=stages, cols=cols,
                                        num_warps=warps, head=use_head)
                o, lse = run()
                out = merge([(o[:, s], lse[:, s]) for s in range(o.shape[1])])[0]
                if ref is None:
                    ref = out
                ms = do_bench(lambda: [run() for _ in range(args.layers)], warmup=50, rep=300, return_mode="median")
                rows[name] = {"ms": ms, "floor_ms": args.layers * N * stream / HBM_BPS * 1e3, "sequences": N,
                              "vs_first_max_abs_diff": float((out - ref).abs().max()),
                              "max_abs_out": float(ref.abs().max())}
            except Exception as e:  # noqa: BLE001 - a configuration that does not fit is reported
                rows[name] = {"error": repr(e)[:300]}
            print(name, rows[name], flush=True)
        del layers, batch
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    for k, v in rows.items():
        print(f"{k:<95} " + (f"{v['ms']:9.2f} ms  floor {v['floor_ms']:.2f}  vs first: {v['vs_first_max_abs_diff']:.2e}"
                             f" / {v['max_abs_out']:.2f}" if "ms" in v else v["error"][:120]))


if __name__ == "__main__":
    main()
