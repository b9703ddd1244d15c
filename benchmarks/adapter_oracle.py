"""How much of a state's PPL gap a reader adapter *can* recover on one document: an in-document bound.

The held-out tables measure an adapter trained on other documents. This trains one on the held-out
document itself, on its text *after* the region the table scores (the table reads the first
``min(2048, n - 512)`` tokens as context and scores the next 512; the adapter's contexts are windows
of the rest, every ``--stride`` tokens, each with ``--pairs`` continuation pairs after it), then
measures the table's row with it. Same license, same wording, other sections: the best case for a
reader adapter on that document (for this much data: 52 pairs by default). If it recovers less than
half of the gap, an adapter trained on other documents is unlikely to.

    .venv/bin/python benchmarks/adapter_oracle.py --document GPL-3 --ratio 16 --regenerator REG --run /tmp/oracle

The result is regenerator_quality.py's rows (regen, regen+adapter against the full context's PPL),
written as this benchmark's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kite.data.texts import window_pairs  # noqa: E402
from kite.upcycle.study import CONTINUATION, LICENSES, context_tokens  # noqa: E402
from harness import parse, parser  # noqa: E402


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--document", default="GPL-3", help="a license under /usr/share/common-licenses")
    ap.add_argument("--ratio", type=float, default=16)
    ap.add_argument("--regenerator", type=Path, required=True)
    ap.add_argument("--run", type=Path, required=True, help="the training run's output folder")
    ap.add_argument("--context-tokens", type=int, default=1500)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--response-tokens", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--config", type=Path, help="an upcycle_config.yaml: train in custom mode with its adapter.*")
    args = parse(ap, argv)

    from kite.model import load_model
    from kite.upcycle import tokenize_document

    lm = load_model(None)
    text = (LICENSES / args.document).read_text()
    ids = tokenize_document(lm.tokenizer, text)[0]
    scored_end = context_tokens(len(ids)) + CONTINUATION     # what regenerator_quality.py reads and scores
    pairs = window_pairs(ids[scored_end:], lm.tokenizer.decode, args.context_tokens, args.stride, args.pairs,
                         args.prompt_tokens, args.response_tokens, args.document)
    if not pairs:
        raise SystemExit(f"{args.document}: {len(ids) - scored_end} tokens after the scored region, too few")
    args.run.mkdir(parents=True, exist_ok=True)
    data = args.run.parent / f"{args.run.name}_pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    print(f"{len(pairs)} pairs of {len({p['context'] for p in pairs})} windows after token {scored_end} -> {data}",
          file=sys.stderr, flush=True)
    cmd = [str(ROOT / ".venv/bin/kite"), "upcycle", "train", "--data-path", str(data), "--output-dir",
           str(args.run), "--overwrite", "--eval-fraction", "0", "--epochs", str(args.epochs), "--ratio",
           f"{args.ratio:g}", "--regenerator", str(args.regenerator), "--json"]
    if args.config:
        cmd += ["--mode", "custom", "--config", str(args.config)]
    train = subprocess.run(cmd, capture_output=True, text=True)
    (args.run.parent / f"{args.run.name}_train.json").write_text(train.stdout)
    if train.returncode != 0:
        print(train.stderr[-3000:], file=sys.stderr)
        return train.returncode
    import regenerator_quality

    adapter = json.loads(train.stdout[train.stdout.index("{"):])["adapter"]["folders"][f"{args.ratio:g}"]
    qargs = ["--regenerator", str(args.regenerator), "--adapter", adapter, "--licenses",
             args.document, "--held-out-contracts", "0", "--ratios", f"{args.ratio:g}", "--methods", "regen",
             "regen+adapter"]
    qargs += ["--out", str(args.out)] if args.out else []
    qargs += ["--json"] if args.json else []
    return regenerator_quality.main(qargs, benchmark="adapter_oracle")


if __name__ == "__main__":
    raise SystemExit(main())
