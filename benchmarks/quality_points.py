"""Upcycle quality on the embedded model: what `kite upcycle eval` measures, per text and setting.

Each cell is one `kite upcycle eval` (kite.upcycle.evaluate through open_pipeline, as the command
runs it): --context-tokens of a text compressed into a state, the next --continuation-tokens scored
on the state against full prefill. Texts: GPL-3 and Apache-2.0 from /usr/share/common-licenses and
one generated contract (kite.data.contracts, --contract-seed, index 0); a text shorter than
context + continuation keeps the continuation and gives the context what is left. Settings:
``ratio=R`` (--ratio R) or a precision preset (--precision int4 ...).

Rows per cell: PPL delta (state - full; its baseline the full-context PPL), KL mean, and the bytes
ratio (raw fp16 KV bytes / state bytes, every byte counted). No timing rows: nothing here has a floor.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, finish, parse, parser  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
TEXTS = ("GPL-3", "Apache-2.0", "contract")


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--texts", nargs="+", default=list(TEXTS), choices=TEXTS)
    ap.add_argument("--settings", nargs="+", default=["ratio=4", "ratio=8", "int4", "int3", "int2"])
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--continuation-tokens", type=int, default=512)
    ap.add_argument("--contract-seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parse(ap, argv)

    import torch

    torch.set_num_threads(args.threads)
    from kite.data.contracts import generate_contract
    from kite.model import load_model
    from kite.upcycle import evaluate, open_pipeline, tokenize_document

    lm = load_model(args.model, device=args.device)
    res = Result("quality_points", device=lm.device)
    res.raw.update(model=lm.spec if hasattr(lm, "spec") else args.model, threads=args.threads,
                   context_tokens=args.context_tokens, continuation_tokens=args.continuation_tokens,
                   contract_seed=args.contract_seed, cells=[])
    need = args.context_tokens + args.continuation_tokens

    def n_tokens(s: str) -> int:
        return len(tokenize_document(lm.tokenizer, s)[0])

    texts = {}
    for name in args.texts:
        if name == "contract":
            texts[name] = generate_contract(0, need + 64, args.contract_seed, n_tokens)["text"]
        else:
            texts[name] = (LICENSES / name).read_text()
    for name, text in texts.items():
        have = n_tokens(text)
        ctx = min(args.context_tokens, have - args.continuation_tokens)
        for spec in args.settings:
            ratio = float(spec[6:]) if spec.startswith("ratio=") else None
            pipe = open_pipeline(None, None, ratio=ratio, precision=None if ratio else spec, lm=lm)
            r = evaluate(pipe.lm, text, context_tokens=ctx, continuation_tokens=args.continuation_tokens,
                         settings=pipe.settings, tagger=pipe.tagger, regenerator=pipe.regenerator)
            cell = f"{name} {r.context_tokens} + {r.continuation_tokens}, {spec}"
            full = res.row(f"{cell}: PPL full context", r.ppl_full, "ppl")
            res.row(f"{cell}: PPL on the state", r.ppl_state, "ppl", baseline=full["name"])
            res.row(f"{cell}: PPL delta", r.ppl_delta, "ppl", setting=spec, text=name)
            res.row(f"{cell}: KL mean", r.kl_mean, "nats", setting=spec, text=name)
            res.row(f"{cell}: bytes ratio", r.raw_kv_bytes / r.state_bytes, "x raw fp16 KV / state",
                    setting=spec, text=name, state_bytes=r.state_bytes, raw_kv_bytes=r.raw_kv_bytes)
            res.raw["cells"].append({"text": name, "setting": spec, **r.to_dict()})
            print(f"{cell}: PPL {r.ppl_full:.3f} -> {r.ppl_state:.3f} (delta {r.ppl_delta:+.4f}), "
                  f"KL {r.kl_mean:.5f}, {r.compression_ratio:.3f}x", flush=True)
    return finish(res, args)


if __name__ == "__main__":
    sys.exit(main())
