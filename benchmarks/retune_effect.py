"""What the flywheel (`kite upcycle retune`) does to bytes and quality, on the embedded model.

1. Generated contracts (seed 41, ~2K tokens each: its context, then a 384-token continuation) are
   compressed at ``--ratio`` with the default config's tagger into one folder.
2. YOCO's own measurement fills a health store: for every labeled question of a contract (the
   generator's qa and fuzzy families), the gain of loading *that label's clusters* is
   ``kite.yoco.fused.measured_gain`` of the question + its reference answer, with and without them
   (the relative drop of the prompt's NLL, as `kite serve` records it).
3. ``retune`` (the command's library call, default policy but ``--min-loads``) moves each label's
   ratio and re-encodes the states from their stored form.
4. Measured before and after, side by side: every state's bytes, the continuation's PPL delta
   against full-context prefill with the whole state loaded, and each label's measured gain again.
5. The states compressed again from the documents with the new map (``compress`` honouring
   ``label_ratios``): the labels whose ratio went down get their bytes there.

    .venv/bin/python benchmarks/retune_effect.py

Rows: every state's bytes after the retune and recompressed, the state before the retune the
baseline (sizes, no floor); the whole table (ΔPPL, gains) under ``raw``.
"""

from __future__ import annotations

import platform
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.data.contracts import generate_contracts  # noqa: E402
from kite.runtime.cache import new_cache  # noqa: E402
from kite.runtime.generate import forward_tokens  # noqa: E402
from kite.upcycle import (LABEL_RATIOS_FILE, StateFile, compare_logits, load_prefix, open_pipeline,  # noqa: E402
                          read_label_ratios)
from kite.upcycle import full_logits, split_text  # noqa: E402
from kite.yoco.flywheel import RetunePolicy, retune  # noqa: E402
from kite.yoco.fused import measured_gain, prompt_nll  # noqa: E402
from kite.yoco.health import HealthStore  # noqa: E402
from harness import Result, clock, finish, parse, parser  # noqa: E402


def questions(rec: dict) -> list[tuple[str, str]]:
    """(label, text) of the contract's labeled questions with their reference answers."""
    return [(q["label"], f"Question: {q['question']}\nAnswer: {q['prompt']} {q['answer']}")
            for q in rec["questions"] if q["label"] and q["family"] in ("qa", "fuzzy")]


def measure(lm, docs, folder: Path) -> dict:
    """Bytes, PPL delta of the continuation with the whole state, and per (state, label) gains."""
    out = {"states": {}, "gains": {}}
    for d in docs:
        path = folder / f"{d['id']}.upc"
        prefix, _ = load_prefix(path, lm)
        got = forward_tokens(lm.model, d["cont"], new_cache(lm.model, prefix), prefix.next_position)[:-1]
        m = compare_logits(d["full"], got, torch.tensor(d["cont"][1:]))
        with StateFile(path) as st:
            labels = {c["label"] for c in st.meta["clusters"]}
        gains = []
        for label, text in d["questions"]:
            if label not in labels:
                continue
            ids = lm.tokenizer(text)["input_ids"]
            part, _ = load_prefix(path, lm, clusters=[label])
            g = measured_gain(prompt_nll(lm, ids), prompt_nll(lm, ids, part))
            gains.append((label, g))
        out["states"][d["id"]] = {"bytes": path.stat().st_size, "ppl_delta": round(m["ppl_other"] - m["ppl_full"], 4),
                                  "kl": round(m["kl_mean"], 5)}
        out["gains"][d["id"]] = gains
    return out


