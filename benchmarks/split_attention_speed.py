"""Attention of a 16-token query over a 16K-token cached prefix, alone, on a GPU: KITE's attention with
the fused sdpa kernel (query heads folded, bottom-right causal mask) against the split-KV kernel
(kite.kernels.split_attention_triton) at several configurations; Qwen2-7B geometry (28 query / 4 KV
heads, head_dim 128, bf16), every layer's KV in its own buffer (0.9 GB in all, far past the L2), the
28 layers' calls captured in one CUDA graph, against the floor (the KV read once at 4.8 TB/s).

    python3 benchmarks/split_attention_speed.py --out out/split_attention_speed.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_speed import HBM_BPS, capture, cuda_ms  # noqa: E402

CONFIGS = [dict(), dict(splits=16), dict(splits=24), dict(splits=48), dict(splits=64), dict(block_n=32),
           dict(block_n=128), dict(splits=16, block_n=128)]


def graph_ms(fn, reps: int = 20) -> float:
    """Median time of one replay of a CUDA graph of fn(), by CUDA events."""
    g, _ = capture(fn)
    return cuda_ms(g.replay, reps=reps)

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--query", type=int, default=16)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from kite.kernels.split_attention_triton import split_kv_attention
    from kite.runtime import attention

    L, Hq, Hkv, d, q = args.layers, 28, 4, 128, args.query
    K = args.tokens + q
    dt = torch.bfloat16
    qs = [torch.randn(1, Hq, q, d, dtype=dt, device="cuda") for _ in range(L)]
    ks = [torch.randn(1, Hkv, K, d, dtype=dt, device="cuda") for _ in range(L)]
    vs = [torch.randn(1, Hkv, K, d, dtype=dt, device="cuda") for _ in range(L)]
    mask = (torch.arange(K, device="cuda")[None] <= torch.arange(q, device="cuda")[:, None] + K - q)[None, None]
    floor = 2 * L * Hkv * K * d * 2 / HBM_BPS * 1e3
    scale = d ** -0.5

    class _Layer:
        layer_idx = 0

    def fused():
        attention.SPLIT_KV = False
        return [attention.kite_attention(_Layer, qs[i], ks[i], vs[i], mask, scale)[0] for i in range(L)]

    rows = []
    with torch.inference_mode():
        ref = fused()
        ms = graph_ms(fused)
        rows.append({"path": "fused sdpa (KITE attention, folded, bool mask)", "ms": ms, "x_floor": ms / floor})
        for cfg in [dict(mask=False)] + CONFIGS:
            cfg = dict(cfg)
            use_mask = cfg.pop("mask", True)

            def split(cfg=cfg, use_mask=use_mask):
                return [split_kv_attention(qs[i], ks[i], vs[i], mask if use_mask else None, scale, **cfg)
                        for i in range(L)]

            try:
                out = split()
                err = max(float((o.float() - r.float()).abs().max()) for o, r in zip(out, ref))
                ms = graph_ms(split)
            except Exception as e:  # noqa: BLE001 - a configuration past the chip's limits: say so, go on
                rows.append({"path": f"split-KV {cfg}", "error": str(e)[:200]})
                print(rows[-1], flush=True)
                continue
            rows.append({"path": f"split-KV {cfg or 'default'}{' causal rule' if not use_mask else ' bool mask'}",
                         "ms": ms, "x_floor": ms / floor, "max_abs_diff_vs_fused": err})
            print(f"{rows[-1]['path']:70s} {ms:8.3f} ms  {ms / floor:6.1f}x floor  {err:.2e}", flush=True)
    attention.SPLIT_KV = True
    result = {"tokens": args.tokens, "query": q, "layers": L, "floor_ms": floor,
              "device": torch.cuda.get_device_name(0), "rows": rows}
    print(f"{rows[0]['path']:70s} {rows[0]['ms']:8.3f} ms  {rows[0]['x_floor']:6.1f}x floor; floor {floor:.3f} ms")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
