"""`kite upcycle eval`: what a compression setting loses on the user's own text.

Teacher-forced over the continuation: PPL after the full context and after the state made from
that context, their delta, the mean KL divergence and top-1 agreement of the next-token
distributions against full context, and every byte of the state against the raw fp16 KV.
Both paths score continuation tokens 2..N (the first continuation token is predicted by the
context's last query, which a state does not keep).
"""

from __future__ import annotations

import math
import random
import tempfile
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kite.errors import BadInput
from kite.runtime.cache import new_cache
from kite.runtime.generate import forward_tokens, generate
from kite.upcycle.capture import tokenize_document
from kite.upcycle.compress import CompressSettings, compress_document
from kite.upcycle.load import load_prefix

if TYPE_CHECKING:
    from kite.model import LoadedModel


@dataclass
class EvalResult:
    context_tokens: int
    continuation_tokens: int
    codec: str
    ppl_full: float
    ppl_state: float
    ppl_delta: float
    kl_mean: float
    top1_agreement: float
    state_bytes: int
    raw_kv_bytes: int
    compression_ratio: float
    probe: dict | None = None
    timings_ms: dict = field(default_factory=dict)
    spans: dict = field(default_factory=dict)   # the state's spans: count, min_tokens, max_tokens
    regenerator: str | None = None              # the fingerprint of the regenerator the state was coded on
    reader_adapter: bool = False                # the model read the state with its reader adapter on

    def to_dict(self) -> dict:
        return asdict(self)