def per_label(gains: dict) -> dict[str, float]:
    sums: dict[str, list] = {}
    for rows in gains.values():
        for label, g in rows:
            sums.setdefault(label, []).append(g)
    return {k: round(sum(v) / len(v), 5) for k, v in sorted(sums.items())}


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--contracts", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=8.0)
    ap.add_argument("--min-loads", type=int, default=4)
    ap.add_argument("--gain-scale", type=float, default=0.02, help="the health store's gain → health scale")
    ap.add_argument("--threads", type=int, default=2)
    args = parse(ap, argv)
    torch.set_num_threads(args.threads)
    t0 = clock()
    pipe = open_pipeline(None, None, ratio=args.ratio)
    lm = pipe.lm
    docs = []
    for rec in generate_contracts(args.contracts, tokens=2000, seed=41):
        n = len(lm.tokenizer(rec["text"])["input_ids"])
        ctx, cont = split_text(lm, rec["text"], n - 384, 384)
        full = full_logits(lm, ctx, cont)
        docs.append({"id": rec["id"], "ctx": ctx, "cont": cont, "full": full, "questions": questions(rec)})
    with tempfile.TemporaryDirectory() as tmp:
        folder, again = Path(tmp) / "states", Path(tmp) / "again"
        folder.mkdir()
        again.mkdir()
        for d in docs:
            pipe.compress(lm.tokenizer.decode(d["ctx"]), folder / f"{d['id']}.upc", ids=d["ctx"])
        before = measure(lm, docs, folder)
        with HealthStore(Path(tmp) / "health.sqlite", gain_scale=args.gain_scale) as health:
            for sid, rows in before["gains"].items():
                for label, g in rows:
                    health.record(sid, label, g)
            t = clock()
            report = retune(folder, health, policy=RetunePolicy(min_loads=args.min_loads), default_ratio=args.ratio)
            retune_s = clock() - t
        after = measure(lm, docs, folder)
        ratios = read_label_ratios(folder / LABEL_RATIOS_FILE)
        fresh = replace(pipe.settings, label_ratios=ratios)
        for d in docs:
            pipe.compress(lm.tokenizer.decode(d["ctx"]), again / f"{d['id']}.upc", ids=d["ctx"], settings=fresh)
        recompressed = measure(lm, docs, again)
    rows = []
    for d in docs:
        sid = d["id"]
        rows.append({"state": sid, "tokens": len(d["ctx"]),
                     **{f"{k}_{f}": r["states"][sid][f] for k, r in (("before", before), ("retuned", after),
                                                                       ("recompressed", recompressed))
                        for f in ("bytes", "ppl_delta")}})
    result = {
        "platform": platform.platform(), "threads": args.threads,
        "model": lm.fingerprints.combined, "ratio": args.ratio, "gain_scale": args.gain_scale,
        "labels": [d.__dict__ for d in report.labels], "label_ratios": ratios,
        "label_gain_before": per_label(before["gains"]), "label_gain_retuned": per_label(after["gains"]),
        "label_gain_recompressed": per_label(recompressed["gains"]),
        "rows": rows, "retune_seconds": round(retune_s, 2), "seconds": round(clock() - t0, 1)}
    print(table(result), file=sys.stderr if args.json else sys.stdout)
    res = Result("retune_effect", device="cpu")
    for row in rows:
        res.row(f"{row['state']}: bytes before", row["before_bytes"], "B", ppl_delta=row["before_ppl_delta"])
        for k in ("retuned", "recompressed"):
            res.row(f"{row['state']}: bytes {k}", row[f"{k}_bytes"], "B", baseline=f"{row['state']}: bytes before",
                    ppl_delta=row[f"{k}_ppl_delta"])
    res.raw.update(result)
    return finish(res, args)


def table(r: dict) -> str:
    lines = ["| label | loads | mean gain | ratio | gain after retune | gain recompressed |", "|---|---|---|---|---|---|"]
    for d in r["labels"]:
        lab = d["label"]
        lines.append(f"| {lab} | {d['loads']} | {d['mean_gain']:+.4f} | {d['ratio_before']:g}× → {d['ratio_after']:g}× | "
                     f"{r['label_gain_retuned'].get(lab, float('nan')):+.4f} | "
                     f"{r['label_gain_recompressed'].get(lab, float('nan')):+.4f} |")
    lines += ["", "| state | tokens | bytes before → retuned → recompressed | ΔPPL before → retuned → recompressed |",
              "|---|---|---|---|"]
    tot = [0, 0, 0]
    for row in r["rows"]:
        b = [row["before_bytes"], row["retuned_bytes"], row["recompressed_bytes"]]
        tot = [x + y for x, y in zip(tot, b)]
        lines.append(f"| {row['state']} | {row['tokens']} | {b[0]:,} → {b[1]:,} → {b[2]:,} | "
                     f"{row['before_ppl_delta']:+.3f} → {row['retuned_ppl_delta']:+.3f} → {row['recompressed_ppl_delta']:+.3f} |")
    n = len(r["rows"])
    mean = [sum(row[f"{k}_ppl_delta"] for row in r["rows"]) / n for k in ("before", "retuned", "recompressed")]
    lines.append(f"| all | | {tot[0]:,} → {tot[1]:,} ({tot[1] / tot[0]:.3f}) → {tot[2]:,} ({tot[2] / tot[0]:.3f}) | "
                 f"{mean[0]:+.3f} → {mean[1]:+.3f} → {mean[2]:+.3f} (mean) |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
