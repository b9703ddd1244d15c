"""The training report's greedy answers, one at a time (``generate``) against batched (the report's
``greedy_answers``: kite.runtime.batch_decode), on the embedded model (CPU): seconds and whether the texts
are the same.

    .venv/bin/python benchmarks/train_report_answers.py [--threads 2] [--rows 8 16]

Four 1,500-token states of GPL-3 (raw KV of its prefill, as a state loaded exact), four questions
each, answers of 48 tokens (the report's reference length + 8, for 40-token references). Rows: the
batched answers' wall, one at a time's the baseline. Floors (harness.floors.cpu_forward_floor, this CPU's
measured limits): one at a time, every answer's 48 one-row decode steps over its state's KV; batched in
r rows, the answers' steps in groups of r, each step the weights + its rows' KV read once (or its
FLOPs, the larger); the prompts' forwards left out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, finish, parse, parser, wall  # noqa: E402
from harness.floors import cpu_forward_floor  # noqa: E402

QUESTIONS = ("\nQ: What may you do with the program?\nA:", "\nQ: Who holds the copyright?\nA:",
             "\nQ: What must you give recipients?\nA:", "\nQ: When does the license end?\nA:")


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[8])
    ap.add_argument("--license", default="/usr/share/common-licenses/GPL-3")
    args = parse(ap, argv)
    torch.set_num_threads(args.threads)
    from kite.model import load_model
    from kite.runtime.cache import KVPrefix, cache_layers, new_cache
    from kite.runtime.generate import forward_tokens, generate
    from kite.upcycle.train.adapter import Example
    from kite.upcycle.train.report import greedy_answers

    lm = load_model("smollm2-135m", device="cpu")
    text = Path(args.license).read_text(encoding="utf-8")
    examples, prefixes = [], []
    for s in range(4):
        doc = lm.tokenizer(text[s * 8000:s * 8000 + 7000], add_special_tokens=False)["input_ids"][:1500]
        cache = new_cache(lm.model)
        forward_tokens(lm.model, doc, cache, 0)
        layers = cache_layers(cache)
        state = KVPrefix([k[0] for k, _ in layers], [v[0] for _, v in layers], len(doc))
        for q in QUESTIONS:
            examples.append(Example(doc=str(s), prompt_ids=lm.tokenizer(q, add_special_tokens=False)["input_ids"],
                                    response_ids=list(range(100, 140)), teacher_idx=None, teacher_logp=None))
            prefixes.append(state)
    res = Result("train_report_answers", device="cpu")
    with wall() as took:
        alone = [generate(lm, ex.prompt_ids, max_new_tokens=len(ex.response_ids) + 8, prefix=p).text
                 for ex, p in zip(examples, prefixes)]
    new = len(examples[0].response_ids) + 8
    kv = [p.next_position for p in prefixes]

    def answers_floor(rows: int) -> dict:
        """Every answer's `new` decode steps, `rows` answers a step, over their states' KV."""
        text, total = "", 0.0
        for i in range(0, len(examples), rows):
            group = kv[i:i + rows]
            text, ms = cpu_forward_floor(lm, len(group), sum(group), what=f"a step of {len(group)} rows")
            total += new * ms
        return {"floor": f"{-(-len(examples) // rows)} x {new} decode steps, each {text}", "floor_value": total / 1e3}

    base = res.row(f"{len(examples)} answers one at a time", took.s, "s", threads=args.threads, **answers_floor(1))
    for rows in args.rows:
        with wall() as took:
            batched = greedy_answers(lm, prefixes, examples, rows=rows)
        res.row(f"{len(examples)} answers batched, {rows} rows", took.s, "s", baseline=base["name"],
                identical_texts=sum(a == b for a, b in zip(alone, batched)), **answers_floor(rows))
    return finish(res, args)


if __name__ == "__main__":
    sys.exit(main())
