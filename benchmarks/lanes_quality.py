"""What the nibble-lanes resident form (kite/kernels/lanes.py) costs in quality at a ratio (issue 17).

On the embedded model (SmolLM2-135M, CPU), per held-out document (benchmarks/regenerator_quality.py's:
GPL-3, Apache-2.0, generated contracts of seed 23; context min(2048, n - 512) tokens, the next 512
teacher-forced, with benchmarks/post_rope_keys.py's harness), the continuation's PPL delta and KL
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
against the raw fp16 KV, so rows compare at (roughly) equal bytes.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lanes_quality.py --contracts 5 --threads 2 \\
        --json docs/lanes_quality_session11.json
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lanes_quality.py --contracts 1 --groups 128 --clips minmax \\
        --split-groups --sinks --no-equal-bytes --one-side --threads 2 --json docs/lanes_quality_sides_session11.json
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lanes_quality.py --contracts 5 --groups 128 64 256 --clips minmax \\
        --split-groups --sinks 16 --worst 16 64 --sinks-groups 64 128 256 --no-codecs --threads 2 \\
        --json docs/lanes_quality_raw_rows_session11.json
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lanes_quality.py --contracts 5 --through-codec --threads 2 \\
        --json docs/lanes_quality_through_codec_session11.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.post_rope_keys import Document, coded_keys, prepare_document, relative_error  # noqa: E402
from benchmarks.regenerator_quality import held_out_docs  # noqa: E402
from kite.kernels import lanes  # noqa: E402
from kite.upcycle.codec import LANE_CLIPS, encode_lanes  # noqa: E402
from kite.upcycle import codec  # noqa: E402


def lanes_prefix(doc: Document, k_lanes: int, v_lanes: int, group: int, clip: str, sinks: int = 1,
                 worst: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """Every layer of the document in lanes, decoded: (keys post-RoPE, values, byte counts). Bytes:
    ``state_bytes`` is ``Lanes.nbytes()`` summed over layers; ``state_bytes_unique_basis`` counts a
    basis row once per component (a component of 2 lanes has its row twice in ``k_basis`` /
    ``v_basis``); ``state_bytes_fp16_tables``: the weights and constants in fp16. ``worst``: the
    ``sinks`` raw rows are token 0 and the tokens coded worst (:func:`worst_first`), not the first
    ones (the rows come back in the document's order)."""
    keys, values, nbytes, fp16_tables, dup_rows = [], [], 0, 0, 0
    for k, v in zip(doc.keys_post, doc.cap.values):
        idx = None
        if worst:
            idx = worst_first(k, v, k_lanes, v_lanes, group, clip, sinks)[:, :, None].expand_as(k)
            k, v = k.gather(1, idx), v.gather(1, idx)
        x = encode_lanes([k], [v], k_lanes, v_lanes, group=group, sinks=sinks, clip=clip)[0]
        nbytes += x.nbytes()
        fp16_tables += x.nbytes(table_bytes=2)
        for side in "kv":
            basis = getattr(x, f"{side}_basis")[0]                     # [H, R, d]: lane c's component
            dup_rows += sum(int(b.shape[0]) - int(torch.unique(b, dim=0).shape[0]) for b in basis)
        n = x.raw_k.shape[2] + int(x.length[0])
        kd, vd = lanes.decode(x, "k")[0, :, :n].to(k.dtype), lanes.decode(x, "v")[0, :, :n].to(v.dtype)
        if idx is not None:                                                      # back to the document's order
            kd, vd = torch.empty_like(kd).scatter_(1, idx, kd), torch.empty_like(vd).scatter_(1, idx, vd)
        keys.append(kd)
        values.append(vd)
    d = doc.keys_post[0].shape[-1]
    return keys, values, {"state_bytes": nbytes, "state_bytes_unique_basis": nbytes - dup_rows * d * 2,
                          "state_bytes_fp16_tables": fp16_tables}


def worst_first(k: torch.Tensor, v: torch.Tensor, k_lanes: int, v_lanes: int, group: int, clip: str, keep: int
                ) -> torch.Tensor:
    """Per head an order of the T tokens [H, T] whose first ``keep`` (the form's raw rows, kept exact)
    are token 0 and the ``keep - 1`` tokens a first coding codes worst (relative squared error of key
    plus value); the rest in the document's order. Attention reads post-RoPE rows in any order."""
    x = encode_lanes([k], [v], k_lanes, v_lanes, group=group, sinks=1, clip=clip)[0]
    H, T, _ = k.shape
    err = sum((lanes.decode(x, side)[0, :, :T] - t.float()).pow(2).sum(-1) / t.float().pow(2).sum(-1).mean(-1, keepdim=True)
              for side, t in (("k", k), ("v", v)))                             # [H, T]
    err[:, 0] = float("inf")
    top = err.topk(min(keep, T), dim=1).indices.sort(dim=1).values               # [H, keep]
    rest = torch.ones_like(err, dtype=torch.bool).scatter_(1, top, False)
    return torch.cat((top, torch.arange(T).expand(H, T)[rest].view(H, T - top.shape[1])), dim=1)


def lanes_variants(d: int, ratio: float, groups: list[int], clips: list[str], split_groups: list[int],
                   sinks: list[int] = (), sinks_groups: list[int] | None = None, worst: list[int] = ()
                   ) -> list[tuple[str, int, int, int, str, int, bool]]:
    """(label, k_lanes, v_lanes, group, clip, raw rows, worst-first): equal lanes 4 d / R at every
    group and clip (1 sink); the splits (half the lanes on one side) at ``split_groups`` and the first
    clip; at the first clip and ``sinks_groups`` (None: the first group) more exact rows: the first
    tokens (``sinks``, ``_s``) or token 0 and the tokens coded worst (``worst``, ``_w``)."""
    n, c0 = int(round(4 * d / ratio)), clips[0]
    out = [(f"lanes_g{g}_{c}", n, n, g, c, 1, False) for g in groups for c in clips]
    for g in split_groups:
        out += [(f"lanes_k{n // 2}v{n}_g{g}_{c0}", n // 2, n, g, c0, 1, False),
                (f"lanes_k{n}v{n // 2}_g{g}_{c0}", n, n // 2, g, c0, 1, False)]
    for g in groups[:1] if sinks_groups is None else sinks_groups:
        out += [(f"lanes_g{g}_{c0}_s{s}", n, n, g, c0, s, False) for s in sinks]
        out += [(f"lanes_g{g}_{c0}_w{s}", n, n, g, c0, s, True) for s in worst]
    return out


def _cell(doc: Document, m: dict, keys, values, nbytes: int, seconds: float, **extra) -> dict:
    kerr, verr = relative_error(keys, doc.keys_post), relative_error(values, doc.cap.values)
    return {"state_bytes": nbytes, "compression_ratio": round(doc.raw_bytes / nbytes, 3), **extra,
            "ppl": round(m["ppl_other"], 4), "ppl_delta": round(m["ppl_other"] - m["ppl_full"], 4),
            "kl": round(m["kl_mean"], 5), "kl_median": round(m["kl_median"], 5), "kl_max": round(m["kl_max"], 3),
            "top1": round(m["top1"], 4), "key_rel_error_mean": round(sum(kerr) / len(kerr), 4),
            "value_rel_error_mean": round(sum(verr) / len(verr), 4), "seconds": round(seconds, 1)}


def lanes_cells(doc: Document, variants: list[tuple], keys: list[torch.Tensor] | None = None,
                values: list[torch.Tensor] | None = None, prefix: str = "") -> dict:
    """Each lanes variant (:func:`lanes_variants`) of the document's KV, or of ``keys`` (post-RoPE) /
    ``values`` in its place (a codec's decoded KV: lanes on top of it), decoded and scored against the
    full context; cells labelled ``prefix + label``. Errors are against the document's own KV; with
    ``keys`` given, ``lanes_key_rel_error_mean`` / ``lanes_value_rel_error_mean`` are the lanes' own
    (against ``keys`` / ``values``)."""
    src = doc if keys is None else SimpleNamespace(keys_post=keys, cap=SimpleNamespace(values=values))
    out = {}
    for label, kl_, vl_, g, c, sk, w in variants:
        t1 = time.perf_counter()
        k, v, b = lanes_prefix(src, kl_, vl_, g, c, sk, w)
        extra = {}
        if keys is not None:
            ke, ve = relative_error(k, keys), relative_error(v, values)
            extra = {"lanes_key_rel_error_mean": round(sum(ke) / len(ke), 4),
                     "lanes_value_rel_error_mean": round(sum(ve) / len(ve), 4)}
        out[prefix + label] = _cell(doc, doc.score(k, v), k, v, b["state_bytes"], time.perf_counter() - t1,
                                    k_lanes=kl_, v_lanes=vl_, group=g, clip=c, sinks=sk, worst_first=w,
                                    **{n: x for n, x in b.items() if n != "state_bytes"}, **extra)
    return out


@torch.inference_mode()
def measure_document(lm, name: str, text: str, ratios: list[float], groups: list[int], clips: list[str],
                     split_groups: list[int], sinks: list[int] = (), context: int = 2048, continuation: int = 512,
                     codecs: bool = True, equal_bytes: bool = True, one_side: bool = False,
                     sinks_groups: list[int] | None = None, worst: list[int] = (), through_codec: bool = False) -> dict:
    """``through_codec``: the codec rows are the joint codec's only, and every lanes variant is also
    applied to the joint codec's decoded KV (``joint+<variant>``, kite serve --resident lanes' path)."""
    t0 = time.perf_counter()
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
                t1 = time.perf_counter()
                keys, values, nbytes = coded_keys(doc.cap.keys_pre, doc.cap.values, doc.cos, doc.sin, s, "pre",
                                                  s.part_tokens)
                cell[label + suffix] = _cell(doc, doc.score(keys, values), keys, values, nbytes,
                                             time.perf_counter() - t1, codec_ratio=round(r, 3))
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
                t1 = time.perf_counter()
                keys, values, b = lanes_prefix(doc, kl_, vl_, g, c, sk)
                for side, kv in (("keys", (keys, doc.cap.values)), ("values", (doc.keys_post, values))):
                    cell[f"{label}_{side}_only"] = _cell(doc, doc.score(*kv), *kv, b["state_bytes"],
                                                         time.perf_counter() - t1, k_lanes=kl_, v_lanes=vl_,
                                                         group=g, clip=c, sinks=sk)
        if codecs and equal_bytes and not through_codec:          # the codecs at the bytes of the first equal-split lanes variant
            codecs_at(cell[f"lanes_g{groups[0]}_{clips[0]}"]["compression_ratio"], "@lanes")
        row["ratios"][f"{ratio:g}"] = cell
        print(f"{name} {ratio:g}x: " + "; ".join(f"{w} {c['compression_ratio']:.2f}x ΔPPL {c['ppl_delta']:+.3f} "
                                                  f"KL {c['kl']:.4f}" for w, c in cell.items()),
              file=sys.stderr, flush=True)
    row["seconds"] = round(time.perf_counter() - t0, 1)
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    ap.add_argument("--json", type=Path, help="write the result here (atomically)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.ratios, args.licenses, args.contracts, args.groups, args.split_groups = [4], [], 1, [128], []
        args.sinks, args.worst = [], []
        args.context, args.continuation = 256, 64
    if args.through_codec:
        args.ratios, args.groups, args.clips, args.split_groups = [4], [512, 128], ["minmax"], []
        args.sinks, args.sinks_groups, args.worst = [16], [128], []
    torch.set_num_threads(args.threads)
    from kite.model import load_model

    t0 = time.perf_counter()
    lm = load_model(None)
    rows = [measure_document(lm, name, text, args.ratios, args.groups, args.clips, args.split_groups, args.sinks,
                             args.context, args.continuation, codecs=not (args.smoke or args.no_codecs), equal_bytes=not args.no_equal_bytes,
                             one_side=args.one_side, sinks_groups=args.sinks_groups, worst=args.worst,
                             through_codec=args.through_codec)
            for name, text in held_out_docs(args.contracts, args.licenses).items()]
    result = {"machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
              "model": lm.fingerprints.combined, "head_dim": lm.geometry.head_dim, "kv_heads": lm.geometry.n_kv_heads,
              "codecs": "pre: settings_for(R, joint_heads=False); joint: settings_for(R); bases the document's own",
              "lanes": "kite.upcycle.codec.lanes.encode(keys post-RoPE, values, k_lanes, v_lanes, group, sinks=1, clip); "
                       "bytes = Lanes.nbytes() (bf16 bases, fp32 tables, bf16 sinks)",
              "argv": list(argv if argv is not None else sys.argv[1:]), "rows": rows, "summary": summarize(rows),
              "seconds": round(time.perf_counter() - t0, 1)}
    if args.json:
        from kite.atomic import write_text

        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_text(args.json, json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
