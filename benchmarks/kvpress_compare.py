"""KITE's states beside kvpress's presses at equal bytes, on documents no tuning read.

Per held-out document (GPL-3 and Apache-2.0 from /usr/share/common-licenses; ``--contracts N``
adds the first N held-out generated contracts) and ratio R, one run measures side by side:

* **KITE**: `kite upcycle eval`'s measurement (kite.upcycle.quality.evaluate): the first
  --context-tokens compressed into a ``ratio=R`` state (every byte counted: 1/R of raw fp16 KV),
  loaded, the next --continuation-tokens teacher-forced on it against the full context;
* **kvpress** (NVIDIA's KV-cache compression library, 0.5.5, in its own venv `.venv-kvpress`,
  `make kvpress-env`, since it needs transformers < 5.3): each press keeps 1/R of the context's
  tokens at the KV's own precision (1/R of the bytes), the same continuation scored the same way
  (benchmarks/kvpress_side.py, handed the same token ids and the embedded model's converted folder).

Task probes (``--probes passkey qa``), kite.upcycle.quality's, asked the same way on both sides:
the single-key passkey at 10/30/50/70/90 % depth of --passkey-tokens of GPL-3 (retrieved when the
first number of the greedy answer is the key) and QA token F1 on --qa-contracts held-out contracts;
each context compressed once without its questions, each question asked after it at its true
positions. Rows: KITE's score and each press's, against the full context's (the kvpress side's
full-context score beside it: the two transformers agree).

Rows per (document, R): the PPL delta against the full context of KITE and of each press, with the
press's delta as the baseline of KITE's row (x_baseline < 1: KITE's loss is that fraction of the
press's). Both sides compute the full-context PPL in their own transformers; the result keeps both
(they agree to ~1e-4). Mean rows over the documents close the table. No timing rows: nothing here
has a floor.

``--regenerator DIR`` codes KITE's states on a regenerator (its calibrated bases: what a user who ran
`kite upcycle train` compresses with); its rows are named "KITE (regenerator)" and the result keeps
its fingerprint and calibration.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, finish, held_out_flags, held_out_texts, parse, parser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# query-agnostic presses (a state is made before any question is known) that run on the CPU
# without downloads; SnapKV scores by the context's own last window
PRESSES = ("KnormPress", "StreamingLLMPress", "SnapKVPress", "ExpectedAttentionPress", "TOVAPress",
           "KeyDiffPress", "KVzipPress")


def _against(press: str | None, delta: float | None) -> dict:
    """The best press's delta as a row's baseline, where it is a positive number (a ratio of it means
    something); else the press and its delta beside the row."""
    if press is None:
        return {}
    if delta > 0:
        return {"baseline": f"the best press, {press}", "baseline_value": delta}
    return {"best_press": press, "best_press_delta": delta}


def _asks(lm, args) -> list[dict]:
    """The task probes' contexts and questions (kite.upcycle.quality's), with how each answer scores."""
    from kite.upcycle import ANSWER_TOKENS, passkey_contexts, qa_contexts, qa_question
    from kite.upcycle.study import LICENSES

    def ids(q: str) -> list[int]:
        return lm.tokenizer(q, add_special_tokens=False)["input_ids"]

    asks = []
    if "passkey" in args.probes:
        text = (LICENSES / args.passkey_text).read_text()
        for i, (ctx, planted) in enumerate(passkey_contexts(lm, text, args.passkey_tokens)):
            asks.append({"spec": {"probe": "passkey", "case": i, "context": ctx, "max_new_tokens": ANSWER_TOKENS["passkey"],
                                  "questions": [ids(k["question"]) for k in planted]},
                         "references": [k["passkey"] for k in planted]})
    if "qa" in args.probes:
        for record, ctx, questions in qa_contexts(lm, args.qa_tokens, contracts=args.qa_contracts):
            asks.append({"spec": {"probe": "qa", "case": record["id"], "context": ctx,
                                  "max_new_tokens": ANSWER_TOKENS["qa"],
                                  "questions": [ids(qa_question(q)) for q in questions]},
                         "references": [q["answer"] for q in questions]})
    return asks


def _score(probe: str, text: str, reference: str) -> float:
    from kite.data.answers import answer_text, f1_score
    from kite.upcycle import first_number

    return float(first_number(text) == reference) if probe == "passkey" else f1_score(answer_text(text), reference)


def _kite(regen, weights=None) -> str:
    """KITE's rows' name: its states coded on a regenerator, or with layer weights, are named so."""
    how = [w for w, on in (("regenerator", regen is not None), ("layer weights", weights is not None)) if on]
    return "KITE" if not how else f"KITE ({', '.join(how)})"


def _settings(ratio: float, weights):
    from kite.upcycle import CompressSettings, codec

    return CompressSettings(codec=codec.settings_for(ratio), layer_weights=weights)


def _task_rows(res, lm, args, asks, side, presses, regen, weights) -> None:
    """Per task probe and ratio: KITE's score from its state, each press's, against the full context's."""
    from kite.upcycle import passkey_probe, qa_probe

    text = None
    for probe in [p for p in ("passkey", "qa") if p in args.probes]:
        mine = [a for a in asks if a["spec"]["probe"] == probe]
        metric, unit = ("accuracy", "fraction retrieved") if probe == "passkey" else ("F1", "token F1")
        cell = (f"passkey, 1 key at 5 depths of {args.passkey_tokens} tokens of {args.passkey_text}" if probe == "passkey"
                else f"qa, {args.qa_contracts} held-out contracts of ~{args.qa_tokens} tokens")

        def press_score(press, ratio) -> float:
            scores = []
            for a in mine:
                got = next(x for x in side["answers"] if (x["probe"], x["case"], x["press"], x["ratio"])
                           == (probe, a["spec"]["case"], press, ratio))
                scores += [_score(probe, lm.tokenizer.decode(ids), ref) for ids, ref in zip(got["answers"], a["references"])]
            return round(sum(scores) / len(scores), 4)

        full = None
        for i, ratio in enumerate(args.ratios):
            settings = _settings(ratio, weights)
            if probe == "passkey":
                text = text or (Path("/usr/share/common-licenses") / args.passkey_text).read_text()
                out = passkey_probe(lm, text, args.passkey_tokens, settings, full=i == 0, regenerator=regen)
                state, full_value = out["state_accuracy"], out["full_accuracy"]
            else:
                out = qa_probe(lm, args.qa_tokens, settings, contracts=args.qa_contracts, full=i == 0, regenerator=regen)
                state, full_value = out["state_f1"], out["full_f1"]
            if i == 0:
                full = res.row(f"{cell}: {metric} from the full context", full_value, unit, probe=probe,
                               kvpress_env_full=press_score(None, None))
            base = {"baseline": full["name"]} if full["value"] > 0 else {}
            res.row(f"{cell}, {ratio:g}x: {metric}, {_kite(regen, weights)}", state, unit, probe=probe, ratio=ratio,
                    bytes_ratio=out["compression_ratio"], **base)
            scores = {p: press_score(p, ratio) for p in presses}
            for p, v in scores.items():
                res.row(f"{cell}, {ratio:g}x: {metric}, {p}", v, unit, probe=probe, ratio=ratio, press=p, **base)
            res.raw.setdefault("tasks", []).append({"probe": probe, "ratio": ratio, "kite": out, "presses": scores})
            print(f"{cell}, {ratio:g}x: KITE {state}; " + ", ".join(f"{p} {v}" for p, v in scores.items()), flush=True)


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    held_out_flags(ap, context_tokens=2048, continuation_tokens=512)
    ap.add_argument("--presses", nargs="+", default=list(PRESSES))
    ap.add_argument("--probes", nargs="+", default=["ppl", "passkey", "qa"], choices=["ppl", "passkey", "qa"])
    ap.add_argument("--passkey-text", default="GPL-3", help="the passkeys' text, under /usr/share/common-licenses")
    ap.add_argument("--passkey-tokens", type=int, default=1024, help="context of the passkey probe")
    ap.add_argument("--qa-tokens", type=int, default=1024, help="about this many tokens per QA contract")
    ap.add_argument("--qa-contracts", type=int, default=2)
    ap.add_argument("--layer-weights", type=Path, help="a layer weights file (`kite upcycle weigh`): KITE's states "
                    "allocate their bits by it; its rows are named so")
    ap.add_argument("--regenerator", type=Path,
                    help="code KITE's states on this regenerator folder (`kite upcycle train` makes one; its "
                         "calibration must not have read the documents measured here)")
    ap.add_argument("--kvpress-python", default=str(ROOT / ".venv-kvpress" / "bin" / "python"),
                    help="the python of kvpress's venv (make kvpress-env)")
    args = parse(ap, argv)
    if not Path(args.kvpress_python).exists():
        sys.exit(f"kvpress_compare: {args.kvpress_python} not found: run `make kvpress-env` first")

    import torch

    torch.set_num_threads(args.threads)
    from kite.errors import BadInput
    from kite.model import load_model
    from kite.model.convert import converted_gguf_folder
    from kite.upcycle import Regenerator, evaluate, split_text
    from kite.upcycle.codec import LayerWeights

    lm = load_model(args.model, device=args.device)
    regen = Regenerator.load(args.regenerator) if args.regenerator else None
    weights = LayerWeights.load(args.layer_weights) if args.layer_weights else None
    folder = converted_gguf_folder(lm.source.path) if lm.source.kind in ("embedded", "gguf") else lm.source.path
    texts = held_out_texts(args)

    res = Result("kvpress_compare", device=lm.device)
    res.raw.update(model=args.model or "embedded", threads=args.threads, context_tokens=args.context_tokens,
                   continuation_tokens=args.continuation_tokens, texts=list(texts), kite=[],
                   regenerator=None if regen is None else {"fingerprint": regen.fingerprint, "meta": regen.meta},
                   layer_weights=None if weights is None else {"file": str(args.layer_weights), "meta": weights.meta,
                                                               "fingerprint": weights.fingerprint})

    # kvpress first (its own process), on exactly the token ids KITE scores
    cases, asks = [], _asks(lm, args)
    for name, text in texts.items() if "ppl" in args.probes else ():
        try:
            ctx, cont = split_text(lm, text, args.context_tokens, args.continuation_tokens)
        except BadInput as e:
            sys.exit(f"kvpress_compare: {name}: {e}")
        cases.append({"name": name, "context": ctx, "continuation": cont})
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model": str(folder), "cases": cases, "asks": [a["spec"] for a in asks],
                                    "presses": args.presses, "ratios": args.ratios, "threads": args.threads}))
        subprocess.run([args.kvpress_python, str(ROOT / "benchmarks" / "kvpress_side.py"), str(spec), str(out)],
                       check=True)
        side = json.loads(out.read_text())
    res.raw["kvpress"] = side
    press_delta = {(c["text"], c["ratio"], c["press"]): c["ppl_delta"] for c in side["cells"]}
    presses = [p for p in args.presses if p not in side["skipped"]]

    _task_rows(res, lm, args, asks, side, presses, regen, weights)
    if "ppl" not in args.probes:
        return finish(res, args)
    kite_delta: dict[tuple, float] = {}
    for name, text in texts.items():
        for ratio in args.ratios:
            r = evaluate(lm, text, context_tokens=args.context_tokens, continuation_tokens=args.continuation_tokens,
                         settings=_settings(ratio, weights), regenerator=regen)
            kite_delta[(name, ratio)] = r.ppl_delta
            res.raw["kite"].append({"text": name, "ratio": ratio, **r.to_dict()})
            best = min(presses, key=lambda p: press_delta[(name, ratio, p)]) if presses else None
            cell = f"{name} {r.context_tokens} + {r.continuation_tokens}, {ratio:g}x"
            res.row(f"{cell}: {_kite(regen, weights)} PPL delta", r.ppl_delta, "ppl",
                    **_against(best, None if best is None else press_delta[(name, ratio, best)]), text=name, ratio=ratio, ppl_full=r.ppl_full, bytes_ratio=round(r.raw_kv_bytes / r.state_bytes, 3),
                    kl_mean=r.kl_mean)
            for p in presses:
                c = next(c for c in side["cells"] if (c["text"], c["ratio"], c["press"]) == (name, ratio, p))
                res.row(f"{cell}: {p} PPL delta", c["ppl_delta"], "ppl", text=name, ratio=ratio, press=p,
                        ppl_full=c["ppl_full"], kl_mean=c["kl_mean"], bytes_ratio=c["bytes_ratio"])
            print(f"{cell}: KITE {r.ppl_delta:+.4f} ({r.raw_kv_bytes / r.state_bytes:.2f}x); "
                  + ", ".join(f"{p} {press_delta[(name, ratio, p)]:+.4f}" for p in presses), flush=True)

    for ratio in args.ratios:
        mean = sum(kite_delta[(n, ratio)] for n in texts) / len(texts)
        means = {p: sum(press_delta[(n, ratio, p)] for n in texts) / len(texts) for p in presses}
        best = min(means, key=means.get) if means else None
        res.row(f"mean of {len(texts)} documents, {ratio:g}x: {_kite(regen)} PPL delta", round(mean, 4), "ppl",
                **_against(best, None if best is None else round(means[best], 4)), ratio=ratio)
        for p, m in means.items():
            res.row(f"mean of {len(texts)} documents, {ratio:g}x: {p} PPL delta", round(m, 4), "ppl",
                    ratio=ratio, press=p)
    return finish(res, args)


if __name__ == "__main__":
    sys.exit(main())
