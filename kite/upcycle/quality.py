"""`kite upcycle eval`: what a compression setting loses on the user's own text.

Teacher-forced over the continuation: PPL after the full context and after the state made from
that context, their delta, the mean KL divergence and top-1 agreement of the next-token
distributions against full context, and every byte of the state against the raw fp16 KV.
Both paths score continuation tokens 2..N (the first continuation token is predicted by the
context's last query, which a state does not keep). The task probes (``--probe``: passkeys planted
at depths, several named keys, QA F1 on held-out contracts) ask questions after a state and after
the full context and score the greedy answers.
"""

from __future__ import annotations

import math
import random
import re
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
    probes: dict = field(default_factory=dict)   # probe name -> its result (run_probe)
    timings_ms: dict = field(default_factory=dict)
    spans: dict = field(default_factory=dict)   # the state's spans: count, min_tokens, max_tokens
    regenerator: str | None = None              # the fingerprint of the regenerator the state was coded on
    reader_adapter: bool = False                # the model read the state with its reader adapter on
    ppl_delta_interval: list[float] | None = None   # 95 % of the delta's resamples fall in it (delta_interval)
    warnings: list[str] = field(default_factory=list)   # the state's (CompressResult.warnings)
    recomputed_tokens: int = 0                  # the document's last tokens the load ran through the model

    def to_dict(self) -> dict:
        return asdict(self)


