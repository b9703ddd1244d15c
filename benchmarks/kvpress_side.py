"""kvpress's presses on the cases `benchmarks/kvpress_compare.py` hands over (run in `.venv-kvpress`).

Imports torch, transformers and kvpress only (kvpress 0.5.5 needs transformers < 5.3; KITE runs on a
newer one), so it reads a plain model folder and token ids and writes plain JSON. Per case (a
context and its continuation, as token ids), press and ratio R: the context prefilled under the
press at ``compression_ratio = 1 - 1/R`` (it keeps 1/R of the tokens, at the KV's own precision:
1/R of the bytes, the same budget as a KITE state at R), then the continuation teacher-forced on the
compressed cache at its true positions (as kvpress's pipeline asks its questions), scored against
the same continuation after the full context: PPL of both, KL(full || press) per token, top-1
agreement -- the formulas of kite.upcycle.quality.compare_logits.

    .venv-kvpress/bin/python benchmarks/kvpress_side.py IN.json OUT.json
"""

from __future__ import annotations

import json
import sys


def _score(logits, targets):
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    nll = -lp.gather(-1, targets[:, None]).squeeze(-1)
    return float(torch.exp(nll.mean())), lp


def _compare(full, other, targets) -> dict:
    ppl_full, lp_full = _score(full, targets)
    ppl_other, lp_other = _score(other, targets)
    kl = (lp_full.exp() * (lp_full - lp_other)).sum(-1).mean()
    top1 = (full.argmax(-1) == other.argmax(-1)).float().mean()
    return {"ppl_full": round(ppl_full, 4), "ppl_press": round(ppl_other, 4),
            "ppl_delta": round(ppl_other - ppl_full, 4), "kl_mean": round(float(kl), 5), "top1": round(float(top1), 4)}


def _continuation_logits(model, cache, cont, position: int):
    import torch

    ids = torch.tensor([cont])
    pos = torch.arange(position, position + len(cont))[None]
    return model(input_ids=ids, past_key_values=cache, position_ids=pos).logits[0, :-1]


def _kept_entries(model, cache) -> int:
    """(layer, KV head, token) entries the compressed cache holds: those it keeps less those a
    head-wise press (KVzip, AdaKV) masks in place (kvpress's attention patch hides them)."""
    total = 0
    for layer, attn in zip(cache.layers, (m.self_attn for m in model.model.layers)):
        total += layer.keys.shape[1] * layer.keys.shape[2]
        masked = getattr(attn, "masked_key_indices", None)
        if masked is not None:
            total -= int(masked[0].numel())
    return total


def _greedy(model, cache, question: list[int], position: int, max_new_tokens: int) -> list[int]:
    """Greedy answer ids to ``question`` asked after the cached context (as kvpress's pipeline asks:
    the question at its true positions), no stop token (kite.upcycle.quality asks the same way); the
    answer's tokens are dropped from the cache after."""
    import torch

    lengths = [layer.keys.shape[2] for layer in cache.layers]
    pos = torch.arange(position, position + len(question))[None]
    logits = model(input_ids=torch.tensor([question]), past_key_values=cache, position_ids=pos).logits
    out = [int(logits[0, -1].argmax())]
    nxt = position + len(question)
    for i in range(max_new_tokens - 1):
        logits = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache,
                       position_ids=torch.tensor([[nxt + i]])).logits
        out.append(int(logits[0, -1].argmax()))
    for layer, n in zip(cache.layers, lengths):
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
    return out


def main(argv: list[str]) -> int:
    import contextlib

    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    spec = json.loads(open(argv[0]).read())
    torch.set_num_threads(int(spec.get("threads", 1)))
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    out = {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
           "transformers": transformers.__version__, "torch": torch.__version__, "cells": [], "skipped": {}}
    with torch.inference_mode():
        for case in spec["cases"]:
            ctx, cont = case["context"], case["continuation"]
            targets = torch.tensor(cont[1:])

            def run(press):
                cache = DynamicCache()
                with press(model) if press is not None else contextlib.nullcontext():
                    model.model(input_ids=torch.tensor([ctx]), past_key_values=cache)
                kept = _kept_entries(model, cache)
                return _continuation_logits(model, cache, cont, len(ctx)), kept, cache

            full, _, full_cache = run(None)
            for name in spec["presses"]:
                for ratio in spec["ratios"]:
                    try:
                        press = getattr(kvpress, name)(compression_ratio=1.0 - 1.0 / ratio)
                        got, kept, _ = run(press)
                    except Exception as e:   # a press this model or version does not take: say which and why
                        out["skipped"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                        break
                    entries = len(ctx) * sum(layer.keys.shape[1] for layer in full_cache.layers)
                    out["cells"].append({"text": case["name"], "press": name, "ratio": ratio,
                                         "context_tokens": len(ctx), "kept_entries": kept, "entries": entries,
                                         "bytes_ratio": round(entries / max(kept, 1), 4),
                                         **_compare(full, got, targets)})
                    print(f"{case['name']} {name} {ratio:g}x: kept {kept}/{entries} entries, "
                          f"delta {out['cells'][-1]['ppl_delta']:+.4f}", flush=True)
        # task probes: each context compressed once per press and ratio, its questions asked after it
        out["answers"] = []
        for ask in spec.get("asks", []):
            ctx = ask["context"]
            for name in [None] + [p for p in spec["presses"] if p not in out["skipped"]]:
                for ratio in [None] if name is None else spec["ratios"]:
                    press = None if name is None else getattr(kvpress, name)(compression_ratio=1.0 - 1.0 / ratio)
                    cache = DynamicCache()
                    with press(model) if press is not None else contextlib.nullcontext():
                        model.model(input_ids=torch.tensor([ctx]), past_key_values=cache)
                    answers = [_greedy(model, cache, q, len(ctx), ask["max_new_tokens"]) for q in ask["questions"]]
                    out["answers"].append({"probe": ask["probe"], "case": ask["case"], "press": name,
                                           "ratio": ratio, "answers": answers})
                print(f"{ask['probe']} {ask['case']} {name}: asked", flush=True)
    open(argv[1], "w").write(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
