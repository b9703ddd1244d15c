"""`kite upcycle train` end to end on whatever device there is, with the embedded model's geometry.

The embedded model cannot travel to the GPU machine, so this builds a random-weight Llama of
SmolLM2-135M's geometry (30 layers, 9 heads, 3 KV heads, head_dim 64, hidden 576, vocab 49,152)
with a BPE tokenizer trained on the generated contracts, writes `kite data pairs`' pairs, and runs
the same `train_upcycle` the CLI runs: regenerator, states, teacher, one epoch of the reader
adapter, the held-out report. Random weights say nothing about quality; the figures are times
(each stage, and the adapter's response tokens per second).

    python benchmarks/train_gpu.py [--contracts 8] [--epochs 1]

Rows: each stage's wall time as the run reports it (no baseline; no floor: a training stage mixes
forwards, backwards, codec fits and Python work that the run does not count, so it has no one bound;
each row says so).
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.data.pairs import contract_pairs  # noqa: E402
from harness import Result, clock, finish, parse, parser  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
               vocab_size=49152, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def make_model(folder: Path, texts: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<unk>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    fast.save_pretrained(folder)
    return folder


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--contracts", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--ratio", type=float, default=8.0)
    args = parse(ap, argv)
    from kite.model import load_model
    from kite.upcycle import TrainRequest, UpcycleConfig, read_pairs, train_upcycle

    work = Path(tempfile.mkdtemp(prefix="kite-train-gpu-"))
    records = contract_pairs(args.contracts, tokens=2000, seed=0)
    (work / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    t0 = clock()
    folder = make_model(work / "model", sorted({r["context"] for r in records}))
    lm = load_model(str(folder), device=args.device)
    t_model = clock() - t0
    pairs = read_pairs(work / "pairs.jsonl")
    req = TrainRequest(data_path=str(work / "pairs.jsonl"), output_dir=work / "run", ratios=[args.ratio],
                       eval_fraction=0.25, epochs=args.epochs)
    stages: dict[str, float] = {}

    def progress(stage, done, total):
        name = stage.partition(" · ")[0]
        stages[name] = clock()
        if done == total:
            print(f"{stage} {done}/{total}", flush=True)

    report = train_upcycle(lm, pairs, UpcycleConfig(), req, progress=progress)
    ctx_tokens = [len(lm.tokenizer(r["context"], add_special_tokens=False)["input_ids"]) for r in records[:8]]
    result = {"device": str(lm.device), "platform": platform.platform(), "dtype": str(lm.dtype),
              "pairs": len(records), "context_tokens_sample": ctx_tokens, "model_and_tokenizer_s": round(t_model, 1),
              "timings": report["timings"], "training": report.get("training"),
              "adapter": report.get("adapter", {}).get("settings")}
    res = Result("train_gpu", device=lm.device)
    why = "a training stage mixes forwards, backwards, codec fits and Python work the run does not count"
    res.row("model and tokenizer", t_model, "s", no_floor="building a model and training a tokenizer: Python work")
    for name, value in (report["timings"] or {}).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            res.row(name, value, "s", no_floor=why)
    res.raw.update(result)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
