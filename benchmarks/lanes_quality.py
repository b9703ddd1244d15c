"""What the nibble-lanes resident form (kite/kernels/lanes.py) costs in quality at a ratio.

On the embedded model (SmolLM2-135M, CPU), per held-out document (kite.upcycle.held_out's:
GPL-3, Apache-2.0, generated contracts of seed 23; context min(2048, n - 512) tokens, the next 512
teacher-forced, scored by kite.upcycle.held_out), the continuation's PPL delta and KL
against the full context after a prefix coded as

* ``pre``:   the per-head codec at ratio R (``settings_for(R, joint_heads=False)``), keys pre-RoPE,
  rotated after decoding (today's per-head states; its own stored bytes, parts of 256 tokens);
* ``joint``: the default joint-head codec at ratio R (``settings_for(R)``), keys pre-RoPE;
* ``pre@lanes`` / ``joint@lanes``: the same codecs at the ratio of the first equal-split lanes
  variant (group ``--groups[0]``, ``--clips[0]``): the codecs at the lanes' bytes;
* ``lanes``: every layer in lanes (``kite.upcycle.codec.lanes.encode`` of the post-RoPE keys and the values, 1 sink),
  decoded with ``lanes.decode`` and used as post-RoPE keys; R lanes a row = 4 d / R (R = 4: d lanes,
  4 bits an element), bytes from ``Lanes.nbytes()``. Variants: group sizes, quantization ranges
  (``min/max`` or MSE-clipped), k/v splits of the lanes other than equal (half the lanes on one
  side), more first tokens kept exact (``_s<n>``) or token 0 and the n - 1 tokens a first coding codes
  worst (``_w<n>``); ``--one-side``: the first variant's keys
  with exact values (``_keys_only``) and its values with exact keys (``_values_only``);
* ``joint+<lanes variant>`` (``--through-codec``, kite serve --resident lanes' path): the variant's
  lanes coded from the joint codec's decoded KV (keys post-RoPE, as load_prefix rebuilds a state)
  instead of the full KV; bytes the lanes' (what the GPU holds; the state file stays on disk).
  ``--through-codec`` runs ratio 4 only: ``joint``, lanes g512 / g128 / g128 with 16 sinks (minmax)
  from the full KV and through the codec.

Bases are the document's own (no regenerator). Each variant's bytes are stated with its ratio
against the raw fp16 KV, so rows compare at (roughly) equal bytes. Rows: per ratio and variant the
mean KL over documents (nats a token), the joint codec's at that ratio the baseline; quality figures,
no floor.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lanes_quality.py --contracts 5 --threads 2
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lanes_quality.py --contracts 1 --groups 128 --clips minmax \\
        --split-groups --sinks --no-equal-bytes --one-side --threads 2
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lanes_quality.py --contracts 5 --groups 128 64 256 --clips minmax \\
        --split-groups --sinks 16 --worst 16 64 --sinks-groups 64 128 256 --no-codecs --threads 2
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lanes_quality.py --contracts 5 --through-codec --threads 2
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.upcycle.codec import LANE_CLIPS  # noqa: E402
from kite.upcycle import codec  # noqa: E402
from kite.upcycle.study import held_out_docs, prepare_document  # noqa: E402
from kite.upcycle.study import coded_keys  # noqa: E402
from kite.upcycle.study import lanes_cells, lanes_prefix, lanes_variants, score_cell  # noqa: E402
from harness import Result, clock, finish, parse, parser  # noqa: E402


@torch.inference_mode()
def measure_document(lm, name: str, text: str, ratios: list[float], groups: list[int], clips: list[str],
                     split_groups: list[int], sinks: list[int] = (), context: int = 2048, continuation: int = 512,
                     codecs: bool = True, equal_bytes: bool = True, one_side: bool = False,
                     sinks_groups: list[int] | None = None, worst: list[int] = (), through_codec: bool = False) -> dict:
    """``through_codec``: the codec rows are the joint codec's only, and every lanes variant is also
    applied to the joint codec's decoded KV (``joint+<variant>``, kite serve --resident lanes' path)."""
    t0 = clock()
    doc = prepare_document(lm, name, text, continuation, context)
    exact = doc.score(doc.keys_post, doc.cap.values)          # the harness: the uncoded prefix gives full PPL
    d = doc.keys_post[0].shape[-1]
    row = {"document": name, "context_tokens": doc.n_ctx, "continuation_tokens": len(doc.cont),
           "ppl_full": round(exact["ppl_full"], 4), "ppl_uncoded_prefix": round(exact["ppl_other"], 4),
           "raw_fp16_bytes": doc.raw_bytes, "ratios": {}}
    for ratio in ratios:
        cell = {}

        def codecs_at(r: float, suffix: str = "", which: tuple[str, ...] = ("pre", "joint")) -> dict:
            out = {}
            for label, s in (("pre", codec.settings_for(r, joint_heads=False)), ("joint", codec.settings_for(r))):
                if label not in which:
                    continue
                t1 = clock()
                keys, values, nbytes = coded_keys(doc.cap.keys_pre, doc.cap.values, doc.cos, doc.sin, s, "pre",
                                                  s.part_tokens)
                cell[label + suffix] = score_cell(doc, doc.score(keys, values), keys, values, nbytes,
                                             clock() - t1, codec_ratio=round(r, 3))
                out[label] = (keys, values)
            return out

        coded = {}
        if codecs or through_codec:
            coded = codecs_at(ratio, which=("joint",) if through_codec else ("pre", "joint"))
        variants = lanes_variants(d, ratio, groups, clips, split_groups, sinks, sinks_groups, worst)
        cell.update(lanes_cells(doc, variants))
        if through_codec:                   # serving's path: the joint codec's decoded KV, coded again in lanes
            cell.update(lanes_cells(doc, variants, *coded["joint"], prefix="joint+"))
        if one_side:                        # which side's coding costs the quality: the other exact
            for label, kl_, vl_, g, c, sk, _ in lanes_variants(d, ratio, groups[:1], clips[:1], []):
                t1 = clock()
                keys, values, b = lanes_prefix(doc, kl_, vl_, g, c, sk)
                for side, kv in (("keys", (keys, doc.cap.values)), ("values", (doc.keys_post, values))):
                    cell[f"{label}_{side}_only"] = score_cell(doc, doc.score(*kv), *kv, b["state_bytes"],
                                                         clock() - t1, k_lanes=kl_, v_lanes=vl_,
                                                         group=g, clip=c, sinks=sk)
        if codecs and equal_bytes and not through_codec:          # the codecs at the bytes of the first equal-split lanes variant
            codecs_at(cell[f"lanes_g{groups[0]}_{clips[0]}"]["compression_ratio"], "@lanes")
        row["ratios"][f"{ratio:g}"] = cell
        print(f"{name} {ratio:g}x: " + "; ".join(f"{w} {c['compression_ratio']:.2f}x ΔPPL {c['ppl_delta']:+.3f} "
                                                  f"KL {c['kl']:.4f}" for w, c in cell.items()),
              file=sys.stderr, flush=True)
    row["seconds"] = round(clock() - t0, 1)
    return row


def summarize(rows: list[dict]) -> dict:
    """Means over documents per ratio and variant; per ratio the lanes variant of least mean KL."""
    out = {}
    for ratio in rows[0]["ratios"]:
        means = {w: {m: round(sum(r["ratios"][ratio][w][m] for r in rows) / len(rows), 5)
                     for m in ("ppl_delta", "kl", "kl_median", "top1", "compression_ratio", "key_rel_error_mean",
                               "value_rel_error_mean")}
                 for w in rows[0]["ratios"][ratio]}
        equal = [w for w in means if w.startswith("lanes_g") and not w.endswith("_only")]
        out[ratio] = {"means": means, "best_lanes_equal_split": min(equal, key=lambda w: means[w]["kl"]) if equal
                      else None}
    return out


def _short(c: dict) -> str:
    return f"{c['compression_ratio']:.2f}× · {c['ppl_delta']:+.3f} · {c['kl']:.4f}"


def table(result: dict) -> str:
    """Per document and ratio the codecs and the lanes variant of least mean KL (× raw fp16 · ΔPPL ·
    KL), then every variant's means over documents."""
    cols = ["pre", "joint", "pre@lanes", "joint@lanes"]
    lines = ["| document | ratio | " + " | ".join(cols) + " | lanes (best) |", "|---" * (len(cols) + 3) + "|"]
    for r in result["rows"]:
        for ratio, cell in r["ratios"].items():
            best = result["summary"][ratio]["best_lanes_equal_split"]
            parts = [_short(cell[w]) if w in cell else "" for w in cols + [best]]
            lines.append(f"| {r['document']} ({r['context_tokens']}) | {ratio}× | " + " | ".join(parts) + " |")
    lines += ["", "| mean over documents | ratio | variant | × raw fp16 | ΔPPL | KL (median) | key / value rel. error |",
              "|---|---|---|---|---|---|---|"]
    for ratio, s in result["summary"].items():
        for w, m in s["means"].items():
            best = " (best lanes)" if w == s["best_lanes_equal_split"] else ""
            lines.append(f"| | {ratio}× | {w}{best} | {m['compression_ratio']:.2f} | {m['ppl_delta']:+.3f} | "
                         f"{m['kl']:.4f} ({m['kl_median']:.4f}) | {m['key_rel_error_mean']:.4f} / "
                         f"{m['value_rel_error_mean']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--ratios", type=float, nargs="*", default=[4, 8])
    ap.add_argument("--licenses", nargs="*", default=["GPL-3", "Apache-2.0"])
    ap.add_argument("--contracts", type=int, default=3, help="generated contracts of seed 23")
    ap.add_argument("--groups", type=int, nargs="*", default=[128, 64, 256, 512],
                    help="lanes: rows per group (the first: the codecs' equal bytes, the sinks variants)")
    ap.add_argument("--clips", nargs="*", default=list(LANE_CLIPS), choices=LANE_CLIPS,
                    help="lanes: quantization ranges")
    ap.add_argument("--split-groups", type=int, nargs="*", default=[256],
                    help="lanes: groups at which to try half the lanes on keys or on values")
    ap.add_argument("--sinks", type=int, nargs="*", default=[4, 16, 64],
                    help="lanes: also keep this many first tokens exact (at the first group and clip)")
    ap.add_argument("--worst", type=int, nargs="*", default=[],
                    help="lanes: also keep this many rows exact: token 0 and the tokens a first coding codes worst")
    ap.add_argument("--sinks-groups", type=int, nargs="*", default=None,
                    help="groups at which to try --sinks (default: the first of --groups)")
    ap.add_argument("--no-codecs", action="store_true", help="lanes variants only")
    ap.add_argument("--one-side", action="store_true",
                    help="also the first lanes variant on one side only, the other exact (bytes: both sides')")
    ap.add_argument("--no-equal-bytes", action="store_true",
                    help="skip the codecs at the bytes of the first lanes variant")
    ap.add_argument("--context", type=int, default=2048, help="most context tokens a document gives")
    ap.add_argument("--continuation", type=int, default=512)
    ap.add_argument("--smoke", action="store_true",
                    help="one contract, 256 + 64 tokens, ratio 4, group 128, both clips, no codec rows")
    ap.add_argument("--through-codec", action="store_true",
                    help="serving's path: ratio 4; joint codec, lanes g512 / g128 / g128 with 16 sinks (minmax) of the "
                         "full KV and of the joint codec's decoded KV (joint+...); overrides those options")
    ap.add_argument("--threads", type=int, default=1)
    args = parse(ap, argv)
    if args.smoke:
        args.ratios, args.licenses, args.contracts, args.groups, args.split_groups = [4], [], 1, [128], []
        args.sinks, args.worst = [], []
        args.context, args.continuation = 256, 64
    if args.through_codec:
        args.ratios, args.groups, args.clips, args.split_groups = [4], [512, 128], ["minmax"], []
        args.sinks, args.sinks_groups, args.worst = [16], [128], []
    torch.set_num_threads(args.threads)
    from kite.model import load_model

    t0 = clock()
    lm = load_model(None)
    rows = [measure_document(lm, name, text, args.ratios, args.groups, args.clips, args.split_groups, args.sinks,
                             args.context, args.continuation, codecs=not (args.smoke or args.no_codecs), equal_bytes=not args.no_equal_bytes,
                             one_side=args.one_side, sinks_groups=args.sinks_groups, worst=args.worst,
                             through_codec=args.through_codec)
            for name, text in held_out_docs(args.contracts, args.licenses).items()]
    result = {"platform": platform.platform(), "threads": args.threads,
              "model": lm.fingerprints.combined, "head_dim": lm.geometry.head_dim, "kv_heads": lm.geometry.n_kv_heads,
              "codecs": "pre: settings_for(R, joint_heads=False); joint: settings_for(R); bases the document's own",
              "lanes": "kite.upcycle.codec.lanes.encode(keys post-RoPE, values, k_lanes, v_lanes, group, sinks=1, clip); "
                       "bytes = Lanes.nbytes() (bf16 bases, fp32 tables, bf16 sinks)",
              "argv": list(argv if argv is not None else sys.argv[1:]), "rows": rows, "summary": summarize(rows),
              "seconds": round(clock() - t0, 1)}
    print(table(result), file=sys.stderr if args.json else sys.stdout)
    res = Result("lanes_quality", device="cpu")
    for ratio, s in result["summary"].items():
        for w, m in sorted(s["means"].items(), key=lambda wm: wm[0] != "joint"):
            base = f"{ratio}x joint: mean KL"
            base = base if any(r["name"] == base for r in res.rows) else None
            res.row(f"{ratio}x {w}: mean KL", m["kl"], "nats/token", baseline=base, **m)
    res.raw.update(result)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
