"""Bench cases: contract records (docs/bench-cases.md) expanded into one case per question.

A case answers one question about one document. Questions of the `multihop` family compare two
versions of a contract, so their document is the previous version followed by the current one;
every other family reads the current version alone. Cases that share a document share its
prefill and its state.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from kite.errors import BadInput

FAMILIES = ("summary", "multihop", "fuzzy", "needle", "qa")


@dataclass(frozen=True, slots=True)
class BenchCase:
    id: str  # "<contract id>/<question id>"
    family: str
    document: str
    question: str
    reference: str
    label: str | None
    where: str  # "file:line" of the contract record, for error messages
    # What the model is asked to continue (docs/bench-cases.md): a completion-style sentence
    # start whose continuation is `reference`. None (hand-written cases without one): the
    # question itself is the prompt, through the chat template.
    prompt: str | None = None

    @property
    def document_key(self) -> str:
        """Same document, same key (names the document's state in --upcycle DIR)."""
        return hashlib.sha256(self.document.encode("utf-8")).hexdigest()[:16]


def document_for(record: dict, family: str) -> str:
    """The text a question of `family` is asked about."""
    prev = record.get("previous_version")
    if family == "multihop" and isinstance(prev, dict):
        year = prev.get("year", "earlier")
        return (f"PREVIOUS VERSION ({year}):\n\n{prev['text']}\n\n"
                f"CURRENT VERSION ({record.get('year', 'current')}):\n\n{record['text']}")
    return record["text"]


def expand(records: list[dict], path: str | os.PathLike[str], families: list[str] | None = None,
           per_family: int | None = None) -> list[BenchCase]:
    """One case per question (families filtered; at most `per_family` per family per record)."""
    wanted = set(families or FAMILIES)
    unknown = sorted(wanted - set(FAMILIES))
    if unknown:
        raise BadInput(f"--families {unknown[0]!r}: expected some of {', '.join(FAMILIES)}")
    cases: list[BenchCase] = []
    for rec in records:
        where = f"{path}:{rec['_line']}"
        taken: dict[str, int] = {}
        questions = rec.get("questions") or []
        if not questions:
            raise BadInput(f"{where}: case {rec['id']!r} has no questions")
        for k, q in enumerate(questions):
            fam = q.get("family", "qa")
            if fam not in FAMILIES:
                raise BadInput(f"{where}: case {rec['id']!r} question {k}: family {fam!r} is not "
                               f"one of {', '.join(FAMILIES)}")
            if fam not in wanted or (per_family is not None and taken.get(fam, 0) >= per_family):
                continue
            taken[fam] = taken.get(fam, 0) + 1
            if not q["answer"].strip():
                raise BadInput(f"{where}: case {rec['id']!r} question {k}: the reference answer is empty")
            prompt = q.get("prompt")
            if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
                raise BadInput(f"{where}: case {rec['id']!r} question {k}: prompt must be a "
                               "non-empty string")
            cases.append(BenchCase(id=f"{rec['id']}/{q.get('id', f'q{k}')}", family=fam,
                                   document=document_for(rec, fam), question=q["question"],
                                   reference=q["answer"], label=q.get("label"), where=where,
                                   prompt=prompt))
    if not cases:
        raise BadInput(f"{path}: no questions of the families asked for ({', '.join(sorted(wanted))})")
    return cases


def load_cases(path: str | os.PathLike[str], families: list[str] | None = None,
               per_family: int | None = None) -> list[BenchCase]:
    """Read and check a cases file (malformed JSONL, missing documents: BadInput with file:line)."""
    from kite.data.jsonl import read_cases

    return expand(read_cases(path), path, families, per_family)


def default_cases_path():
    """configs/bench_cases.jsonl of the checkout (the bundled default set), or None."""
    from kite.paths import repo_root

    root = repo_root()
    path = root / "configs" / "bench_cases.jsonl" if root else None
    return path if path is not None and path.exists() else None


def make_default_cases(n: int = 2, tokens: int = 1500, seed: int = 0, per_family: int = 1) -> list[dict]:
    """The bundled set: `n` generated contracts, keeping `per_family` questions of each family
    (the first ones, so the file is deterministic)."""
    from kite.data.contracts import generate_contracts

    out = []
    for rec in generate_contracts(n, tokens, seed):
        kept, count = [], {}
        for q in rec["questions"]:
            if count.get(q["family"], 0) < per_family:
                count[q["family"]] = count.get(q["family"], 0) + 1
                kept.append(q)
        out.append({**rec, "questions": kept})
    return out
