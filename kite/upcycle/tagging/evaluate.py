"""How well a tagger names clause types: accuracy per label and confusion against ground truth.

Cases are contract records (docs/bench-cases.md) whose `spans` carry the true label. Spans are
embedded standalone (each span's text run alone) and/or in-document (pooled from one prefill of
the whole contract, as the compress pipeline sees them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kite.errors import BadInput
from kite.upcycle.tagging.hidden import hidden_states_at
from kite.upcycle.tagging.tagger import ClauseTagger, TagResult

MODES = ("standalone", "in_document", "both")


def evaluate_tagging(model, tokenizer, cases: Sequence[dict], examples: Sequence[tuple[str, str]],
                     *, tagger: ClauseTagger | None = None, mode: str = "standalone",
                     progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Fit a tagger on `examples` (unless `tagger` is given) and score every span of `cases`.

    Returns {"labels", "method", "embedding_layers", "validation", "examples", "fit_s",
    then per mode ("standalone" / "in_document"): {"n", "correct", "accuracy", "per_label":
    {label: {n, correct, accuracy}}, "confusion": {true: {predicted: count}},
    "mean_confidence", "mean_confidence_correct", "mean_confidence_wrong", "s"}}.
    `progress(stage, done, total)`: standalone as one step, in-document after each contract.
    """
    if mode not in MODES:
        raise BadInput(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    truth = [(c, s) for c in cases for s in c.get("spans", [])]
    if not truth:
        raise BadInput("no labeled spans in the cases to score")
    t0 = time.perf_counter()
    if tagger is None:
        tagger = ClauseTagger.fit(model, tokenizer, examples)
    fit_s = time.perf_counter() - t0
    unknown = sorted({s["label"] for _, s in truth} - set(tagger.labels))
    if unknown:
        raise BadInput(f"cases use label {unknown[0]!r}, which no example has "
                       f"(examples: {', '.join(tagger.labels)})")
    report: dict[str, Any] = {"labels": tagger.labels, "method": tagger.method,
                              "embedding_layers": tagger.embedding_layers,
                              "temperature": tagger.temperature,
                              "validation": {k: v for k, v in tagger.validation.items()
                                             if k != "trials"},
                              "examples": len(examples), "cases": len(cases),
                              "fit_s": round(fit_s, 2)}
    y = [s["label"] for _, s in truth]
    if mode in ("standalone", "both"):
        t0 = time.perf_counter()
        texts = [c["text"][s["start"]:s["end"]] for c, s in truth]
        if progress:
            progress("standalone", 0, 1)
        preds = tagger.tag_texts(model, tokenizer, texts)
        if progress:
            progress("standalone", 1, 1)
        report["standalone"] = _score(y, preds, tagger.labels, time.perf_counter() - t0)
    if mode in ("in_document", "both"):
        if tagger.method == "prompt":
            raise BadInput("in-document pooling needs an embedding tagger; this one scores prompts")
        t0 = time.perf_counter()
        preds = []
        for k, case in enumerate(cases):
            E = embed_spans_in_document(tagger, model, tokenizer, case["text"], case["spans"])
            preds.extend(tagger.predict_embeddings(E))
            if progress:
                progress("in-document", k + 1, len(cases))
        report["in_document"] = _score(y, preds, tagger.labels, time.perf_counter() - t0)
    return report


def char_spans_to_token_spans(offsets: Sequence[tuple[int, int]],
                              spans: Sequence[dict]) -> list[tuple[int, int]]:
    """Token (start, end) of each char span {start, end}: the tokens overlapping it."""
    out = []
    for sp in spans:
        toks = [i for i, (a, b) in enumerate(offsets)
                if b > a and a < sp["end"] and b > sp["start"]]
        if not toks:
            raise BadInput(f"span [{sp['start']}, {sp['end']}) covers no token")
        out.append((toks[0], toks[-1] + 1))
    return out


def embed_spans_in_document(tagger: ClauseTagger, model, tokenizer, text: str,
                            spans: Sequence[dict]) -> torch.Tensor:
    """One prefill of `text` (only up to the tagger's deepest layer), spans pooled: [n, D]."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and len(ids) > limit:
        raise BadInput(f"document of {len(ids)} tokens is past the model's context of {limit}")
    device = next(model.parameters()).device
    hs = hidden_states_at(model, torch.tensor([ids], device=device), None, tagger.embedding_layers)
    token_spans = char_spans_to_token_spans(enc["offset_mapping"], spans)
    return tagger.pool_spans(hs, token_spans)


def _score(y: list[str], preds: list[TagResult], labels: list[str], seconds: float) -> dict:
    per = {lab: {"n": 0, "correct": 0} for lab in labels}
    confusion = {lab: {p: 0 for p in labels} for lab in labels}
    conf_ok, conf_bad = [], []
    for truth, p in zip(y, preds):
        per[truth]["n"] += 1
        per[truth]["correct"] += int(p.label == truth)
        confusion[truth][p.label] += 1
        (conf_ok if p.label == truth else conf_bad).append(p.confidence)
    for v in per.values():
        v["accuracy"] = round(v["correct"] / v["n"], 4) if v["n"] else None
    correct = len(conf_ok)

    def mean(xs):
        return round(sum(xs) / len(xs), 4) if xs else None

    return {"n": len(y), "correct": correct, "accuracy": round(correct / len(y), 4),
            "per_label": per, "confusion": confusion,
            "mean_confidence": mean(conf_ok + conf_bad), "mean_confidence_correct": mean(conf_ok),
            "mean_confidence_wrong": mean(conf_bad), "s": round(seconds, 2)}


def evaluate_queries(model, tokenizer, tagger: ClauseTagger,
                     records: Sequence[dict]) -> dict[str, Any]:
    """How the tagger labels questions: `records` are `{"query", "family", "label"}` (label None:
    about no single clause type, where the right answer is no label, "").

    Scores the query head (`predict_queries`) and, for comparison, the clause head alone (what
    taggers did before query calibration; it always names a label). Per family and overall:
    n, accuracy, mean and median label entropy (bits), mean confidence, share given no label.
    """
    from dataclasses import replace

    if not records:
        raise BadInput("no queries to score")
    texts = [r["query"] for r in records]
    heads = {"clause_head": replace(tagger, query_head=None)}
    if tagger.query_head is not None:
        heads["query_head"] = tagger
    out: dict[str, Any] = {"n": len(records)}
    for name, t in heads.items():
        if t.method == "prompt" and t.query_head is None:
            preds = t.tag_texts(model, tokenizer, texts)
        else:
            preds = t.tag_queries(model, tokenizer, texts)
        fams: dict[str, list[tuple[dict, TagResult]]] = {}
        for r, p in zip(records, preds):
            fams.setdefault(str(r.get("family", "all")), []).append((r, p))
        fams["all"] = list(zip(records, preds))
        out[name] = {fam: _query_stats(rows) for fam, rows in fams.items()}
    if tagger.query_head is not None:
        out["query_head_fit"] = {k: v for k, v in tagger.query_head.validation.items()
                                 if k != "trials"}
        out["query_head_fit"].update(layers=tagger.query_head.layers,
                                     temperature=tagger.query_head.temperature)
    return out


def _query_stats(rows: list[tuple[dict, TagResult]]) -> dict[str, Any]:
    import statistics

    ent = [_entropy_bits(p.probs) for _, p in rows]
    right = [p.label == (r.get("label") or "") for r, p in rows]
    return {"n": len(rows), "accuracy": round(sum(right) / len(rows), 4),
            "label_entropy_mean": round(statistics.mean(ent), 3),
            "label_entropy_median": round(statistics.median(ent), 3),
            "confidence_mean": round(statistics.mean(p.confidence for _, p in rows), 3),
            "no_label": round(sum(p.label == "" for _, p in rows) / len(rows), 4)}


def _entropy_bits(probs: dict[str, float]) -> float:
    import math

    return max(0.0, -sum(p * math.log2(p) for p in probs.values() if p > 0))