def _score(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(1, targets.to(logp.device)[:, None]).squeeze(1)
    return float(torch.exp(nll.mean())), logp


def compare_logits(full: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> dict:
    """PPLs, KL(full‖other) per token and top-1 agreement of two [n, vocab] logit sets."""
    ppl_full, lp_full = _score(full, targets)
    ppl_other, lp_other = _score(other, targets)
    kl = (lp_full.exp() * (lp_full - lp_other)).sum(-1).mean()
    top1 = (full.argmax(-1) == other.argmax(-1)).float().mean()
    return {"ppl_full": ppl_full, "ppl_other": ppl_other, "kl_mean": float(kl), "top1": float(top1)}


def split_text(lm: LoadedModel, text: str, context_tokens: int, continuation_tokens: int) -> tuple[list[int], list[int]]:
    ids, _ = tokenize_document(lm.tokenizer, text)
    need = context_tokens + continuation_tokens
    if context_tokens < 1 or continuation_tokens < 2:
        raise BadInput("--context-tokens must be ≥ 1 and --continuation-tokens ≥ 2")
    if len(ids) < need:
        raise BadInput(f"--input has {len(ids)} tokens; --context-tokens {context_tokens} + "
                       f"--continuation-tokens {continuation_tokens} need {need}")
    limit = lm.geometry.context_length
    if limit and need > limit:
        raise BadInput(f"context + continuation ({need} tokens) exceed the model's context of {limit}")
    return ids[:context_tokens], ids[context_tokens:need]


PROBES = ("passkey",)


def check_probe(probe: str | None) -> None:
    """BadInput unless `probe` is None or a probe :func:`evaluate` knows (checked before any work)."""
    if probe is not None and probe not in PROBES:
        raise BadInput(f"--probe {probe}: expected one of {', '.join(PROBES)}")


@torch.inference_mode()
def evaluate(lm: LoadedModel, text: str, *, context_tokens: int = 2048, continuation_tokens: int = 512,
             settings: CompressSettings | None = None, tagger=None, probe: str | None = None,
             progress=None, regenerator=None) -> EvalResult:
    """The module's measurement of `settings` on `text`; `progress(stage, done, total)` after the
    full-context pass, each prefill chunk and compressed layer of the state, each passkey depth.
    `regenerator`: code the state on it (:func:`compress_document`). A model with a reader adapter
    reads the state with it on (the state is made for it), as generation would."""
    check_probe(probe)
    settings = settings or CompressSettings()
    ctx, cont = split_text(lm, text, context_tokens, continuation_tokens)
    targets = torch.tensor(cont[1:])
    if progress:
        progress("full context", 0, 1)
    full_cache = new_cache(lm.model)
    forward_tokens(lm.model, ctx, full_cache, 0)
    full = forward_tokens(lm.model, cont, full_cache, len(ctx))[:-1]
    if progress:
        progress("full context", 1, 1)
    ctx_text = lm.tokenizer.decode(ctx)
    with tempfile.TemporaryDirectory() as tmp:
        state_path = Path(tmp) / "eval.upc"
        made = compress_document(lm, ctx_text, state_path, settings, tagger=tagger, progress=progress,
                                 ids=ctx, regenerator=regenerator)
        prefix, report = load_prefix(state_path, lm, regenerator=regenerator)
    with _reading(lm, prefix) as reader_on:
        got = forward_tokens(lm.model, cont, new_cache(lm.model, prefix), prefix.next_position)[:-1]
    m = compare_logits(full, got, targets)
    result = EvalResult(
        context_tokens=len(ctx), continuation_tokens=len(cont), codec=settings.codec.name,
        ppl_full=round(m["ppl_full"], 4), ppl_state=round(m["ppl_other"], 4),
        ppl_delta=round(m["ppl_other"] - m["ppl_full"], 4), kl_mean=round(m["kl_mean"], 5),
        top1_agreement=round(m["top1"], 4), state_bytes=made.state_bytes, raw_kv_bytes=made.raw_kv_bytes,
        compression_ratio=round(made.compression_ratio, 3),
        timings_ms={**made.timings_ms, "load": report.load_ms}, spans=made.spans,
        regenerator=regenerator.fingerprint if regenerator is not None else None, reader_adapter=bool(reader_on))
    if probe == "passkey":
        result.probe = passkey_probe(lm, text, context_tokens, settings, tagger, progress=progress,
                                     regenerator=regenerator)
    return result


PASSKEY_DEPTHS = (0.05, 0.15, 0.3)


@torch.inference_mode()
def _reading(lm: LoadedModel, prefix):
    return lm.reading(prefix.reader) if hasattr(lm, "reading") else nullcontext(False)


def passkey_probe(lm: LoadedModel, text: str, context_tokens: int, settings: CompressSettings, tagger=None,
                  depths=PASSKEY_DEPTHS, seed: int = 0, progress=None, regenerator=None) -> dict:
    """Plant a passkey early in the context, compress without the question, ask for it.

    Returns retrieval accuracy with full context and from the state (greedy, exact digits).
    """
    rng = random.Random(seed)
    ids, _ = tokenize_document(lm.tokenizer, text)
    rows = []
    for depth in depths:
        key = str(rng.randint(10000, 99999))
        fact = f"\nThe passkey is {key}. Remember it: {key} is the passkey.\n"
        fact_ids = lm.tokenizer(fact, add_special_tokens=False)["input_ids"]
        body = ids[:context_tokens - len(fact_ids)]
        at = int(len(body) * depth)
        ctx = body[:at] + fact_ids + body[at:]
        question = lm.tokenizer("\nWhat is the passkey? The passkey is", add_special_tokens=False)["input_ids"]
        full = generate(lm, ctx + question, max_new_tokens=8, stop_ids=set())
        with tempfile.TemporaryDirectory() as tmp:
            state_path = Path(tmp) / "probe.upc"
            compress_document(lm, lm.tokenizer.decode(ctx), state_path, settings, tagger=tagger, ids=ctx,
                              regenerator=regenerator)
            prefix, _ = load_prefix(state_path, lm, regenerator=regenerator)
        from_state = generate(lm, question, max_new_tokens=8, prefix=prefix, stop_ids=set())
        rows.append({"depth": depth, "passkey": key, "full": key in full.text, "state": key in from_state.text,
                     "full_text": full.text.strip(), "state_text": from_state.text.strip()})
        if progress:
            progress("passkey", len(rows), len(depths))
    return {"kind": "passkey", "cases": rows,
            "full_accuracy": sum(r["full"] for r in rows) / len(rows),
            "state_accuracy": sum(r["state"] for r in rows) / len(rows)}


def ppl(x: float) -> float:
    return float("nan") if math.isnan(x) else x
