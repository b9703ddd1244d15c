"""Training pairs for `kite upcycle train`: read, check, split by document.

A pairs file is JSONL, one pair a line:

    {"context": "<the document>", "prompt": "<what is asked after it>", "response": "<the answer>"}
    {"prompt": "<the document>\\n\\n<the question>", "response": "<the answer>"}

Without a ``context`` the document is the prompt up to its last blank line and the prompt is what
follows it. The held-out split is by document: every pair of a held-out document is held out, so
the report measures documents the training never saw.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

from kite.data.jsonl import read_jsonl
from kite.errors import BadInput


@dataclass(frozen=True)
class Pair:
    context: str
    prompt: str
    response: str
    line: int

    @property
    def document_key(self) -> str:
        return hashlib.sha256(self.context.encode()).hexdigest()[:16]


def read_pairs(path: str | Path) -> list[Pair]:
    """Every pair of ``path``; BadInput naming file:line for a malformed one."""
    pairs = []
    for rec in read_jsonl(path):
        where = f"{path}:{rec['_line']}"
        for key in ("prompt", "response"):
            if not isinstance(rec.get(key), str) or not rec[key].strip():
                raise BadInput(f"{where}: expected a non-empty string \"{key}\"")
        extra = sorted(set(rec) - {"context", "prompt", "response", "_line", "id", "meta"})
        if extra:
            raise BadInput(f"{where}: unknown field {extra[0]!r} (a pair has context, prompt, response)")
        if "context" in rec:
            if not isinstance(rec["context"], str) or not rec["context"].strip():
                raise BadInput(f"{where}: \"context\" must be a non-empty string")
            context, prompt = rec["context"], rec["prompt"]
        else:
            context, sep, prompt = rec["prompt"].rpartition("\n\n")
            if not sep or not context.strip() or not prompt.strip():
                raise BadInput(f"{where}: no \"context\": put the document in \"context\", or before the "
                               "question in \"prompt\" with a blank line between them")
            prompt = "\n\n" + prompt
        pairs.append(Pair(context, prompt, rec["response"], rec["_line"]))
    return pairs


def split_pairs(pairs: list[Pair], eval_fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(train, held out): a seeded draw of whole documents, ``eval_fraction`` of them (at least one)
    held out. BadInput when there are too few documents to hold one out and train on another."""
    if not 0 <= eval_fraction < 1:
        raise BadInput(f"--eval-fraction {eval_fraction}: expected a fraction in [0, 1)")
    docs = sorted({p.document_key for p in pairs})
    if eval_fraction == 0:
        return list(pairs), []
    if len(docs) < 2:
        raise BadInput(f"{len(pairs)} pairs of {len(docs)} document: the held-out split needs pairs of at "
                       "least 2 documents (or --eval-fraction 0)")
    n_held = min(len(docs) - 1, max(1, round(eval_fraction * len(docs))))
    held = set(random.Random(f"kite-train-split:{seed}").sample(docs, n_held))
    return [p for p in pairs if p.document_key not in held], [p for p in pairs if p.document_key in held]
