"""Which power of the measured layer costs (`kite upcycle weigh --alpha`) the allocation should take,
chosen on documents that neither calibrate the weights nor judge them.

The weights are read from ``--weights`` (default: the file KITE ships for the embedded model) and
taken to other powers exactly: a file made at alpha a holds (floored cost)^a normalised to a mean of
1, so alpha b is that to the power b/a, normalised again. Per tuning document (``--tune``: licenses
of /usr/share/common-licenses that are neither calibration nor held-out, plus ``--contracts N``
generated contracts of seed 4242, neither the calibration seed 1000 nor the held-out seed 23) and
ratio, `kite upcycle eval`'s measurement of the state without weights and at each alpha, side by
side in one run: PPL delta and KL against the full context. Mean rows per ratio and alpha close the
table (the state without weights each mean row's baseline). Quality figures: no floor.

    .venv/bin/python benchmarks/layer_weights_alpha.py --threads 2
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, finish, parse, parser  # noqa: E402

TUNE = ["GFDL-1.3", "MPL-1.1"]
TUNE_SEED = 4242


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--weights", type=Path, default=None, help="default: the file KITE ships for the model")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--ratios", type=float, nargs="+", default=[8, 16])
    ap.add_argument("--tune", nargs="*", default=TUNE, help="tuning licenses")
    ap.add_argument("--contracts", type=int, default=2, help=f"tuning contracts (seed {TUNE_SEED})")
    ap.add_argument("--context-tokens", type=int, default=1536)
    ap.add_argument("--continuation-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = parse(ap, argv)

    import torch

    torch.set_num_threads(args.threads)
    from kite.data.contracts import generate_contracts
    from kite.model import load_model
    from kite.upcycle import CompressSettings, codec, evaluate
    from kite.upcycle.study import HELD_OUT, LICENSES

    lm = load_model(args.model, device=args.device)
    if set(args.tune) & (set(HELD_OUT) | {"MPL-2.0", "LGPL-2.1"}):
        sys.exit("layer_weights_alpha: a tuning license calibrates or judges the weights")
    base = codec.LayerWeights.load(args.weights) if args.weights else codec.shipped_for(lm.fingerprints.base)
    if base is None:
        sys.exit("layer_weights_alpha: no weights for this model: give --weights")
    made_at = float(base.meta["alpha"])

    def at(alpha: float) -> codec.LayerWeights:
        k, v = (torch.tensor(w, dtype=torch.float64) ** (alpha / made_at) for w in (base.k, base.v))
        mean = float(torch.cat([k, v]).mean())
        return codec.LayerWeights(tuple((k / mean).tolist()), tuple((v / mean).tolist()), {**base.meta, "alpha": alpha})

    weights = {"without weights": None, **{f"alpha {a:g}": at(a) for a in args.alphas}}
    docs = {name: (LICENSES / name).read_text() for name in args.tune}
    docs.update({r["id"]: r["text"] for r in generate_contracts(args.contracts, tokens=2700, seed=TUNE_SEED)})
    res = Result("layer_weights_alpha", device=lm.device)
    res.raw.update(tune=list(docs), weights={"file": str(args.weights) if args.weights else "shipped",
                                              "fingerprint": base.fingerprint, "alpha": made_at}, cells=[])
    for ratio in args.ratios:
        sums = {name: [0.0, 0.0] for name in weights}
        for doc, text in docs.items():
            for name, w in weights.items():
                r = evaluate(lm, text, context_tokens=args.context_tokens, continuation_tokens=args.continuation_tokens,
                             settings=CompressSettings(codec=codec.settings_for(ratio), layer_weights=w))
                sums[name][0] += r.ppl_delta
                sums[name][1] += r.kl_mean
                res.raw["cells"].append({"doc": doc, "ratio": ratio, "weights": name, "ppl_delta": r.ppl_delta,
                                         "kl_mean": r.kl_mean})
                print(f"{doc} {ratio:g}x {name}: PPL delta {r.ppl_delta:+.4f}, KL {r.kl_mean:.5f}", flush=True)
        n = len(docs)
        plain = f"mean of {n} tuning documents, {ratio:g}x: PPL delta, without weights"
        for name, (ppl, kl) in sums.items():
            cell = f"mean of {n} tuning documents, {ratio:g}x"
            base_row = {} if name == "without weights" else {"baseline": plain}
            res.row(f"{cell}: PPL delta, {name}", round(ppl / n, 4), "ppl", ratio=ratio, **base_row)
            res.row(f"{cell}: KL, {name}", round(kl / n, 6), "nats", ratio=ratio)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
