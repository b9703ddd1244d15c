"""Answer quality as SQuAD v1.1 measures it: exact match and token F1 of normalized texts."""

from __future__ import annotations

import re
import string
from collections import Counter

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


def answer_text(generated: str) -> str:
    """The answer scored for F1 / exact match: the generated text up to its first line break
    (a base-model continuation runs on past the answer; the same cut for every method)."""
    return generated.strip().split("\n", 1)[0]
