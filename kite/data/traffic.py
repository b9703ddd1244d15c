"""Synthetic query traffic for `kite yoco analyze` and its benchmark: precise questions about a
clause, fuzzy ones, needle look-ups, questions about the whole contract, and off-topic chatter.

`generate_traffic(n, seed)` is deterministic (same seed, same list; more queries only append) and
draws its contract questions from the same phrasings as the bench cases (kite.data.clauses), so
a label's queries look like the ones `kite bench` asks.
"""

from __future__ import annotations

import json
import random

from kite.data.clauses import (BY_ID, FUZZY, FUZZY_CALIBRATION, LABELS, NEEDLES, NONE_CALIBRATION,
                               QA, QA_CALIBRATION)

# Share of each family in the traffic (sums to 1).
MIX: dict[str, float] = {"precise": 0.45, "fuzzy": 0.25, "needle": 0.05, "contract": 0.10,
                         "off_topic": 0.15}

OFF_TOPIC = [
    "What's the weather like in Paris tomorrow?", "Write a haiku about autumn leaves.",
    "How do I reverse a list in Python?", "Who won the football match last night?",
    "Recommend a good pizza place near the office.", "Translate 'good morning' into Spanish.",
    "What is the capital of Australia?", "Can you tell me a joke?",
    "How many calories are in a banana?", "Explain quantum computing in simple terms.",
    "What time is it in Tokyo right now?", "Help me plan a weekend trip to the mountains.",
    "hi", "thanks!", "ok", "What is 17 times 23?",
]
_CONTRACT = [
    "Summarize the main obligations and terms of this contract.",
    "Which clauses changed between the previous version and this one?",
    "Give me a short overview of this agreement.", "Who are the parties to this Agreement?",
    "List the key dates in the contract.", "Is there anything unusual in this contract?",
]
_LEADS = ["", "", "", "Quick question: ", "Can you check: ", "Please tell me ", "hey, "]


def _precise(rng: random.Random) -> tuple[str, str | None]:
    lab = rng.choice(LABELS)
    q = rng.choice(QA[lab])
    if rng.random() < 0.3:
        q = f"In the {BY_ID[lab].en} clause: {q[0].lower()}{q[1:]}"
    return q, lab


def _fuzzy(rng: random.Random) -> tuple[str, str | None]:
    lab = rng.choice(LABELS)
    return rng.choice(FUZZY[lab]), lab


def _needle(rng: random.Random) -> tuple[str, str | None]:
    return rng.choice(NEEDLES)[1], None


def _contract(rng: random.Random) -> tuple[str, str | None]:
    return rng.choice(_CONTRACT), None


def _off_topic(rng: random.Random) -> tuple[str, str | None]:
    return rng.choice(OFF_TOPIC), None


_DRAW = {"precise": _precise, "fuzzy": _fuzzy, "needle": _needle, "contract": _contract,
         "off_topic": _off_topic}


def generate_traffic(n: int, seed: int = 0) -> list[dict]:
    """`n` records `{"id", "query", "family", "label"}` (label: the clause type asked about, or
    None). Query i of seed s depends only on (s, i)."""
    families, weights = zip(*MIX.items())
    out = []
    for i in range(n):
        rng = random.Random(f"traffic:{seed}:{i}")
        family = rng.choices(families, weights)[0]
        query, label = _DRAW[family](rng)
        lead = rng.choice(_LEADS)
        if lead and family != "off_topic":
            query = lead + query[0].lower() + query[1:]
        out.append({"id": f"t{seed}-{i}", "query": query, "family": family, "label": label})
    return out


def calibration_queries(n: int, seed: int = 1001) -> list[dict]:
    """`n` labeled queries for calibrating the query side of the tagger: the same families and
    mix as `generate_traffic`, drawn from phrasings the bench and the traffic never use
    (kite.data.clauses `QA_CALIBRATION`, `FUZZY_CALIBRATION`, `NONE_CALIBRATION`). Records
    `{"id", "query", "family", "label", "group"}`; `group` names the phrasing (lead and clause
    prefix aside), so cross-validation can keep a phrasing's variants in one fold."""
    families, weights = zip(*MIX.items())
    out = []
    for i in range(n):
        rng = random.Random(f"calibration:{seed}:{i}")
        family = rng.choices(families, weights)[0]
        label: str | None = None
        if family in ("precise", "fuzzy"):
            label = rng.choice(LABELS)
            pool = (QA_CALIBRATION if family == "precise" else FUZZY_CALIBRATION)[label]
        else:
            pool = NONE_CALIBRATION[family]
        k = rng.randrange(len(pool))
        query = pool[k]
        if family == "precise" and rng.random() < 0.3:
            query = f"In the {BY_ID[label].en} clause: {query[0].lower()}{query[1:]}"
        lead = rng.choice(_LEADS)
        if lead and family != "off_topic":
            query = lead + query[0].lower() + query[1:]
        out.append({"id": f"c{seed}-{i}", "query": query, "family": family, "label": label,
                    "group": f"{family}:{label or '-'}:{k}"})
    return out


def to_jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