def _score(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each target's NLL [n], the log-probabilities [n, vocab])."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -logp.gather(1, targets.to(logp.device)[:, None]).squeeze(1), logp


INTERVAL_BLOCK = 32        # tokens a resampled block of the continuation holds
INTERVAL_SAMPLES = 2000


def delta_interval(nll_full: torch.Tensor, nll_other: torch.Tensor, level: float = 0.95,
                   block: int = INTERVAL_BLOCK, samples: int = INTERVAL_SAMPLES) -> tuple[float, float]:
    """How far the PPL delta exp(mean ``nll_other``) − exp(mean ``nll_full``) moves with the text
    it is measured on: the central ``level`` of its values over ``samples`` resamples of the
    continuation (the same positions for both, in blocks of ``block`` consecutive tokens, since a
    token's loss tells of its neighbours'), seeded, so the same NLLs give the same interval.
    An interval that holds zero: this continuation cannot tell the two apart."""
    a, b = nll_full.double().cpu(), nll_other.double().cpu()
    n = a.numel()
    if n != b.numel() or n == 0:
        raise ValueError(f"two NLLs of one continuation expected, got {n} and {b.numel()} tokens")
    size = min(block, n)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, n - size + 1, (samples, -(-n // size)), generator=g)
    idx = (starts[:, :, None] + torch.arange(size)).reshape(samples, -1)[:, :n]
    deltas = b[idx].mean(1).exp() - a[idx].mean(1).exp()
    lo, hi = torch.quantile(deltas, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return float(lo), float(hi)


def compare_logits(full: torch.Tensor, other: torch.Tensor, targets: torch.Tensor, *,
                   interval: bool = False) -> dict:
    """PPLs, KL(full‖other) per token and top-1 agreement of two [n, vocab] logit sets; with
    ``interval``, also the PPL delta's 95 % interval over resamples of the continuation
    (``ppl_delta_interval``, :func:`delta_interval`)."""
    nll_full, lp_full = _score(full, targets)
    nll_other, lp_other = _score(other, targets)
    kl = (lp_full.exp() * (lp_full - lp_other)).sum(-1).mean()
    top1 = (full.argmax(-1) == other.argmax(-1)).float().mean()
    out = {"ppl_full": float(nll_full.mean().exp()), "ppl_other": float(nll_other.mean().exp()),
           "kl_mean": float(kl), "top1": float(top1)}
    if interval:
        out["ppl_delta_interval"] = delta_interval(nll_full, nll_other)
    return out


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


PROBES = ("passkey", "keys", "qa")
QA_CONTRACTS = 2    # the held-out contracts the qa probe asks about by default (8 questions each)


def check_probe(probe: str | None) -> tuple[str, ...]:
    """The probes of `probe` (one name or a comma list, e.g. ``passkey,qa``), each once in the order
    given; BadInput unless every name is one :func:`evaluate` knows (checked before any work)."""
    if probe is None:
        return ()
    names = [name.strip() for name in probe.split(",")]
    if not all(name in PROBES for name in names):
        raise BadInput(f"--probe {probe}: expected one of {', '.join(PROBES)} or a comma list of them")
    return tuple(dict.fromkeys(names))


@torch.inference_mode()
def evaluate(lm: LoadedModel, text: str, *, context_tokens: int = 2048, continuation_tokens: int = 512,
             settings: CompressSettings | None = None, tagger=None, probe: str | None = None,
             progress=None, regenerator=None, qa_contracts: int = QA_CONTRACTS) -> EvalResult:
    """The module's measurement of `settings` on `text`; `progress(stage, done, total)` after the
    full-context pass, each prefill chunk and compressed layer of the state, each probe question asked.
    `regenerator`: code the state on it (:func:`compress_document`). A model with a reader adapter
    reads the state with it on (the state is made for it), as generation would. `qa_contracts`: the
    held-out contracts the ``qa`` probe asks about (8 questions each)."""
    probes = check_probe(probe)
    if qa_contracts < 1:
        raise BadInput(f"--qa-contracts {qa_contracts}: expected at least 1")
    settings = settings or CompressSettings()
    ctx, cont = split_text(lm, text, context_tokens, continuation_tokens)
    # the qa probe's contracts made (and a contract the model cannot hold refused) before any work
    qa = {"records": [r for r, _, _ in qa_contexts(lm, context_tokens, contracts=qa_contracts)]} if "qa" in probes else {}
    targets = torch.tensor(cont[1:])
    if progress:
        progress("full context", 0, 1)
    full = full_logits(lm, ctx, cont)
    if progress:
        progress("full context", 1, 1)
    got, made, report, reader_on = state_logits(lm, ctx, cont, settings, tagger=tagger, progress=progress,
                                                regenerator=regenerator)
    m = compare_logits(full, got, targets, interval=True)
    result = EvalResult(
        context_tokens=len(ctx), continuation_tokens=len(cont), codec=settings.codec.name,
        ppl_full=round(m["ppl_full"], 4), ppl_state=round(m["ppl_other"], 4),
        ppl_delta=round(m["ppl_other"] - m["ppl_full"], 4), kl_mean=round(m["kl_mean"], 5),
        top1_agreement=round(m["top1"], 4), state_bytes=made.state_bytes, raw_kv_bytes=made.raw_kv_bytes,
        compression_ratio=round(made.compression_ratio, 3),
        timings_ms={**made.timings_ms, "load": report.load_ms}, spans=made.spans,
        regenerator=regenerator.fingerprint if regenerator is not None else None, reader_adapter=bool(reader_on),
        ppl_delta_interval=[round(x, 4) for x in m["ppl_delta_interval"]], warnings=list(made.warnings),
        recomputed_tokens=report.recomputed_tokens)
    low = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(getattr(lm, "dtype", None))
    if low is not None:
        result.warnings.append(
            f"the model runs in {low}: any change to its prefix, even fp16 storage, moves its KL and PPL by "
            f"rounding noise; `kite upcycle eval --precision fp16` on the same text measures that floor, "
            f"`--dtype fp32` measures without it (docs/compression.md, \"Recomputed tail\")")
    for name in probes:
        result.probes[name] = run_probe(name, lm, text, context_tokens, settings, tagger, progress=progress,
                                        regenerator=regenerator, **(qa if name == "qa" else {}))
    return result


@torch.inference_mode()
def full_logits(lm: LoadedModel, ctx: list[int], cont: list[int], *, cache=None) -> torch.Tensor:
    """The logits of ``cont`` (but its last token) after the full context ``ctx``: the baseline a
    state's continuation is compared with. ``cache``: the model's cache of ``ctx`` already prefilled
    (a capture's, :func:`kite.upcycle.compress.capture_for` with ``keep_cache``), continued here
    rather than prefilling ``ctx`` again; it holds ``cont`` too afterwards."""
    if cache is None:
        cache = new_cache(lm.model)
        forward_tokens(lm.model, ctx, cache, 0)
    return forward_tokens(lm.model, cont, cache, len(ctx))[:-1]


@torch.inference_mode()
def state_logits(lm: LoadedModel, ctx: list[int], cont: list[int], settings: CompressSettings, *, tagger=None,
                 progress=None, regenerator=None, captured=None):
    """``ctx`` compressed into a state by ``settings`` (a temporary file), loaded, and ``cont`` read
    after it: (the logits of ``cont`` but its last token, compress_document's result, the load's
    report, whether a reader adapter read it). ``captured``: ``ctx``'s capture, when the caller codes
    it more than once (:func:`kite.upcycle.compress.capture_for`)."""
    with tempfile.TemporaryDirectory() as tmp:
        state_path = Path(tmp) / "eval.upc"
        made = compress_document(lm, lm.tokenizer.decode(ctx), state_path, settings, tagger=tagger,
                                 progress=progress, ids=ctx, regenerator=regenerator, captured=captured)
        prefix, report = load_prefix(state_path, lm, regenerator=regenerator)
    with _reading(lm, prefix) as reader_on:
        got = forward_tokens(lm.model, cont, new_cache(lm.model, prefix), prefix.next_position)[:-1]
    return got, made, report, reader_on


@torch.inference_mode()
def _reading(lm: LoadedModel, prefix):
    return lm.reading(prefix.reader) if hasattr(lm, "reading") else nullcontext(False)


# ---------------------------------------------------------------- task probes
# Facts stated once in a context, the context compressed without the question, the question asked
# after the state (and, for the baseline, after the full context), the greedy answer scored.

PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)   # the single-key form: one context per depth
KEYS = 3                                     # the several-keys form: this many keys in one context
KEY_LABELS = ("red", "green", "blue", "yellow", "violet", "orange", "white", "black")
QA_SEED = 23    # the held-out contracts' seed (kite.upcycle.study.held_out): no calibration or training draws it
ANSWER_TOKENS = {"passkey": 8, "qa": 16}


def key_depths(keys: int) -> tuple[float, ...]:
    """Where `keys` keys go in one context: the middles of `keys` equal slices of it."""
    return tuple(round((i + 0.5) / keys, 4) for i in range(keys))


def passkey_sentences(label: str | None, key: str) -> tuple[str, str]:
    """The fact stated in the context and the question asked after it (its answer: `key`)."""
    name = f"the {label} passkey" if label else "the passkey"
    return (f"\n{name[0].upper()}{name[1:]} is {key}. Remember it: {key} is {name}.\n",
            f"\nWhat is {name}? {name[0].upper()}{name[1:]} is")


def plant_keys(lm: LoadedModel, ids: list[int], context_tokens: int, depths, labels, rng: random.Random
               ) -> tuple[list[int], list[dict]]:
    """A context of `context_tokens` tokens: the first tokens of `ids` with one passkey fact planted at
    each depth (a fraction of the text around the facts). Returns the context and, per key, its
    depth, label, passkey, token position and question."""
    planted = []
    for depth, label in zip(depths, labels):
        key = str(rng.randint(10000, 99999))
        fact, question = passkey_sentences(label, key)
        planted.append({"depth": depth, "label": label, "passkey": key, "question": question,
                        "fact_ids": lm.tokenizer(fact, add_special_tokens=False)["input_ids"]})
    n_body = context_tokens - sum(len(k["fact_ids"]) for k in planted)
    if n_body < 1:
        raise BadInput(f"--context-tokens {context_tokens} cannot hold {len(planted)} passkey facts and a text")
    if len(ids) < n_body:
        raise BadInput(f"the text has {len(ids)} tokens; a context of {context_tokens} with its passkeys needs {n_body}")
    body = ids[:n_body]
    ctx, at = [], 0
    for k in sorted(planted, key=lambda k: k["depth"]):
        cut = int(len(body) * k["depth"])
        ctx += body[at:cut]
        k["position"] = len(ctx)
        ctx += k.pop("fact_ids")
        at = cut
    return ctx + body[at:], planted


def first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def _state(lm: LoadedModel, ctx: list[int], settings: CompressSettings, tagger, regenerator):
    """The loaded state of `ctx` and the compression ratio its file reached."""
    with tempfile.TemporaryDirectory() as tmp:
        state_path = Path(tmp) / "probe.upc"
        made = compress_document(lm, lm.tokenizer.decode(ctx), state_path, settings, tagger=tagger, ids=ctx,
                                 regenerator=regenerator)
        prefix, _ = load_prefix(state_path, lm, regenerator=regenerator)
    return prefix, made.compression_ratio


def _ask(lm: LoadedModel, ctx: list[int], questions: list[str], settings: CompressSettings, tagger, regenerator,
         max_new_tokens: int, full: bool, step) -> tuple[list[tuple[str | None, str]], float]:
    """Greedy answers to each question after the full context (None when not `full`) and after the
    state of `ctx`; the state's compression ratio."""
    prefix, ratio = _state(lm, ctx, settings, tagger, regenerator)
    out = []
    for q in questions:
        q_ids = lm.tokenizer(q, add_special_tokens=False)["input_ids"]
        from_full = generate(lm, ctx + q_ids, max_new_tokens=max_new_tokens, stop_ids=set()).text if full else None
        out.append((from_full, generate(lm, q_ids, max_new_tokens=max_new_tokens, prefix=prefix,
                                        stop_ids=set()).text))
        step()
    return out, ratio


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 4) if values else None


def _stepper(progress, stage: str, total: int):
    done = [0]

    def step():
        done[0] += 1
        if progress:
            progress(stage, done[0], total)
    return step


def passkey_contexts(lm: LoadedModel, text: str, context_tokens: int, *, keys: int = 1, depths=None,
                     seed: int = 0) -> list[tuple[list[int], list[dict]]]:
    """The contexts :func:`passkey_probe` asks about: (context ids, its planted keys) per context."""
    rng = random.Random(seed)
    ids, _ = tokenize_document(lm.tokenizer, text)
    if keys < 1 or keys > len(KEY_LABELS):
        raise BadInput(f"keys {keys}: expected 1 to {len(KEY_LABELS)}")
    if keys == 1:
        contexts = [((d,), (None,)) for d in (depths or PASSKEY_DEPTHS)]
    else:
        contexts = [(tuple(depths or key_depths(keys)), KEY_LABELS[:keys])]
    if any(len(d) != keys for d, _ in contexts) or not all(0 <= x <= 1 for d, _ in contexts for x in d):
        raise BadInput(f"depths {depths}: expected {keys} fractions between 0 and 1")
    return [plant_keys(lm, ids, context_tokens, depth_set, labels, rng) for depth_set, labels in contexts]


def passkey_probe(lm: LoadedModel, text: str, context_tokens: int, settings: CompressSettings, tagger=None, *,
                  keys: int = 1, depths=None, seed: int = 0, full: bool = True, progress=None,
                  regenerator=None) -> dict:
    """Passkeys planted in `text`'s first `context_tokens` tokens, the context compressed without the
    question, each key asked for after the state (and after the full context unless not `full`).

    ``keys=1`` (the form the field reports): one context per depth of `depths` (default
    :data:`PASSKEY_DEPTHS`), one unnamed key in each. ``keys=N``: one context holding N keys named by
    colour at `depths` (default :func:`key_depths`), each asked by its name. A key is retrieved when
    the first number of the greedy answer is the key. Returns the cases and the accuracies.
    """
    kind = "passkey" if keys == 1 else "keys"
    cases = passkey_contexts(lm, text, context_tokens, keys=keys, depths=depths, seed=seed)
    step = _stepper(progress, kind, sum(len(planted) for _, planted in cases))
    rows, ratios = [], []
    for ctx, planted in cases:
        answers, ratio = _ask(lm, ctx, [k["question"] for k in planted], settings, tagger, regenerator,
                              ANSWER_TOKENS["passkey"], full, step)
        ratios.append(ratio)
        for k, (from_full, from_state) in zip(planted, answers):
            rows.append({"depth": k["depth"], "label": k["label"], "passkey": k["passkey"],
                         "position": k["position"], "context_tokens": len(ctx),
                         "full": None if from_full is None else first_number(from_full) == k["passkey"],
                         "state": first_number(from_state) == k["passkey"],
                         "full_text": None if from_full is None else from_full.strip(),
                         "state_text": from_state.strip()})
    return {"kind": kind, "keys": keys, "cases": rows,
            "full_accuracy": _mean(r["full"] for r in rows), "state_accuracy": _mean(r["state"] for r in rows),
            "compression_ratio": round(sum(ratios) / len(ratios), 3)}


def qa_question(q: dict) -> str:
    """The text asked after a contract for its question record ``q``."""
    return "\n\n" + q["prompt"]


def qa_contexts(lm: LoadedModel, context_tokens: int, *, contracts: int = QA_CONTRACTS, seed: int = QA_SEED,
                records: list[dict] | None = None) -> list[tuple[dict, list[int], list[dict]]]:
    """What :func:`qa_probe` asks about: (contract record, its token ids, its ``qa`` questions) each."""
    from kite.data.contracts import generate_contract

    def n_tokens(s: str) -> int:
        return len(tokenize_document(lm.tokenizer, s)[0])

    if records is None:
        records = [generate_contract(i, context_tokens, seed, n_tokens) for i in range(contracts)]
    out = []
    for record in records:
        ctx, _ = tokenize_document(lm.tokenizer, record["text"])
        limit = lm.geometry.context_length
        if limit and len(ctx) + 64 > limit:
            raise BadInput(f"--probe qa: a held-out contract of {len(ctx)} tokens (for --context-tokens "
                           f"{context_tokens}) and its question exceed the model's context of {limit}")
        out.append((record, ctx, [q for q in record["questions"] if q["family"] == "qa"]))
    return out


def qa_probe(lm: LoadedModel, context_tokens: int, settings: CompressSettings, tagger=None, *,
             contracts: int = QA_CONTRACTS, seed: int = QA_SEED, records: list[dict] | None = None,
             full: bool = True, progress=None, regenerator=None) -> dict:
    """Questions about generated contracts (seed `seed`: by default the held-out contracts), each
    contract of about `context_tokens` tokens compressed without the questions; each question of
    the ``qa`` family asked as its completion prompt after the state (and after the full context
    unless not `full`). Scored as SQuAD: token F1 and exact match of the answer's first line against
    the contract's fact. `records`: these contract records (``id``, ``text``, ``questions``) instead."""
    from kite.data.answers import answer_text, exact_match, f1_score

    cases = qa_contexts(lm, context_tokens, contracts=contracts, seed=seed, records=records)
    step = _stepper(progress, "qa", sum(len(qs) for _, _, qs in cases))
    rows, ratios = [], []
    for record, ctx, questions in cases:
        answers, ratio = _ask(lm, ctx, [qa_question(q) for q in questions], settings, tagger, regenerator,
                              ANSWER_TOKENS["qa"], full, step)
        ratios.append(ratio)
        for q, (from_full, from_state) in zip(questions, answers):
            ref = q["answer"]
            a_full = None if from_full is None else answer_text(from_full)
            a_state = answer_text(from_state)
            rows.append({"contract": record["id"], "context_tokens": len(ctx), "label": q["label"],
                         "prompt": q["prompt"], "reference": ref,
                         "full_answer": a_full, "state_answer": a_state,
                         "full_f1": None if a_full is None else round(f1_score(a_full, ref), 4),
                         "state_f1": round(f1_score(a_state, ref), 4),
                         "full_exact": None if a_full is None else exact_match(a_full, ref),
                         "state_exact": exact_match(a_state, ref)})
    return {"kind": "qa", "cases": rows,
            "full_f1": _mean(r["full_f1"] for r in rows), "state_f1": _mean(r["state_f1"] for r in rows),
            "full_exact": _mean(r["full_exact"] for r in rows), "state_exact": _mean(r["state_exact"] for r in rows),
            "compression_ratio": round(sum(ratios) / len(ratios), 3)}


def run_probe(name: str, lm: LoadedModel, text: str, context_tokens: int, settings: CompressSettings, tagger=None,
              **kw) -> dict:
    """One probe of :data:`PROBES` by name: ``passkey`` (one key, five depths), ``keys``
    (:data:`KEYS` keys in one context of `text`), ``qa`` (held-out contracts; `text` unused)."""
    if name == "passkey":
        return passkey_probe(lm, text, context_tokens, settings, tagger, **kw)
    if name == "keys":
        return passkey_probe(lm, text, context_tokens, settings, tagger, keys=KEYS, **kw)
    if name == "qa":
        return qa_probe(lm, context_tokens, settings, tagger, **kw)
    raise BadInput(f"--probe {name}: expected one of {', '.join(PROBES)}")


def ppl(x: float) -> float:
    return float("nan") if math.isnan(x) else x
