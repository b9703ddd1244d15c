"""Layer weights (`kite upcycle weigh`) against the plain state-wide allocation, on documents no tuning read.

The weights are measured here on calibration documents (``--calibration``: licenses of
kite.upcycle.study's calibration set, plus ``--calibration-contracts`` generated contracts of the
calibration seed) or read from ``--weights FILE``; then, per held-out document (GPL-3, Apache-2.0
and ``--contracts N`` held-out contracts) and ratio, `kite upcycle eval`'s measurement of the
``ratio=R`` state with and without them, side by side in one run: PPL delta and KL against the full
context (the state without weights is each row's baseline), and the file ratio. Mean rows over the
documents close the table. Quality figures: no floor. ``--regenerator DIR``: every state coded on
that regenerator's bases, with and without the weights.

    .venv/bin/python benchmarks/layer_weights.py --contracts 2 --context-tokens 1536 --continuation-tokens 512
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, clock, finish, held_out_flags, held_out_texts, parse, parser  # noqa: E402


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    held_out_flags(ap, context_tokens=1536, continuation_tokens=512)
    ap.add_argument("--weights", type=Path, help="a layer weights file (default: measure them here)")
    ap.add_argument("--calibration", nargs="*", default=["MPL-2.0", "LGPL-2.1"],
                    help="calibration licenses the weights are measured on")
    ap.add_argument("--calibration-contracts", type=int, default=1)
    ap.add_argument("--weigh-ratio", type=float, default=16.0)
    ap.add_argument("--alpha", type=float, default=None, help="default: kite upcycle weigh's")
    ap.add_argument("--regenerator", type=Path, help="code every state (with and without the weights) on this "
                    "regenerator folder; its calibration must not have read the held-out documents")
    args = parse(ap, argv)

    import torch

    torch.set_num_threads(args.threads)
    from kite.data.contracts import generate_contracts
    from kite.model import load_model
    from kite.upcycle import CompressSettings, Regenerator, codec, evaluate, measure_layer_weights
    from kite.upcycle.study import HELD_OUT, LICENSES

    if set(args.calibration) & set(HELD_OUT) or set(args.calibration) & set(args.texts):
        sys.exit("layer_weights: a calibration license is a held-out document")
    lm = load_model(args.model, device=args.device)
    regen = Regenerator.load(args.regenerator) if args.regenerator else None
    res = Result("layer_weights", device=lm.device)
    t0 = clock()
    if args.weights:
        weights = codec.LayerWeights.load(args.weights)
    else:
        cal = {name: (LICENSES / name).read_text() for name in args.calibration}
        cal.update({r["id"]: r["text"] for r in generate_contracts(args.calibration_contracts, tokens=2700, seed=1000)})
        weights = measure_layer_weights(lm, cal, args.weigh_ratio, **({} if args.alpha is None else {"alpha": args.alpha}),
                                              progress=lambda doc, i, n: print(f"weigh {doc} {i}/{n}", file=sys.stderr))
    weigh_s = clock() - t0
    texts = held_out_texts(args)
    res.raw.update(model=args.model or "embedded", threads=args.threads, context_tokens=args.context_tokens,
                   continuation_tokens=args.continuation_tokens, texts=list(texts), weights=weights.to_json(),
                   weights_fingerprint=weights.fingerprint, weigh_seconds=round(weigh_s, 1), cells=[],
                   regenerator=None if regen is None else {"fingerprint": regen.fingerprint, "meta": regen.meta})
    deltas: dict[tuple, float] = {}
    kls: dict[tuple, float] = {}
    for name, text in texts.items():
        for ratio in args.ratios:
            got = {}
            for how, w in (("plain", None), ("weighted", weights)):
                r = evaluate(lm, text, context_tokens=args.context_tokens, continuation_tokens=args.continuation_tokens,
                             settings=CompressSettings(codec=codec.settings_for(ratio), layer_weights=w),
                             regenerator=regen)
                got[how] = r
                deltas[(name, ratio, how)], kls[(name, ratio, how)] = r.ppl_delta, r.kl_mean
                res.raw["cells"].append({"text": name, "ratio": ratio, "how": how, **r.to_dict()})
            cell = f"{name} {got['plain'].context_tokens} + {got['plain'].continuation_tokens}, {ratio:g}x"
            plain = res.row(f"{cell}: KL, plain allocation", got["plain"].kl_mean, "nats", text=name, ratio=ratio)
            res.row(f"{cell}: KL, layer weights", got["weighted"].kl_mean, "nats", baseline=plain["name"], text=name,
                    ratio=ratio)
            res.row(f"{cell}: PPL delta, plain allocation", got["plain"].ppl_delta, "ppl", text=name, ratio=ratio)
            res.row(f"{cell}: PPL delta, layer weights", got["weighted"].ppl_delta, "ppl", text=name, ratio=ratio,
                    bytes_ratio=got["weighted"].compression_ratio)
            print(f"{cell}: PPL delta {got['plain'].ppl_delta:+.4f} -> {got['weighted'].ppl_delta:+.4f}, KL "
                  f"{got['plain'].kl_mean:.4f} -> {got['weighted'].kl_mean:.4f}", flush=True)
    n = len(texts)
    for ratio in args.ratios:
        mean = {how: sum(deltas[(t, ratio, how)] for t in texts) / n for how in ("plain", "weighted")}
        kl = {how: sum(kls[(t, ratio, how)] for t in texts) / n for how in ("plain", "weighted")}
        worst = max(deltas[(t, ratio, "weighted")] for t in texts)
        plain = res.row(f"mean of {n} documents, {ratio:g}x: KL, plain allocation", round(kl["plain"], 5), "nats",
                        ratio=ratio)
        res.row(f"mean of {n} documents, {ratio:g}x: KL, layer weights", round(kl["weighted"], 5), "nats",
                baseline=plain["name"], ratio=ratio)
        res.row(f"mean of {n} documents, {ratio:g}x: PPL delta, plain allocation", round(mean["plain"], 4), "ppl",
                ratio=ratio)
        res.row(f"mean of {n} documents, {ratio:g}x: PPL delta, layer weights", round(mean["weighted"], 4), "ppl",
                ratio=ratio, worst=round(worst, 4))
    return finish(res, args)


if __name__ == "__main__":
    sys.exit(main())
