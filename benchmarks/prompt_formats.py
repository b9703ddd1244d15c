"""Which prompt format lets the embedded model answer bench questions from the whole document?

Full prefill only (no state, no baseline: the format must not be tuned on a method being
compared): each generated contract is prefilled once, then every question is asked in each
format, greedy, and the answer scored with token F1 / exact match against its reference, on the
whole generated text and on its first line. Contracts of another seed than the bundled bench set.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/prompt_formats.py --n 3 --seed 3

Formats: `chat` (the question through the chat template, what the bench asked before),
`question` ("\\nQuestion: Q\\nAnswer:"), `question_cloze` ("\\nQuestion: Q\\nAnswer: P"), `cloze`
("\\nP"), where P is the question's completion-style `prompt` (kite.data.contracts).

Rows: each format's mean F1 over every question, `chat`'s the baseline (a quality figure, no floor);
every answer under ``raw``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, clock, finish, parse, parser  # noqa: E402

FORMATS = ("chat", "question", "question_cloze", "cloze")


def format_text(fmt: str, question: str, prompt: str) -> tuple[str, bool]:
    """(text, through the chat template)."""
    if fmt == "chat":
        return question, True
    if fmt == "question":
        return f"\nQuestion: {question}\nAnswer:", False
    if fmt == "question_cloze":
        return f"\nQuestion: {question}\nAnswer: {prompt}", False
    if fmt == "cloze":
        return f"\n{prompt}", False
    raise ValueError(fmt)


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.set_defaults(seed=3)         # the contracts' seed: another than the bundled bench set's
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = parse(ap, argv)

    import torch

    from kite.bench.cases import document_for
    from kite.bench.document import document_ids, prefill_document
    from kite.bench.scoring import exact_match, f1_score
    from kite.data.contracts import generate_contracts
    from kite.model import load_model
    from kite.runtime.generate import encode_prompt, generate

    torch.set_num_threads(args.threads)
    formats = args.formats.split(",")
    lm = load_model(None)
    rows = []
    t0 = clock()
    for rec in generate_contracts(args.n, args.tokens, args.seed):
        by_doc: dict[str, list[dict]] = {}
        for q in rec["questions"]:
            by_doc.setdefault(document_for(rec, q["family"]), []).append(q)
        for doc_text, qs in by_doc.items():
            ids = document_ids(lm, doc_text)
            doc = prefill_document(lm, rec["id"], ids)
            for q in qs:
                for fmt in formats:
                    text, chat = format_text(fmt, q["question"], q["prompt"])
                    p = encode_prompt(lm.tokenizer, text, chat=chat, add_special_tokens=False)
                    g = generate(lm, p, prefix=doc.full, max_new_tokens=args.max_new_tokens,
                                 temperature=0.0)
                    first = g.text.strip().split("\n")[0]
                    rows.append({"contract": rec["id"], "id": q["id"], "family": q["family"],
                                 "format": fmt, "text": g.text, "reference": q["answer"],
                                 "f1": f1_score(g.text, q["answer"]),
                                 "f1_first_line": f1_score(first, q["answer"]),
                                 "em": exact_match(g.text, q["answer"])})
            print(f"{rec['id']}: {len(qs)} questions, {len(ids)} tokens "
                  f"({clock() - t0:.0f} s)", file=sys.stderr, flush=True)
    fams = sorted({r["family"] for r in rows})
    out = sys.stderr if args.json else sys.stdout
    print(f"\nfull-prefill answers, mean F1 (whole text / first line / exact match), "
          f"{len(rows) // len(formats)} questions", file=out)
    print("| format | " + " | ".join(fams) + " | all |", file=out)
    print("|---|" + "---|" * (len(fams) + 1), file=out)
    for fmt in formats:
        cells = []
        for fam in [*fams, None]:
            sel = [r for r in rows if r["format"] == fmt and (fam is None or r["family"] == fam)]
            cells.append(f"{statistics.mean(r['f1'] for r in sel):.3f} / "
                         f"{statistics.mean(r['f1_first_line'] for r in sel):.3f} / "
                         f"{statistics.mean(r['em'] for r in sel):.2f}")
        print(f"| {fmt} | " + " | ".join(cells) + " |", file=out)
    res = Result("prompt_formats", device="cpu")
    for fmt in sorted(formats, key=lambda f: f != "chat"):
        sel = [r for r in rows if r["format"] == fmt]
        base = "chat: mean F1" if "chat" in formats and fmt != "chat" else None
        res.row(f"{fmt}: mean F1", statistics.mean(r["f1"] for r in sel), "F1", baseline=base,
                f1_first_line=statistics.mean(r["f1_first_line"] for r in sel),
                exact_match=statistics.mean(r["em"] for r in sel), questions=len(sel))
    res.raw["answers"] = rows
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
