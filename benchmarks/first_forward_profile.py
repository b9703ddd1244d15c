"""Where the first forward of a query over a loaded state goes on a GPU (what bounds it): Qwen2-7B geometry at random weights (bf16), a 16,384-token state in a static cache, a 16-token
query through KITE's attention; torch's profiler over 5 eager forwards, CUDA kernels grouped by kind
(weights' matrix products, attention, the rest), against the floor (weights + KV read once). Once per
attention path: the fused sdpa kernel and the split-KV kernel (``kite.runtime.attention.SPLIT_KV``),
and the split-KV kernel with the fused layers (``kite.model.fused``: one-kernel RMSNorm and RoPE,
silu * mul, q/k/v and gate/up as one product each), as ``load_model`` installs them on a GPU.

    python3 benchmarks/first_forward_profile.py

Rows: each path's device time per forward (the profiler's kernel sum), the fused sdpa path the
baseline, the floor the weights and the KV read once at the H200's HBM bandwidth (harness.floors).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_speed import QUERY, make_model  # noqa: E402
from harness import Result, bytes_ms, finish, parse, parser  # noqa: E402
from harness.floors import hbm_text  # noqa: E402


VARIANTS = {"fused_sdpa": (False, False), "split_kv": (True, False), "split_kv_fused_layers": (True, True)}


def kind(name: str) -> str:
    n = name.lower()
    if "gemm" in n or "gemv" in n or "cutlass" in n or "sm90_xmma" in n or "nvjet" in n:
        return "matmul"
    if "flash" in n or "attention" in n or "fmha" in n or "efficient" in n or "_partial_kernel" in n \
            or "_merge_kernel" in n:
        return "attention"
    return "other"


def logits_check(cfg, model, forward) -> dict:
    """The forward's last logits with the fused sdpa path, the split-KV kernel and the split-KV kernel
    with the fused layers, each against the same forward with attention computed in fp32 (the same
    bf16 model otherwise, unfused): how far each path moves the logits of 28 random layers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from kite.model import fused
    from kite.runtime import attention

    def fp32_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        out, _ = attention.kite_attention(module, query.float(), key.float(), value.float(), attention_mask, scaling)
        return out.to(query.dtype), None

    AttentionInterface.register("kite_fp32", fp32_attention)
    AttentionMaskInterface.register("kite_fp32", sdpa_mask)
    before = cfg._attn_implementation
    out = {}
    with torch.inference_mode():
        try:
            cfg._attn_implementation = "kite_fp32"
            fused.ENABLED = False
            ref = forward().float()
        finally:
            cfg._attn_implementation = before
        for name, (split, fuse) in VARIANTS.items():
            attention.SPLIT_KV, fused.ENABLED = split, fuse
            got = forward().float()
            out[name] = {
                "max_abs_diff_vs_fp32_attention": round(float((got - ref).abs().max()), 4),
                "rel_l2_vs_fp32_attention": round(float((got - ref).norm() / ref.norm()), 5),
                "argmax_equal": bool(torch.equal(got.argmax(-1), ref.argmax(-1)))}
    attention.SPLIT_KV = fused.ENABLED = True
    out["max_abs_logit"] = round(float(ref.abs().max()), 4)
    return out


def main(argv=None) -> int:
    ap = parser(__doc__, device="cuda")
    ap.add_argument("--tokens", type=int, default=16384)
    args = parse(ap, argv)
    from torch.profiler import ProfilerActivity, profile
    from transformers import StaticCache

    from kite.model import fused
    from kite.runtime import attention
    from kite.runtime.attention import register

    T = args.tokens
    cfg, model = make_model(T, small=False)
    cfg._attn_implementation = register()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    installed = fused.fuse_forward(model)     # weights concatenated once; fused.ENABLED switches
    L, H, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    sc = StaticCache(config=cfg, max_cache_len=T + QUERY)
    with torch.inference_mode():
        for layer in range(L):
            k = torch.randn(1, H, T, d, dtype=torch.bfloat16, device="cuda")
            sc.layers[layer].update(k, torch.randn_like(k), cache_kwargs={"cache_position": torch.arange(T, device="cuda")})
    ids = torch.randint(0, cfg.vocab_size, (1, QUERY), device="cuda")
    pos = torch.arange(T, T + QUERY, device="cuda")[None]

    def forward():
        for layer in sc.layers:
            cl = getattr(layer, "cumulative_length", None)
            if torch.is_tensor(cl):
                cl.fill_(T)
        return model(ids, past_key_values=sc, position_ids=pos, cache_position=pos[0], logits_to_keep=1).logits

    kv = 2 * L * H * T * d * 2
    result = {"tokens": T, "query": QUERY, "fuse_forward": str(installed),
              "floor_ms": {"weights": round(bytes_ms(weights), 3), "kv": round(bytes_ms(kv), 3)}}
    for name, (split, fuse) in VARIANTS.items():
        attention.SPLIT_KV, fused.ENABLED = split, fuse
        with torch.inference_mode():
            for _ in range(3):
                forward()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    forward()
                torch.cuda.synchronize()
        by_kind: dict[str, float] = {}
        top = []
        launches = 0
        for ev in prof.key_averages():
            t = getattr(ev, "self_device_time_total", 0) or getattr(ev, "self_cuda_time_total", 0)
            if t <= 0 or ev.key.startswith("aten::") or ev.key.startswith("cuda"):
                continue
            ms = t / 1e3 / 5
            launches += ev.count // 5
            by_kind[kind(ev.key)] = by_kind.get(kind(ev.key), 0.0) + ms
            top.append((ms, ev.count // 5, ev.key[:110]))
        result[name] = {
            "device_ms_per_forward": {k: round(v, 3) for k, v in by_kind.items()},
            "device_ms_total": round(sum(by_kind.values()), 3), "kernels_per_forward": launches,
            "top_kernels": [{"ms": round(m, 3), "calls": c, "name": n} for m, c, n in sorted(top, reverse=True)[:25]]}
    result["logits"] = logits_check(cfg, model, forward)
    print(json.dumps(result, indent=1))
    res = Result("first_forward_profile", device="cuda")
    first = None
    for name in VARIANTS:
        row = f"first forward, {QUERY} tokens over {T}, {name}: device time"
        res.row(row, result[name]["device_ms_total"], "ms", baseline=first,
                floor=f"weights + KV read once {hbm_text()}", floor_value=bytes_ms(weights + kv),
                **result[name]["device_ms_per_forward"], kernels=result[name]["kernels_per_forward"])
        first = first or row
    res.raw.update(result)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
