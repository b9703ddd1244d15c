"""`kite upcycle train` per stage, per training state and per training pair, against its targets.

Runs the library's `train_upcycle` (what `kite upcycle train` calls) on the pairs of N generated
contracts of ~2K tokens (`kite data pairs`' generator, lengths counted with the model's tokenizer)
with the model given, one epoch at one ratio, and records each stage as the run's report gives it
(`train_report.json` ``stages``: seconds, count, unit) with the two figures the run is judged by:

* seconds per training state (every stage before the teacher over the states made: the documents'
  prefills, the regenerator's sums and bases, the codec and the state files, the prefixes rebuilt on
  the device), against the target of 0.2 s for a 2K-token document;
* seconds per training pair and epoch of the whole run, and from it 2,000 pairs for one epoch
  (in minutes), against the target of 15 minutes.

After the run its states are loaded again side by side, one at a time (`load_prefix`) and as the run
loads them (`load_prefixes`: their recomputed tails through shared forwards), ms per state each.

    python benchmarks/train_speed.py --model /root/model/smollm2.gguf --device cuda --contracts 167
    python benchmarks/train_speed.py --model smollm2-135m --device cpu --threads 2 --contracts 3
    python benchmarks/train_speed.py --model /root/model/smollm2.gguf --device cuda --pairs pairs.jsonl --keep run

(167 contracts give ~2,000 training pairs after the held-out tenth; ``--pairs`` trains on a pairs
file of any kind instead, e.g. `kite data pairs --texts`' continuation pairs of real documents.) Floors: the per-state row's is
its document's prefill alone (2 x parameters x tokens FLOPs at the device's rate: the GPU table's bf16
rate, or this CPU's measured fp32 matmul rate); the stages' rows have none (each mixes forwards,
codec work, file writes and Python the run does not count apart), and say so.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, clock, cpu_flops_ms, finish, flops_ms, parse, parser  # noqa: E402
from harness.floors import bf16_text, cpu_fp32_text  # noqa: E402

TARGET_STATE_S = 0.2                    # per training state of a 2K-token document
TARGET_PAIRS, TARGET_MIN = 2000, 15.0   # pairs trained for one epoch, in minutes


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m", help="HF folder, .gguf file or embedded name")
    ap.add_argument("--contracts", type=int, default=8)
    ap.add_argument("--pairs", type=Path, help="train on this pairs file (`kite data pairs`) instead of --contracts "
                    "generated contracts")
    ap.add_argument("--tokens", type=int, default=2000, help="tokens per contract (default 2000)")
    ap.add_argument("--pairs-per-document", type=int, default=0,
                    help="keep this many pairs of each document (default 0: all); the states' figures do not "
                    "depend on it, the teacher's and the adapter's work do")
    ap.add_argument("--capture-batch-tokens", type=int, default=None,
                    help="padded tokens a forward of several documents (their prefills, their states' recomputed "
                    "tails) may hold on this device (default: kite.upcycle.FORWARD_BATCH_TOKENS; 0: one document a "
                    "forward)")
    ap.add_argument("--ratio", type=float, default=16.0)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eval-fraction", type=float, default=0.1)
    ap.add_argument("--pairs-per-step", type=int, default=1, help="the adapter's pairs per step (default 1)")
    ap.add_argument("--codec-workers", type=int, default=None,
                    help="host threads coding the states (default: the run's choice, 8 on a GPU, 0 on the CPU)")
    ap.add_argument("--layer-group", type=lambda v: v if v == "auto" else int(v), default=1,
                    help="the regenerator's bases span this many layers, or auto: measured (`kite upcycle train "
                    "--layer-group`; default 1)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    ap.add_argument("--keep", type=Path, help="keep the run folder here (default: a temporary folder)")
    args = parse(ap, argv)
    if args.pairs_per_document < 0 or (args.capture_batch_tokens or 0) < 0:
        ap.error("--pairs-per-document and --capture-batch-tokens take a number >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    from kite.data.pairs import contract_pairs
    from kite.model import load_model
    from kite.upcycle import TrainRequest, UpcycleConfig, read_pairs, train_upcycle

    load_before = os.getloadavg()
    t0 = clock()
    lm = load_model(args.model, device=args.device)
    t_model = clock() - t0
    from kite.upcycle import FORWARD_BATCH_TOKENS

    if args.capture_batch_tokens is not None:
        FORWARD_BATCH_TOKENS[torch.device(lm.device).type] = args.capture_batch_tokens
    batch_tokens = FORWARD_BATCH_TOKENS.get(torch.device(lm.device).type, 0)
    tok = lm.tokenizer
    work = Path(tempfile.mkdtemp(prefix="kite-train-speed-"))
    data = args.pairs or work / "pairs.jsonl"
    if not args.pairs:
        records = contract_pairs(args.contracts, tokens=args.tokens, seed=args.seed,
                                 count_tokens=lambda s: len(tok(s, add_special_tokens=False)["input_ids"]))
        data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    records = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    if args.pairs_per_document:
        seen: Counter = Counter()
        kept = []
        for r in records:
            seen[r["context"]] += 1
            if seen[r["context"]] <= args.pairs_per_document:
                kept.append(r)
        records = kept
        data = work / "pairs-kept.jsonl"
        data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    pairs = read_pairs(data)
    out = args.keep or work / "run"
    req = TrainRequest(data_path=str(data), output_dir=out, ratios=[args.ratio],
                       eval_fraction=args.eval_fraction, epochs=args.epochs, overwrite=True,
                       pairs_per_step=args.pairs_per_step, codec_workers=args.codec_workers,
                       layer_group=args.layer_group)
    report = train_upcycle(lm, pairs, UpcycleConfig(), req)
    docs = sorted({r["context"] for r in records})
    ctx_tokens = [len(tok(d, add_special_tokens=False)["input_ids"]) for d in docs]
    mean_tokens = sum(ctx_tokens) / len(ctx_tokens)
    n_params = sum(p.numel() for p in lm.model.parameters())
    gpu = torch.device(lm.device).type == "cuda"
    prefill_flops = 2 * n_params * mean_tokens
    floor_s = (flops_ms(prefill_flops) if gpu else cpu_flops_ms(prefill_flops)) / 1e3
    floor_text = (f"the document's prefill alone: 2 x {n_params / 1e6:.0f}M parameters x {mean_tokens:.0f} tokens "
                  f"FLOPs {bf16_text() if gpu else cpu_fp32_text()}")

    res = Result("train_speed", device=lm.device)
    why = "a training stage mixes forwards, codec work, file writes and Python the run does not count apart"
    for name, st in report["stages"].items():
        res.row(f"stage {name} ({st['count']} x {st['unit']})", st["seconds"], "s", no_floor=why,
                per_unit_s=st["per_unit_s"], count=st["count"], unit_of=st["unit"])
    speed = report["speed"]
    res.row(f"per training state ({mean_tokens:.0f}-token documents, ratio {args.ratio:g})",
            speed["seconds_per_state"], "s", baseline="target per training state", baseline_value=TARGET_STATE_S,
            floor=floor_text, floor_value=floor_s)
    if speed["seconds_per_pair_epoch"] is not None:
        per_pair = speed["seconds_per_pair_epoch"]
        res.row("whole run per training pair and epoch", per_pair, "s",
                baseline=f"target: {TARGET_PAIRS:,} pairs in {TARGET_MIN:g} min",
                baseline_value=TARGET_MIN * 60 / TARGET_PAIRS, no_floor=why)
        res.row(f"{TARGET_PAIRS:,} pairs for one epoch, at this run's rate", per_pair * TARGET_PAIRS / 60, "min",
                baseline="target", baseline_value=TARGET_MIN, no_floor=why)
    for ratio, h in (report.get("held_out") or {}).items():
        if h.get("gap_recovered") is not None:
            res.row(f"held-out pairs, {ratio}x: share of the state's PPL gap the adapter recovers", h["gap_recovered"],
                    "share", no_floor="a share of a gap", pairs=h["pairs"], ppl_full=h["ppl_full"], ppl_state=h["ppl_state"],
                    ppl_state_adapter=h["ppl_state_adapter"])
    res.row("model load", t_model, "s", no_floor="reading and converting the weights: file and Python work")
    loads = time_loads(lm, out)
    if loads:
        why_load = "a load mixes file reads, the rebuild and the recomputed tail's forward"
        alone = f"the run's {loads['states']} states loaded again, one at a time: per state"
        res.row(alone, loads["alone_ms"], "ms", no_floor=why_load, **loads)
        res.row(f"the same, {loads['together']} a call as the run loads them (their tails together): per state",
                loads["together_ms"], "ms", baseline=alone, no_floor=why_load)
    res.raw.update({
        "model": args.model, "device": str(lm.device), "dtype": str(lm.dtype), "torch_threads": torch.get_num_threads(),
        "contracts": None if args.pairs else args.contracts, "pairs": len(records),
        "pairs_file": {"path": str(args.pairs), "sha256": hashlib.sha256(args.pairs.read_bytes()).hexdigest(),
                       "families": dict(Counter(r.get("meta", {}).get("family", "?") for r in records))}
        if args.pairs else None, "train_pairs": report["train_pairs"],
        "held_out_pairs": report["held_out_pairs"], "context_tokens": {"mean": round(mean_tokens, 1),
                                                                       "min": min(ctx_tokens), "max": max(ctx_tokens)},
        "parameters": n_params, "capture_batch_tokens": batch_tokens,
        "pairs_per_document": args.pairs_per_document or None, "ratio": args.ratio, "epochs": args.epochs, "pairs_per_step": args.pairs_per_step,
        "codec_workers": report.get("codec_workers"), "layer_group": args.layer_group,
        "regenerator": report["regenerator"],
        "stages": report["stages"], "speed": speed, "timings": report["timings"],
        "training": report.get("training"), "held_out": report.get("held_out"),
        "prefix_loads": report.get("prefix_loads"), "adapter": report.get("adapter", {}).get("settings"),
        "targets": {"seconds_per_state": TARGET_STATE_S, "pairs": TARGET_PAIRS, "minutes": TARGET_MIN},
        # the host's 1/5/15-minute load averages before and after (a shared machine slows the run)
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()],
                         "cpus": os.cpu_count()},
    })
    return finish(res, args)


def time_loads(lm, out: Path, rounds: int = 2) -> dict | None:
    """The run's states loaded onto its device side by side, each way ``rounds`` times in turn (the
    better round kept): one at a time (`load_prefix`) and as the run loads them
    (`load_prefixes`, TRAIN_LOAD_TOGETHER a call); ms per state."""
    from kite.upcycle import TRAIN_LOAD_TOGETHER, Regenerator, load_prefix, load_prefixes

    states = sorted((out / "states").glob("*.upc"))
    if not states or not (out / "regenerator").is_dir():
        return None
    reg = Regenerator.load(out / "regenerator")
    gpu = torch.device(lm.device).type == "cuda"
    n = TRAIN_LOAD_TOGETHER

    def timed(load) -> float:
        if gpu:
            torch.cuda.synchronize()
        t = clock()
        load()
        if gpu:
            torch.cuda.synchronize()
        return (clock() - t) * 1e3 / len(states)

    load_prefix(states[0], lm, regenerator=reg)          # (the first load's one-time work)
    alone, together = [], []
    for _ in range(rounds):
        alone.append(timed(lambda: [load_prefix(s, lm, regenerator=reg) for s in states]))
        together.append(timed(lambda: [load_prefixes(states[i:i + n], lm, regenerator=reg)
                                       for i in range(0, len(states), n)]))
    return {"states": len(states), "together": n, "alone_ms": round(min(alone), 3),
            "together_ms": round(min(together), 3), "rounds_alone_ms": [round(x, 3) for x in alone],
            "rounds_together_ms": [round(x, 3) for x in together]}


if __name__ == "__main__":
    raise SystemExit(main())
