"""The codec's byte budget, before and after it spans the whole state: quality and file ratio at equal asked ratio.

Per held-out document (GPL-3 and Apache-2.0 from /usr/share/common-licenses, and with
``--contracts N`` the first N held-out generated contracts of kite.upcycle.study: no calibration,
training or tuning read them) and ratio R, `kite upcycle eval`'s measurement (kite.upcycle.evaluate:
the first --context-tokens compressed into a state through compress_document, loaded with
load_prefix, the next --continuation-tokens teacher-forced on it against the full context), once per
codec variant:

* ``layer``: bits allocated per layer and side (``k_bits`` / ``v_bits`` of every layer, fixed costs
  estimated for parts of ``part_tokens``), parts padded to whole groups of ``group_size`` -- the
  ``ratio=R`` codec before 2026-12-02;
* ``state``: one budget for every layer and side, each component's bits by greedy water-filling on
  its variance relative to its layer side's (optimal for the convex distortion model), the parts'
  costs exact, groups of equal size -- the ``ratio=R`` codec now (kite.upcycle.codec.state_bits).

Clusters: k-means over the hidden states' span means (no tagger), so both variants code the same
parts. ``--device cuda`` compresses with the batched (GPU) encoder: its ``bytes ratio`` rows are the
GPU path's file ratio. Rows per cell: PPL delta (state - full), KL mean and the bytes ratio (raw fp16
KV / every byte of the file). No timing rows: nothing here has a floor.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, finish, held_out_flags, held_out_texts, parse, parser  # noqa: E402

VARIANTS = {"layer": dict(budget="layer", even_groups=False), "state": dict(budget="state", even_groups=True)}


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    held_out_flags(ap, context_tokens=1024, continuation_tokens=256)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parse(ap, argv)

    import torch

    torch.set_num_threads(args.threads)
    from kite.model import load_model
    from kite.upcycle import CompressSettings, evaluate
    from kite.upcycle import codec

    lm = load_model(args.model, device=args.device)
    res = Result("codec_budget", device=lm.device)
    res.raw.update(model=args.model or "embedded", threads=args.threads, context_tokens=args.context_tokens,
                   continuation_tokens=args.continuation_tokens, variants={v: VARIANTS[v] for v in args.variants},
                   cells=[])
    texts = held_out_texts(args)
    res.raw["texts"] = list(texts)
    deltas: dict[tuple, float] = {}
    for name, text in texts.items():
        for ratio in args.ratios:
            for variant in [v for v in VARIANTS if v in args.variants]:   # the baseline first
                s = codec.at_ratio(codec.settings_for(ratio, **VARIANTS[variant]), ratio)
                r = evaluate(lm, text, context_tokens=args.context_tokens,
                             continuation_tokens=args.continuation_tokens, settings=CompressSettings(codec=s))
                cell = f"{name} {r.context_tokens} + {r.continuation_tokens}, ratio={ratio:g}, {variant} budget"
                deltas[(name, ratio, variant)] = r.ppl_delta
                # (a PPL delta may be negative: the other variant's goes beside it, not as a baseline)
                res.row(f"{cell}: PPL delta", r.ppl_delta, "ppl", text=name, ratio=ratio, variant=variant,
                        ppl_full=r.ppl_full, layer_budget_delta=deltas.get((name, ratio, "layer")))
                res.row(f"{cell}: KL mean", r.kl_mean, "nats", text=name, ratio=ratio, variant=variant)
                res.row(f"{cell}: bytes ratio", r.raw_kv_bytes / r.state_bytes, "x raw fp16 KV / state",
                        baseline_value=ratio, baseline=f"the ratio asked, {ratio:g}x", text=name, ratio=ratio,
                        variant=variant, state_bytes=r.state_bytes, raw_kv_bytes=r.raw_kv_bytes)
                res.raw["cells"].append({"text": name, "ratio": ratio, "variant": variant, **r.to_dict()})
                print(f"{cell}: PPL {r.ppl_full:.3f} -> {r.ppl_state:.3f} (delta {r.ppl_delta:+.4f}), "
                      f"KL {r.kl_mean:.5f}, {r.raw_kv_bytes / r.state_bytes:.3f}x", flush=True)
    return finish(res, args)


if __name__ == "__main__":
    sys.exit(main())
