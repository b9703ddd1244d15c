"""What coding keys post-RoPE costs in quality at equal bytes (a decode design question: can a kernel score coded keys with no rebuild?).

Per-head coded states store keys *pre*-RoPE, so a decode kernel must rebuild every key (codes x
basis) and rotate it before scoring. Keys coded *post*-RoPE (the bases fitted on the keys as the
cache holds them) could be scored in coefficient space, s_t = c_t . (B_k q) + mu_k . q, with no
per-token rebuild. This measures the quality side of that trade on the embedded model (SmolLM2-135M,
CPU): for each held-out document (kite.upcycle.held_out's: GPL-3, Apache-2.0, generated
contracts of seed 23; context min(2048, n - 512) tokens, the next 512 teacher-forced), the PPL of
the continuation after

* ``full``: the full context (prefilled);
* ``pre``:  the per-head codec (``settings_for(R, joint_heads=False)``), keys coded pre-RoPE,
  decoded, RoPE re-applied at their positions (today's states);
* ``post``: the same codec with the keys coded post-RoPE, decoded and used as they are;
* ``post_rmean``: ``post`` with the per-head pre-RoPE mean taken out first and added back rotated
  (a kernel scores it from the cos/sin tables, d per token, still no rebuild).

Bases are the document's own (no regenerator); the document is coded as contiguous parts of
``--part-tokens`` tokens (the part size the codec's budget assumes; 0: one part) of one layer codec
per layer, values identically on both paths. Reported per document and ratio: bytes of each
state (codec + parts, all stored bytes), PPL delta and KL against ``full`` (mean, and the per-token
median and maximum: a few tokens copied from the context can dominate the mean), top-1 agreement, the
keys' relative error in the post-RoPE space attention reads; ``--post-key-scales``: the post-RoPE variants
also at more key bits (values unchanged), the bytes they need to match pre-RoPE;
``--post-key-shares``: at the ratio's bytes with more of them on the keys (the codec's key share
was tuned for pre-RoPE keys). Per layer, the fraction of the
keys' (centred) variance in the top components pre- vs post-RoPE and the share of the keys'
energy in their per-head mean.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/post_rope_keys.py --post-key-scales 1.25 1.5 2 \
        --post-key-shares 0.45 0.55

Rows: per ratio and variant the mean KL over documents (nats a token), with ``pre`` as the baseline;
quality figures, no floor.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.upcycle import codec  # noqa: E402
from kite.upcycle.study import held_out_docs, prepare_document, relative_error  # noqa: E402
from kite.upcycle.study import MODES, WHERE, coded_keys, variance_fractions  # noqa: E402
from harness import Result, clock, finish, parse, parser  # noqa: E402

@torch.inference_mode()
def measure_document(lm, name: str, text: str, ratios: list[float], tops: list[int], part_tokens: int,
                     key_scales: list[float] = (), key_shares: list[float] = (), continuation: int = 512) -> dict:
    t0 = clock()
    doc = prepare_document(lm, name, text, continuation)
    n_ctx, cont, cap, cos, sin, keys_post, score = (doc.n_ctx, doc.cont, doc.cap, doc.cos, doc.sin, doc.keys_post,
                                                    doc.score)

    # the harness itself: the uncoded prefix must give the full-context PPL
    exact = score(keys_post, cap.values)
    raw_bytes = doc.raw_bytes
    row = {"document": name, "context_tokens": n_ctx, "continuation_tokens": len(cont),
           "ppl_full": round(exact["ppl_full"], 4), "ppl_uncoded_prefix": round(exact["ppl_other"], 4),
           "raw_fp16_bytes": raw_bytes,
           "variance": {where: [variance_fractions(k, tops) for k in ks]
                        for where, ks in (("pre", cap.keys_pre), ("post", keys_post))},
           "ratios": {}}
    for ratio in ratios:
        s = codec.settings_for(ratio, joint_heads=False)
        cell = {}
        total = s.k_bits + s.v_bits
        variants = [(w, w, s) for w in MODES]
        variants += [(f"{w}_k{f:g}", w, codec.settings_for(s, k_bits=s.k_bits * f)) for w in MODES[1:] for f in key_scales]
        variants += [(f"{w}_share{sh:g}", w, codec.settings_for(s, k_bits=total * sh, v_bits=total * (1 - sh)))
                     for w in MODES[1:] for sh in key_shares]
        for label, where, settings in variants:
            t1 = clock()
            keys, values, nbytes = coded_keys(cap.keys_pre, cap.values, cos, sin, settings, where, part_tokens)
            m = score(keys, values)
            err = relative_error(keys, keys_post)
            cell[label] = {"state_bytes": nbytes, "compression_ratio": round(raw_bytes / nbytes, 3),
                           "ppl": round(m["ppl_other"], 4), "ppl_delta": round(m["ppl_other"] - m["ppl_full"], 4),
                           "kl": round(m["kl_mean"], 5), "kl_median": round(m["kl_median"], 5),
                           "kl_max": round(m["kl_max"], 3), "top1": round(m["top1"], 4),
                           "key_rel_error_mean": round(sum(err) / len(err), 4), "key_rel_error": err,
                           "value_rel_error_mean": round(sum(relative_error(values, cap.values)) / len(values), 4),
                           "seconds": round(clock() - t1, 1)}
        cell["bytes_post_over_pre"] = round(cell["post"]["state_bytes"] / cell["pre"]["state_bytes"], 4)
        row["ratios"][f"{ratio:g}"] = cell
        print(f"{name} {ratio:g}x: " + " ".join(f"{w} ΔPPL {cell[w]['ppl_delta']:+.3f} KL {cell[w]['kl']:.4f} "
                                                 f"{cell[w]['state_bytes']} B" for w, _, _ in variants),
              file=sys.stderr, flush=True)
    row["seconds"] = round(clock() - t0, 1)
    return row


def summarize(rows: list[dict], ratios: list[float], tops: list[int]) -> dict:
    """Means over documents per ratio and variant, and per layer over documents for the variances."""
    out: dict = {"by_ratio": {}, "variance_by_layer": {}}
    for ratio in ratios:
        key = f"{ratio:g}"
        variants = [w for w, c in rows[0]["ratios"][key].items() if isinstance(c, dict)]
        out["by_ratio"][key] = {w: {m: round(sum(r["ratios"][key][w][m] for r in rows) / len(rows), 5)
                                    for m in ("ppl_delta", "kl", "kl_median", "top1", "compression_ratio",
                                              "key_rel_error_mean")}
                                for w in variants}
    n_layers = len(rows[0]["variance"]["pre"])
    for w in WHERE:
        out["variance_by_layer"][w] = [
            {m: round(sum(r["variance"][w][layer][m] for r in rows) / len(rows), 4)
             for m in [f"top{k}" for k in tops] + ["mean_energy_share"]} for layer in range(n_layers)]
    return out


def table(result: dict) -> str:
    lines = ["| document | ratio | pre: bytes · ratio · ΔPPL · KL (median) | post: bytes · ratio · ΔPPL · KL (median) "
             "| post/pre bytes |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        for ratio, c in r["ratios"].items():
            cells = [f"{c[w]['state_bytes']:,} · {c[w]['compression_ratio']:.2f}× · {c[w]['ppl_delta']:+.3f} · "
                     f"{c[w]['kl']:.4f} ({c[w]['kl_median']:.4f})" for w in WHERE]
            lines.append(f"| {r['document']} ({r['context_tokens']}) | {ratio}× | " + " | ".join(cells)
                         + f" | {c['bytes_post_over_pre']:.4f} |")
    for ratio, m in result["summary"]["by_ratio"].items():
        lines.append(f"| mean | {ratio}× | ΔPPL {m['pre']['ppl_delta']:+.3f} · KL {m['pre']['kl']:.4f} "
                     f"({m['pre']['kl_median']:.4f}) | ΔPPL {m['post']['ppl_delta']:+.3f} · KL {m['post']['kl']:.4f} "
                     f"({m['post']['kl_median']:.4f}) | |")
    extra = [(ratio, w, c) for ratio, m in result["summary"]["by_ratio"].items() for w, c in m.items()
             if w not in WHERE]
    if extra:
        lines += ["", "| variant (mean over documents) | ratio | state ratio · ΔPPL · KL (median) |", "|---|---|---|"]
        lines += [f"| {w} | {ratio}× | {c['compression_ratio']:.2f}× · {c['ppl_delta']:+.3f} · {c['kl']:.4f} "
                  f"({c['kl_median']:.4f}) |"
                  for ratio, w, c in extra]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--ratios", type=float, nargs="*", default=[4, 8])
    ap.add_argument("--licenses", nargs="*", default=["GPL-3", "Apache-2.0"])
    ap.add_argument("--contracts", type=int, default=2, help="generated contracts of seed 23")
    ap.add_argument("--tops", type=int, nargs="*", default=[8, 16, 32],
                    help="variance fractions in the top-k components (k < head_dim)")
    ap.add_argument("--part-tokens", type=int, default=None,
                    help="tokens per coded part (default: the codec settings' part_tokens; 0: one part)")
    ap.add_argument("--post-key-scales", type=float, nargs="*", default=[],
                    help="also code post-RoPE keys at these multiples of the ratio's key bits (values unchanged): "
                         "the bytes post-RoPE keys need for pre-RoPE's quality")
    ap.add_argument("--post-key-shares", type=float, nargs="*", default=[],
                    help="also code the post-RoPE variants with these shares of the ratio's bits on the keys "
                         "(the rest on the values): equal bytes, rebalanced")
    ap.add_argument("--threads", type=int, default=1)
    args = parse(ap, argv)
    torch.set_num_threads(args.threads)
    from kite.model import load_model

    t0 = clock()
    lm = load_model(None)
    part_tokens = codec.settings_for(4, joint_heads=False).part_tokens if args.part_tokens is None else args.part_tokens
    rows = [measure_document(lm, name, text, args.ratios, args.tops, part_tokens, args.post_key_scales,
                             args.post_key_shares)
            for name, text in held_out_docs(args.contracts, args.licenses).items()]
    result = {"platform": platform.platform(), "threads": args.threads,
              "model": lm.fingerprints.combined, "head_dim": lm.geometry.head_dim, "kv_heads": lm.geometry.n_kv_heads,
              "codec": "settings_for(R, joint_heads=False): per-head bases, the document's own (no regenerator)",
              "part_tokens": part_tokens, "argv": list(argv if argv is not None else sys.argv[1:]),
              "rows": rows, "summary": summarize(rows, args.ratios, args.tops),
              "seconds": round(clock() - t0, 1)}
    print(table(result), file=sys.stderr if args.json else sys.stdout)
    res = Result("post_rope_keys", device="cpu")
    for ratio, means in result["summary"]["by_ratio"].items():
        for w, m in means.items():
            res.row(f"{ratio}x {w}: mean KL", m["kl"], "nats/token",
                    baseline=None if w == "pre" else f"{ratio}x pre: mean KL", **m)
    res.raw.update(result)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
