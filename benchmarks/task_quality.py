"""Task quality of states on the embedded model: what `kite upcycle eval --probe passkey,keys,qa`
measures, at several compression ratios.

- passkey: one key stated once at each of --depths (10/30/50/70/90 % of the context), a context of
  --passkey-tokens tokens of --text (GPL-3: held out, no calibration reads it); asked after the
  state; retrieved when the first number of the greedy answer is the key.
- keys: --keys keys named by colour in one context, each asked by its name.
- qa: --contracts generated contracts of the held-out seed (kite.upcycle.study.held_out), about
  --qa-tokens tokens each; each of a contract's eight clause questions asked as its completion
  prompt; token F1 (SQuAD normalisation) of the answer's first line against the contract's fact.

The full context answers once; each ratio of --ratios makes its states (`kite upcycle eval --ratio
R`: open_pipeline's settings). Rows: the full context's accuracy / F1, each ratio's on the state
with x_baseline = state / full context (no ratio where full context scores 0), and the bytes
ratio the states reached. No timing rows: nothing here has a floor.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, finish, parse, parser  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                    help="the model's precision (default: fp32 on a CPU, bf16 on a GPU)")
    ap.add_argument("--ratios", type=float, nargs="+", default=[4, 8, 16, 20])
    ap.add_argument("--probes", nargs="+", default=["passkey", "keys", "qa"], choices=["passkey", "keys", "qa"])
    ap.add_argument("--text", default="GPL-3", help="the passkeys' text, under /usr/share/common-licenses")
    ap.add_argument("--passkey-tokens", type=int, default=2048, help="context of the passkey and keys probes")
    ap.add_argument("--depths", type=float, nargs="+", default=None, help="default: 0.1 0.3 0.5 0.7 0.9")
    ap.add_argument("--keys", type=int, default=3)
    ap.add_argument("--qa-tokens", type=int, default=2048, help="about this many tokens per contract")
    ap.add_argument("--contracts", type=int, default=6,
                    help="held-out contracts the QA probe asks (8 questions each; default 6: on 2, one answer moves F1 by 0.05-0.08)")
    ap.add_argument("--regenerator", type=Path, help="code the states on this regenerator folder (`kite upcycle "
                    "train` makes one; its calibration must not have read the texts measured here)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--recompute-tokens", type=int, nargs="+", default=[0],
                    help="the states' recomputed tails (compression.recompute_tokens), each measured side by side "
                         "(default 0: none)")
    args = parse(ap, argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from kite.model import load_model
    from kite.upcycle import PASSKEY_DEPTHS, open_pipeline, passkey_probe, qa_probe

    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    text = (LICENSES / args.text).read_text()
    depths = tuple(args.depths) if args.depths else PASSKEY_DEPTHS
    res = Result("task_quality", device=lm.device)
    res.raw.update(model=getattr(lm, "spec", None) or args.model or "embedded", threads=torch.get_num_threads(),
                   dtype=str(lm.dtype).removeprefix("torch."),
                   text=args.text, passkey_tokens=args.passkey_tokens, depths=list(depths), keys=args.keys,
                   qa_tokens=args.qa_tokens, contracts=args.contracts, cells=[],
                   regenerator=str(args.regenerator) if args.regenerator else None,
                   recompute_tokens=args.recompute_tokens)

    def run(probe: str, settings, tagger, regenerator, full: bool) -> dict:
        kw = dict(tagger=tagger, regenerator=regenerator, full=full)
        if probe == "qa":
            return qa_probe(lm, args.qa_tokens, settings, contracts=args.contracts, **kw)
        keys = 1 if probe == "passkey" else args.keys
        return passkey_probe(lm, text, args.passkey_tokens, settings, keys=keys,
                             depths=depths if probe == "passkey" else None, **kw)

    what = {"passkey": (f"passkey, 1 key at {len(depths)} depths, {args.passkey_tokens} tokens", "accuracy",
                        "state_accuracy", "full_accuracy", "fraction retrieved"),
            "keys": (f"keys, {args.keys} in one context of {args.passkey_tokens} tokens", "accuracy",
                     "state_accuracy", "full_accuracy", "fraction retrieved"),
            "qa": (f"qa, {args.contracts} held-out contracts of ~{args.qa_tokens} tokens", "F1", "state_f1", "full_f1",
                   "token F1")}
    full_rows = {}
    cases = [(ratio, tail) for ratio in args.ratios for tail in args.recompute_tokens]
    for i, (ratio, tail) in enumerate(cases):
        pipe = open_pipeline(None, None, ratio=ratio, lm=lm, regenerator=args.regenerator, recompute_tokens=tail)
        state = f"a {ratio:g}x state" + (f" with a {tail}-token recomputed tail" if tail else "")
        for probe in args.probes:
            out = run(probe, pipe.settings, pipe.tagger, pipe.regenerator, full=i == 0)
            cell, metric, state_key, full_key, unit = what[probe]
            if i == 0:
                full_rows[probe] = res.row(f"{cell}: {metric} from the full context", out[full_key], unit, probe=probe)
            base = full_rows[probe]
            res.row(f"{cell}: {metric} from {state}", out[state_key], unit,
                    baseline=base["name"] if base["value"] > 0 else None, probe=probe, ratio=ratio,
                    recompute_tokens=tail, **({"exact_match": out["state_exact"]} if probe == "qa" else {}))
            res.row(f"{cell}: bytes ratio of the {ratio:g}x states" + (f" with a {tail}-token tail" if tail else ""),
                    out["compression_ratio"], "x raw fp16 KV / state", probe=probe, ratio=ratio, recompute_tokens=tail)
            if i == 0 and probe == "qa":
                res.raw["qa_full_exact"] = out["full_exact"]
            res.raw["cells"].append({"probe": probe, "ratio": ratio, "recompute_tokens": tail, **out})
            print(f"{cell} at {ratio:g}x, tail {tail} ({out['compression_ratio']:.2f}x): {metric} state {out[state_key]} "
                  f"full {base['value']}", flush=True)
    return finish(res, args)


if __name__ == "__main__":
    sys.exit(main())
