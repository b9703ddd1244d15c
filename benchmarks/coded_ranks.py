"""What the coded kernel would rebuild on real KV: the per-column code widths of states with per-head
bases (the codec's bit allocation), per layer and side, on the embedded SmolLM2 model's own KV against
KV from a random-weight model of the benchmark's head geometry (head_dim 128, 4 KV heads; the
benchmark's Qwen2-7B width is too slow on the CPU, so hidden size 512, 2 layers).

Per side it counts, per KV head, the columns coded at 0 bits (folded into per-group means: the kernel
never rebuilds them), at 1-4 bits (two to a byte when nibble-packed) and at 5-8 bits (one byte each),
and from them the kernel's rebuild rank (live columns per head, padded to the kernel's 32) and its
resident code bytes per token and head, one byte a code vs nibble-packed.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/coded_ranks.py --json docs/coded_ranks_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch


def widths(path: Path) -> list[dict]:
    """Per layer and side: the bits of each column per KV head [H, d] from the state's layer codecs."""
    from kite.upcycle import codec
    from kite.upcycle.format import StateFile, blob_key

    out = []
    with StateFile(path) as sf:
        for layer in range(int(sf.meta["model"]["geometry"]["n_layers"])):
            lc = codec.from_bytes(sf.read(blob_key(None, layer)), codec.LayerCodec)
            out.append({s: lc.tensors[f"{s}.bits"].long() for s in ("k", "v")})
    return out


def summary(bits: list[dict], align: int = 32) -> dict:
    rows = {}
    for side in ("k", "v"):
        b = torch.stack([layer[side] for layer in bits])            # [L, H, d]
        live = (b > 0).sum(-1)                                        # [L, H]
        nib = ((b > 0) & (b <= 4)).sum(-1)
        wide = (b > 4).sum(-1)
        rank_pad = (-(-live.amax(-1) // align) * align).float()     # the kernel's width per layer
        byte_form = rank_pad                                          # one byte per padded live column
        nib_form = (-(-nib.amax(-1) // 2)) + wide.amax(-1)          # two <=4-bit codes a byte + the wide ones
        hist = torch.bincount(b.flatten(), minlength=9)[:9]
        rows[side] = {"columns_per_head": int(b.shape[-1]), "layers": int(b.shape[0]),
                      "zero_bit_columns_per_head_mean": float((b == 0).sum(-1).float().mean()),
                      "live_columns_per_head_mean": float(live.float().mean()),
                      "live_columns_per_head_max": int(live.max()),
                      "kernel_rank_mean (live, padded to 32)": float(rank_pad.mean()),
                      "nibble_columns_per_head_mean": float(nib.float().mean()),
                      "byte_columns_per_head_mean": float(wide.float().mean()),
                      "mean_bits_of_live_columns": float(b[b > 0].float().mean()) if bool((b > 0).any()) else 0.0,
                      "code_bytes_per_token_head_one_byte": float(byte_form.mean()),
                      "code_bytes_per_token_head_nibble_packed": float(nib_form.float().mean()),
                      "bits_histogram_0_to_8": hist.tolist()}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--random-tokens", type=int, default=4096)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kite.model import load_cached
    from kite.model.geometry import geometry_from_config
    from kite.upcycle import CompressSettings, compress_document, tokenize_document
    from kite.upcycle.codec import settings_for

    s = settings_for(4, joint_heads=False)
    res = {"codec": "ratio=4, per-head bases (settings_for(4, joint_heads=False))"}
    with tempfile.TemporaryDirectory() as tmp:
        lm = load_cached("smollm2-135m")
        ids, _ = tokenize_document(lm.tokenizer, Path(args.input).read_text())
        ctx = ids[:args.context]
        path = Path(tmp) / "smol.upc"
        with torch.inference_mode():
            compress_document(lm, lm.tokenizer.decode(ctx), path, CompressSettings(codec=s), ids=ctx)
        res["smollm2"] = {"tokens": len(ctx), "head_dim": lm.geometry.head_dim, "kv_heads": lm.geometry.n_kv_heads,
                          **summary(widths(path))}
        print("smollm2", json.dumps(res["smollm2"]), flush=True)
        # a random-weight model with the benchmark's head geometry
        torch.manual_seed(0)
        cfg = Qwen2Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=28,
                          num_key_value_heads=4, head_dim=128, vocab_size=lm.model.config.vocab_size,
                          max_position_embeddings=args.random_tokens + 64)
        rnd_lm = dataclasses.replace(lm, model=Qwen2ForCausalLM(cfg).eval(), geometry=geometry_from_config(cfg))
        rid = torch.randint(cfg.vocab_size, (args.random_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
        path = Path(tmp) / "rnd.upc"
        with torch.inference_mode():
            compress_document(rnd_lm, lm.tokenizer.decode(rid), path, CompressSettings(codec=s), ids=rid)
        res["random_weights"] = {"tokens": len(rid), "head_dim": 128, "kv_heads": 4, **summary(widths(path))}
        print("random", json.dumps(res["random_weights"]), flush=True)
    if args.json:
        from kite.atomic import write_text
        write_text(args.json, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
