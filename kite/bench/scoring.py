"""Answer quality: SQuAD-style exact match and token F1, and the reference's teacher-forced PPL."""

from __future__ import annotations

import math
import re
import string
from collections import Counter

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles (a, an, the), single spaces (SQuAD v1.1)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the normalized texts are equal, or the normalized reference occurs whole in the
    normalized prediction (a short fact inside a sentence counts), else 0.0."""
    p, r = normalize_answer(prediction), normalize_answer(reference)
    if not r:
        return float(p == r)
    return float(p == r or f" {r} " in f" {p} ")


def f1_score(prediction: str, reference: str) -> float:
    """Token F1 of the normalized texts (SQuAD v1.1)."""
    p, r = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not p or not r:
        return float(p == r)
    common = Counter(p) & Counter(r)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(r)
    return 2 * precision * recall / (precision + recall)


@torch.inference_mode()
def reference_logits(lm, prefix, prompt_ids: list[int], reference_ids: list[int]) -> torch.Tensor:
    """Logits [len(reference), vocab] predicting each reference token after prefix + prompt."""
    from kite.runtime.cache import new_cache
    from kite.runtime.generate import forward_tokens

    start = prefix.next_position if prefix is not None else 0
    ids = prompt_ids + reference_ids[:-1]
    logits = forward_tokens(lm.model, ids, new_cache(lm.model, prefix), start)
    return logits[len(prompt_ids) - 1:]


def perplexity(logits: torch.Tensor, targets: list[int]) -> float:
    """exp(mean NLL) of `targets` under `logits` [n, vocab]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(1, torch.tensor(targets)[:, None]).squeeze(1)
    value = float(torch.exp(nll.mean()))
    return value if math.isfinite(value) else float("inf")
