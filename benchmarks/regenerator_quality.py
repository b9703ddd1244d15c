"""What the regenerator and the reader adapter buy, on documents neither ever saw (embedded model).

For each held-out document and ratio, `kite upcycle eval`'s measurement (`kite.upcycle.evaluate`:
PPL of the continuation after the state, its delta against full-context prefill, KL, top-1, every
byte of the state) with:

* ``doc``: per-document bases (the codec's default: every state stores its own);
* ``regen``: the regenerator's calibrated bases (states store coefficients, plus a document's own
  basis for the layers and sides where that is expected to pay);
* ``regen+adapter``: the same states read with the reader adapter on (when ``--adapter`` is given);
* ``fp16``: the document's KV stored in fp16 (codec ``fp16``), the least change a stored state makes
  to its prefix: ~0 KL on an fp32 model; on a bf16 model (the GPU path) the rounding noise any change
  of the prefix brings to the continuation's forward (docs/compression.md, "Recomputed tail"), a
  floor no codec goes below.

The regenerator is fitted here on a calibration set (``--calibration``: the training run's
regenerator folder, or fit one from the licenses and generated contracts below, none of them
held out). Held out: GPL-3 and Apache-2.0 (2,048 / 1,712 context tokens + 512) and generated
contracts of seeds the calibration never drew.

    .venv/bin/python benchmarks/regenerator_quality.py
    .venv/bin/python benchmarks/regenerator_quality.py --regenerator RUN/regenerator --adapter RUN/adapter

The per-layer regenerator fitted here is unweighted, as `kite upcycle train` fits it, unless
``--weighted`` (attention-aware distortion, :mod:`kite.upcycle.codec.weights`); one with bases across
layers (``--layer-group``) is always attention-weighted inside each layer and weighs its layers by
``--layer-weights`` when given, as `kite upcycle train --layer-group` fits it with the model's layer
weights. ``--only DOC:RATIO ...`` and ``--methods`` pick rows and columns,
``--calibration-pairs`` fits on a training run's documents instead. Rows: each document, ratio and
method's continuation PPL, the full context's the baseline (quality figures, no floor), with the PPL
delta's 95 % interval over resamples of the continuation; then per ratio and method the mean PPL
delta over the documents (with the largest, whether it is within twice the mean and within twice the
mean the project aims for at that ratio, how many documents lie above twice the mean with their
whole interval, and the mean KL); with ``regen`` and ``regen+tail``, the share of regen's mean KL gap
each tail recovers, above the ``fp16`` column's floor when it was measured (else above 0).
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.data.contracts import generate_contracts  # noqa: E402
from kite.model import load_model  # noqa: E402
from kite.upcycle import (CompressSettings, Regenerator, RegeneratorFit, codec_settings, evaluate,  # noqa: E402
                          tokenize_document)
from kite.upcycle import capture_kv as capture  # noqa: E402
from kite.upcycle.study import (CALIBRATION_LICENSES, CONTINUATION, HELD_OUT, LICENSES,  # noqa: E402
                                   context_tokens, held_out_docs)
from kite.upcycle.codec import LayerWeights, model_value_weights, settings_for  # noqa: E402
from harness import Result, clock, finish, parse, parser  # noqa: E402

METHODS = ("fp16", "doc", "regen", "regen+adapter", "doc+entropy", "regen+entropy", "regen+tail")


WINDOW = 2048       # tokens of a calibration window
# the mean PPL delta on held-out documents the project aims for at each ratio; no document's delta is to
# lie above twice its ratio's (docs/compression.md, "Quality")
TARGET_MEANS = {4: 0.03, 8: 0.15, 16: 0.5, 20: 1.0}


def calibration_windows(lm, n_contracts: int, license_windows: str = "first") -> list[list[int]]:
    """Token ids of each calibration window: the first 2,048 tokens of each calibration license (or,
    with ``license_windows="all"``, each of its 2,048-token windows, a last one of at least 1,024), then
    of ``n_contracts`` generated contracts of seed 1000."""
    out = []
    for name in CALIBRATION_LICENSES:
        ids, _ = tokenize_document(lm.tokenizer, (LICENSES / name).read_text())
        starts = range(0, max(1, len(ids) - WINDOW // 2), WINDOW) if license_windows == "all" else [0]
        out += [ids[a:a + WINDOW] for a in starts]
    for rec in generate_contracts(n_contracts, tokens=2000, seed=1000):
        out.append(tokenize_document(lm.tokenizer, rec["text"])[0][:WINDOW])
    return out


def fit_regenerator(lm, n_contracts: int, weighted: bool = False, layer_group: int = 1,
                    layer_weights: LayerWeights | None = None, license_windows: str = "first") -> Regenerator:
    """Per-layer bases (attention-weighted with ``weighted``), or bases across ``layer_group`` layers,
    which weigh each layer's features by what attention feels of them and each layer by
    ``layer_weights`` when given, as `kite upcycle train --layer-group` fits them."""
    queries = weighted or layer_group > 1
    windows = calibration_windows(lm, n_contracts, license_windows)
    fit = RegeneratorFit(n_layers=lm.geometry.n_layers, layer_group=layer_group)
    for i, ids in enumerate(windows):
        cap = capture(lm, "", ids=ids, queries=queries)
        fit.add(cap.keys_pre, cap.values, cap.ids, query_sq=cap.query_sq if queries else None)
        print(f"calibration {i + 1}/{len(windows)}", file=sys.stderr, flush=True)
    return fit.finish({"model_fingerprint": lm.fingerprints.base, "geometry": lm.geometry.to_dict(),
                       "calibration": {"source": "benchmarks/regenerator_quality.py",
                                       "licenses": list(CALIBRATION_LICENSES), "contracts_seed": 1000,
                                       "contracts": n_contracts, "layer_group": layer_group,
                                       **({"license_windows": "all", "windows": len(windows)}
                                          if license_windows == "all" else {})}},
                      value_weights=model_value_weights(lm) if queries else None,
                      layer_weights=layer_weights if layer_group > 1 else None)


def fit_on_pairs(lm, path: Path, eval_fraction: float, seed: int, weighted: bool) -> Regenerator:
    """A regenerator calibrated as `kite upcycle train` does, on the training split of a pairs file
    (the same documents as that run's, with ``--eval-fraction`` and ``--seed`` as it had them)."""
    from kite.upcycle import read_pairs, split_pairs
    from kite.upcycle.train.run import fit_regenerator as train_fit

    train, _ = split_pairs(read_pairs(path), eval_fraction, seed)
    return train_fit(lm, train, codec_settings(8), weighted=weighted)


def main(argv=None, benchmark: str = "regenerator_quality") -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--model", help="HF folder or .gguf file (default: the embedded model)")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                    help="the model's precision (default: fp32 on a CPU, bf16 on a GPU)")
    ap.add_argument("--ratios", type=float, nargs="*", default=[4, 8, 16])
    ap.add_argument("--regenerator", type=Path, help="a regenerator folder (default: fit one here)")
    ap.add_argument("--adapter", type=Path, help="a reader adapter folder: also measure regen+adapter")
    ap.add_argument("--calibration-contracts", type=int, default=6)
    ap.add_argument("--held-out-contracts", type=int, default=2)
    ap.add_argument("--licenses", nargs="*", default=list(HELD_OUT),
                    help="held-out licenses (none may be a calibration license)")
    ap.add_argument("--clusters", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weighted", action="store_true",
                    help="fit a weighted regenerator (attention-aware distortion); default: unweighted, as "
                         "`kite upcycle train` fits it")
    ap.add_argument("--calibration-pairs", type=Path,
                    help="fit on the training split of this pairs file, as `kite upcycle train` does")
    ap.add_argument("--eval-fraction", type=float, default=0.1, help="with --calibration-pairs: the run's")
    ap.add_argument("--only", nargs="*", metavar="DOC:RATIO",
                    help="measure only these rows (e.g. GPL-3:4 Apache-2.0:16)")
    ap.add_argument("--methods", nargs="*", default=["doc", "regen", "regen+adapter"],
                    choices=list(METHODS), help="fp16: the document's KV stored in fp16 (the floor a bf16 model's "
                    "rounding sets); doc+entropy, regen+entropy: the same states with their codes "
                    "entropy coded (compression.entropy_coding), at the same file ratio; regen+tail: the "
                    "regenerator's states keeping their last --recompute-tokens tokens as ids, recomputed by the load "
                    "(compression.recompute_tokens), at the same file ratio (a column per count)")
    ap.add_argument("--recompute-tokens", type=int, nargs="*", default=[64],
                    help="with --methods regen+tail: the tails measured (default 64)")
    ap.add_argument("--choice", choices=["measured", "expected", "probe"],
                    help="how each side picks the regenerator's basis or the document's (default: the codec's)")
    ap.add_argument("--layer-group", type=int, default=1,
                    help="fit bases over groups of this many adjacent layers (default 1: per layer; the model's "
                         "layer count: one basis for the whole state)")
    ap.add_argument("--license-windows", choices=["first", "all"], default="first",
                    help="calibrate on each calibration license's first 2,048 tokens (default) or on all its "
                    "2,048-token windows")
    ap.add_argument("--save-regenerator", type=Path, help="keep the fitted regenerator in this folder")
    ap.add_argument("--layer-weights", type=Path, help="a layer weights file (`kite upcycle weigh`; the embedded "
                    "model's ships in kite/data/layer_weights): every method's states allocate their bits by it, "
                    "and bases across layers fitted here weigh their layers by it "
                    "(default: the plain allocation)")
    args = parse(ap, argv)      # --seed: with --calibration-pairs, the run's
    if args.weighted and args.layer_group > 1:
        ap.error("--weighted: bases across layers are always attention-weighted (it is for per-layer bases)")
    if any(w < 1 for w in args.recompute_tokens):
        ap.error("--recompute-tokens: tails of 1 token or more")
    weights = LayerWeights.load(args.layer_weights) if args.layer_weights else None
    torch.set_num_threads(args.threads)
    t0 = clock()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    reg = None
    labels = [m for m in METHODS if m in args.methods and m != "regen+tail"] + \
        [f"regen+tail{w}" for w in (args.recompute_tokens if "regen+tail" in args.methods else [])]
    if {"regen", "regen+adapter", "regen+entropy", "regen+tail"} & set(args.methods):     # the doc columns alone need none
        if args.regenerator:
            reg = Regenerator.load(args.regenerator)
        elif args.calibration_pairs:
            reg = fit_on_pairs(lm, args.calibration_pairs, args.eval_fraction, args.seed, args.weighted)
        else:
            reg = fit_regenerator(lm, args.calibration_contracts, weighted=args.weighted, layer_group=args.layer_group,
                                  layer_weights=weights, license_windows=args.license_windows)
        if args.save_regenerator:
            reg.save(args.save_regenerator)
        reg.choice = args.choice
        print(f"regenerator {reg.fingerprint[:21]} weighted={reg.weighted} ({clock() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    reader = load_model(args.model, device=args.device, dtype=args.dtype, adapter=args.adapter) if args.adapter else None
    only = {(o.rsplit(":", 1)[0], float(o.rsplit(":", 1)[1])) for o in args.only} if args.only else None
    rows = []
    if set(args.licenses) & set(CALIBRATION_LICENSES):
        ap.error(f"calibration licenses are not held out: {sorted(set(args.licenses) & set(CALIBRATION_LICENSES))}")
    for name, text in held_out_docs(args.held_out_contracts, args.licenses).items():
        n = len(tokenize_document(lm.tokenizer, text)[0])
        ctx = context_tokens(n)
        fp16 = None         # the fp16 state does not depend on the ratio: measured once a document
        for ratio in args.ratios:
            if only is not None and (name, float(ratio)) not in only:
                continue
            row = {"document": name, "context_tokens": ctx, "ratio": ratio}
            for label in labels:
                if label == "fp16" and fp16 is not None:
                    row[label] = fp16
                    continue
                model = reader if label == "regen+adapter" else lm
                regen = None if label.startswith("doc") or label == "fp16" else reg
                if model is None:
                    continue
                # a regenerator with bases across layers weighs its layers itself
                s = CompressSettings(codec=settings_for("fp16") if label == "fp16" else codec_settings(ratio),
                                     n_clusters=args.clusters,
                                     layer_weights=None if regen is not None and regen.grouped else weights,
                                     entropy_coding=label.endswith("+entropy"),
                                     recompute_tokens=int(label.removeprefix("regen+tail")) if "+tail" in label else 0)
                t1 = clock()
                r = evaluate(model, text, context_tokens=ctx, continuation_tokens=CONTINUATION, settings=s,
                             regenerator=regen)
                row[label] = {"ppl_full": r.ppl_full, "ppl_state": r.ppl_state, "ppl_delta": r.ppl_delta,
                              "ppl_delta_interval": r.ppl_delta_interval, "kl": r.kl_mean,
                              "top1": r.top1_agreement, "compression_ratio": r.compression_ratio,
                              "state_bytes": r.state_bytes, "reader_adapter": r.reader_adapter,
                              "load_ms": r.timings_ms.get("load"),
                              "seconds": round(clock() - t1, 1)}
                if label == "fp16":
                    fp16 = row[label]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    result = {"platform": platform.platform(), "threads": args.threads, "device": str(lm.device), "dtype": str(lm.dtype).removeprefix("torch."),
              "model": lm.fingerprints.combined,
              "regenerator": None if reg is None else {"fingerprint": reg.fingerprint, "weighted": reg.weighted,
                                                       "layer_groups": reg.meta.get("layer_groups"),
                                                       "weights": reg.meta.get("weights"),
                                                       "layer_weights": reg.meta.get("layer_weights"),
                                                       "choice": reg.choice,
                                                       "calibration": reg.meta.get("calibration")},
              "argv": list(argv if argv is not None else sys.argv[1:]),
              "adapter": str(args.adapter) if args.adapter else None,
              "layer_weights": None if weights is None else {"file": str(args.layer_weights), "meta": weights.meta},
              "methods": labels, "rows": rows,
              "seconds": round(clock() - t0, 1)}
    print(table(result), file=sys.stderr if args.json else sys.stdout)
    res = Result(benchmark, device=str(lm.device))
    for r in rows:
        at = f"{r['document']} {r['ratio']:g}x"
        full = next((r[k]["ppl_full"] for k in labels if k in r), None)
        if full is None:
            continue
        res.row(f"{at} full context: PPL", full, "PPL", context_tokens=r["context_tokens"])
        for k in labels:
            if k in r:
                res.row(f"{at} {k}: PPL", r[k]["ppl_state"], "PPL", baseline=f"{at} full context: PPL",
                        **{m: v for m, v in r[k].items() if m != "ppl_state"})
    for ratio in sorted({r["ratio"] for r in rows}):
        at = [r for r in rows if r["ratio"] == ratio]
        mean_rows(res, at, ratio, labels)
        recovery_rows(res, at, ratio, labels)
    res.raw.update(result)
    return finish(res, args)


def mean_rows(res: Result, at: list[dict], ratio: float, labels: list[str]) -> None:
    """Per method: the mean PPL delta over the documents measured at ``ratio``, with the largest, whether
    it lies within twice the mean and within twice the mean the project aims for (TARGET_MEANS), how
    many documents lie above twice the mean with their whole interval (not the continuation's noise),
    and the mean KL."""
    for k in labels:
        got = [r[k] for r in at if k in r]
        if not got:
            continue
        deltas = [g["ppl_delta"] for g in got]
        mean = sum(deltas) / len(deltas)
        target = TARGET_MEANS.get(ratio)
        bound = {} if target is None else {"target_mean": target, "within_twice_the_target": bool(max(deltas) <= 2 * target)}
        res.row(f"mean of {len(got)} documents, {ratio:g}x: {k} PPL delta", round(mean, 4), "ppl",
                largest=round(max(deltas), 4), within_twice_the_mean=bool(max(deltas) <= 2 * abs(mean)),
                above_twice_the_mean_beyond_noise=sum(g["ppl_delta_interval"][0] > 2 * abs(mean) for g in got),
                **bound, kl=round(sum(g["kl"] for g in got) / len(got), 5))


def recovery_rows(res: Result, at: list[dict], ratio: float, labels: list[str]) -> None:
    """Per tail: the share of regen's mean KL gap it recovers, the gap counted above the fp16 state's
    mean KL (the least any stored state costs on this path: a bf16 model's rounding noise) when that
    was measured, else above 0; over the documents measured by regen, the tail and the fp16 state alike."""
    for k in (k for k in labels if k.startswith("regen+tail")):
        both = [r for r in at if k in r and "regen" in r and ("fp16" in r or "fp16" not in labels)]
        if not both:
            continue
        mean = lambda m: sum(r[m]["kl"] for r in both) / len(both)      # noqa: E731
        floor = mean("fp16") if "fp16" in labels else 0.0
        gap = mean("regen") - floor
        if gap <= 0:
            continue
        res.row(f"mean of {len(both)} documents, {ratio:g}x: {k} share of regen's KL gap recovered",
                round((mean("regen") - mean(k)) / gap, 4), "fraction", kl_regen=round(mean("regen"), 5),
                kl_tail=round(mean(k), 5), kl_fp16=round(floor, 5),
                gap_above="the fp16 state's mean KL" if "fp16" in labels else "0 (no fp16 column)")


def table(result: dict) -> str:
    kinds = [k for k in result["methods"] if any(k in r for r in result["rows"])]
    head = "| document | ratio | " + " | ".join(f"{k} ratio · ΔPPL [95 % interval] · KL" for k in kinds) + " |"
    lines = [head, "|---" * (2 + len(kinds)) + "|"]
    for r in result["rows"]:
        cells = [f"{r[k]['compression_ratio']:.2f}× · {r[k]['ppl_delta']:+.3f} [{r[k]['ppl_delta_interval'][0]:+.3f}, "
                 f"{r[k]['ppl_delta_interval'][1]:+.3f}] · {r[k]['kl']:.4f}" if k in r else "" for k in kinds]
        lines.append(f"| {r['document']} ({r['context_tokens']}) | {r['ratio']:g}× | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
