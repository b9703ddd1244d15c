"""`kite upcycle train` on contracts and licenses, then the held-out quality table (embedded model).

The training run of docs/PERFORMANCE.md ("Training") saw generated contracts only, and its adapter
did not help on GPL-3 (a license: outside its training distribution). This run adds continuation
pairs from six licenses that are not held out (the calibration licenses of
kite.upcycle.held_out): each license's first ``--context-tokens`` tokens are the
context, and each pair's prompt is the text up to a point after it and its response the next
``--response-tokens`` tokens. The regenerator is calibrated on the same training documents, or given
(``--regenerator DIR``: the adapter then trains on states of the regenerator it is measured with). Then
benchmarks/regenerator_quality.py measures GPL-3, Apache-2.0 and a contract of an unseen seed with
the run's regenerator and adapter.

    .venv/bin/python benchmarks/train_with_licenses.py --run /tmp/run_lic

Each ratio's table is a regenerator_quality.py result, written as this benchmark's (label r<ratio>).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kite.data.contracts import generate_contracts  # noqa: E402
from kite.data.pairs import contract_pairs  # noqa: E402
from kite.upcycle.study import CALIBRATION_LICENSES, LICENSES  # noqa: E402
from harness import parse, parser  # noqa: E402


def continuation_pairs(tokenizer, texts: dict[str, str], context_tokens: int, pairs: int, prompt_tokens: int,
                       response_tokens: int, windows: int = 1) -> list[dict]:
    """Continuation pairs of each text: its first ``windows`` windows of ``context_tokens`` tokens (one
    after another) are contexts; pair i of a context has as prompt the text from the context's end up
    to (i + 1) x ``prompt_tokens`` + i x ``response_tokens`` tokens after it, and as response the next
    ``response_tokens`` tokens."""
    out = []
    step = prompt_tokens + response_tokens
    for name, text in texts.items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for w in range(windows):
            start = w * context_tokens
            ctx = min(context_tokens, len(ids) - start - step)
            if ctx < 256:
                break
            context = tokenizer.decode(ids[start:start + ctx])
            for i in range(pairs):
                p_end = start + ctx + prompt_tokens + i * step
                r_end = p_end + response_tokens
                if r_end > len(ids):
                    break
                out.append({"id": f"{name}/{w}/{i}", "context": context,
                            "prompt": tokenizer.decode(ids[start + ctx:p_end]),
                            "response": tokenizer.decode(ids[p_end:r_end]), "meta": {"family": "continuation"}})
    return out


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--run", type=Path, required=True, help="the training run's output folder")
    ap.add_argument("--contracts", type=int, default=6)
    ap.add_argument("--context-tokens", type=int, default=1500)
    ap.add_argument("--pairs-per-license", type=int, default=6)
    ap.add_argument("--windows-per-license", type=int, default=1,
                    help="contexts a license gives: its first N windows of --context-tokens tokens")
    ap.add_argument("--continuation-contracts", type=int, default=0,
                    help="also continuation pairs (as the licenses') of N generated contracts of seed 2000 "
                    "(the held-out contracts are seed 23, the regenerator's calibration seed 1000)")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--response-tokens", type=int, default=48)
    ap.add_argument("--ratios", type=float, nargs="*", default=[8, 16])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--regenerator", type=Path,
                    help="code the training states with this regenerator (the one the adapter will read) instead "
                    "of fitting one on the training documents")
    args = parse(ap, argv)

    from kite.model import load_model

    lm = load_model(None)
    count = lambda text: len(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    pairs = contract_pairs(args.contracts, 2000, 0, count)
    texts = {name: (LICENSES / name).read_text() for name in CALIBRATION_LICENSES}
    pairs += continuation_pairs(lm.tokenizer, texts, args.context_tokens, args.pairs_per_license,
                                args.prompt_tokens, args.response_tokens, args.windows_per_license)
    if args.continuation_contracts:
        texts = {r["id"]: r["text"] for r in generate_contracts(args.continuation_contracts, 2700, 2000, count)}
        pairs += continuation_pairs(lm.tokenizer, texts, args.context_tokens, args.pairs_per_license,
                                    args.prompt_tokens, args.response_tokens)
    args.run.mkdir(parents=True, exist_ok=True)
    data = args.run.parent / f"{args.run.name}_pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    print(f"{len(pairs)} pairs -> {data}", file=sys.stderr, flush=True)
    kite = str(ROOT / ".venv/bin/kite")
    cmd = [kite, "upcycle", "train", "--data-path", str(data), "--output-dir", str(args.run), "--overwrite",
           "--eval-fraction", "0.17", "--epochs", str(args.epochs), "--json"]
    for r in args.ratios:
        cmd += ["--ratio", f"{r:g}"]
    if args.regenerator:
        cmd += ["--regenerator", str(args.regenerator)]
    train = subprocess.run(cmd, capture_output=True, text=True)
    (args.run.parent / f"{args.run.name}_train.json").write_text(train.stdout)
    if train.returncode != 0:
        print(train.stderr[-3000:], file=sys.stderr)
        return train.returncode
    import regenerator_quality

    folders = json.loads(train.stdout[train.stdout.index("{"):])["adapter"]["folders"]
    for ratio, folder in folders.items():       # each ratio read with its own adapter
        qargs = ["--regenerator", str(args.run / "regenerator"), "--adapter", folder, "--held-out-contracts", "1",
                 "--ratios", ratio]
        if args.out:
            out = args.out if len(folders) == 1 else args.out.with_name(f"{args.out.stem}_r{ratio}{args.out.suffix}")
            qargs += ["--out", str(out)]
        qargs += ["--json"] if args.json else []
        if rc := regenerator_quality.main(qargs, benchmark="train_with_licenses"):
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
