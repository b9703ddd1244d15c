"""The demo's questions, asked from a contract's .upc state and checked against the contract.

`make demo` generates one synthetic contract (``kite data contracts --n 1 --tokens
DEMO_TOKENS --seed DEMO_SEED``), compresses it into a state and runs ``kite demo``: each question
of `QUESTIONS` is asked from the state (no document prefill), and its answer is judged against
the fact the contract generator wrote into the text (the record's ``facts``). A wrong answer is
reported as one, and the command exits 1.

The 135M model answers a completion-style prompt (the bench's cloze prompts,
`kite.data.clauses.CLOZE`) far better than a question, so each question is asked as the start of
a sentence whose continuation is the fact.

The demo's contract is one the model answers right; that is not true of every contract. Measured
on 2026-12-02 (CPU, ratio-4 states, default config) on the contracts of seeds 0-3 at the same
size, even a full prefill of the document gave the court on none of the four and the fees on two
(seeds 0 and 3; from the 'payment' clusters of the state: seed 0 only). So a change to the contract
generator that changes this contract may make the demo fail: `tests/test_demo.py` says so first.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kite.data.answers import exact_match
from kite.data.clauses import CLOZE
from kite.errors import BadInput

# The contract `make demo` generates (scripts/demo.sh passes these to `kite data contracts`).
DEMO_SEED = 7
DEMO_TOKENS = 2000


@dataclass(frozen=True)
class DemoQuestion:
    """One question of the demo: asked as ``prompt``, from the clusters named (None: the whole
    state), answered by greedy decoding of at most ``max_new_tokens`` tokens, judged against the
    contract record's ``facts[fact]``."""

    fact: str  # the key of the contract's fact (a clause label of kite.data.clauses)
    question: str  # the question as a reader would ask it (shown, not sent to the model)
    clusters: tuple[str, ...] | None = None
    # " USD 1,183,250" is 11 tokens (a token per digit and comma): 16 leave room for what follows
    max_new_tokens: int = 16

    @property
    def prompt(self) -> str:
        """What the model continues after the state: a new line, then the clause's cloze prompt."""
        return "\n" + CLOZE[self.fact]

    @property
    def source(self) -> str:
        if self.clusters is None:
            return "the whole state"
        return "the clusters tagged " + ", ".join(f"'{c}'" for c in self.clusters)


QUESTIONS: tuple[DemoQuestion, ...] = (
    DemoQuestion("jurisdiction", "Which courts hear disputes under this contract?"),
    DemoQuestion("payment", "What do the fees payable under this contract total?", clusters=("payment",)),
)


@dataclass
class DemoAnswer:
    """A question's answer from the state beside the contract's fact."""

    fact_key: str
    question: str
    prompt: str
    clusters: list[str] | None  # None: the whole state
    continuation: str  # everything the model generated
    answer: str  # its first sentence: what is judged
    fact: str  # what the contract says
    agrees: bool
    tokens_loaded: int  # document tokens of the state loaded for this question
    load_ms: float
    generate_ms: float

    def to_dict(self) -> dict:
        return asdict(self)


_SENTENCE_END = re.compile(r"[.!?;](?=\s|$)|\n")


def first_sentence(text: str) -> str:
    """`text` without leading white space, up to and with its first sentence end (``.``, ``!``,
    ``?`` or ``;`` before white space or the end, or a line break), else whole. A point inside a
    number (``1.5``) ends nothing."""
    text = text.lstrip()
    m = _SENTENCE_END.search(text)
    return text[:m.end()].rstrip() if m else text.rstrip()


def agrees(continuation: str, fact: str) -> bool:
    """Whether an answer states the contract's fact: the fact, normalized as SQuAD v1.1 does
    (lower case, no punctuation, no articles, single spaces: `kite.data.answers.normalize_answer`),
    occurs as whole words in the answer's first sentence, normalized the same way
    (`kite.data.answers.exact_match`).

    So "New York." and "the courts of New York, applying" agree with "New York"; "USD 1,183,25"
    (cut short), "USD 11,183,250" and "EUR 1,183,250" do not agree with "USD 1,183,250"; and a fact
    that appears only after the first sentence ("London. New York") does not count."""
    return bool(exact_match(first_sentence(continuation), fact))


def contract_for_state(records: list[dict], state) -> dict:
    """The record of `records` whose text is the document `state` (a StateFile) was made from
    (the state keeps its document's sha256). Raises BadInput when none is."""
    want = (state.meta.get("source") or {}).get("sha256")
    for rec in records:
        if hashlib.sha256(rec["text"].encode()).hexdigest() == want:
            return rec
    ids = ", ".join(str(r.get("id")) for r in records[:3]) + (" ..." if len(records) > 3 else "")
    raise BadInput(f"{state.path}: made from none of the contracts given ({ids}): compress one of "
                   f"their texts, or give the contracts file the state was made from")


def read_contract_and_state(contract_path: str | Path, state_path: str | Path):
    """(record, StateFile): the contracts file (`kite data contracts` output) and the state made
    from one of them, both checked before any model loads. Raises BadInput (missing or bad file, a
    state of none of the contracts, a contract without one of the demo's facts)."""
    from kite.data.jsonl import read_cases
    from kite.upcycle import StateFile

    records = read_cases(contract_path)
    state = StateFile(state_path)
    record = contract_for_state(records, state)
    facts = record.get("facts")
    missing = [q.fact for q in QUESTIONS if not isinstance(facts, dict) or not isinstance(facts.get(q.fact), str)]
    if missing:
        raise BadInput(f"{contract_path}:{record['_line']}: contract {record.get('id')!r} has no fact "
                       f"{', '.join(missing)} (the demo needs `kite data contracts` records)")
    for q in QUESTIONS:
        if q.clusters is not None:
            from kite.upcycle import select_clusters

            select_clusters(state, list(q.clusters))   # a state without those clusters is BadInput
    return record, state


def answer_question(lm, state, record: dict, question: DemoQuestion) -> DemoAnswer:
    """Ask `question` from `state` (a StateFile made from `record`'s text) on `lm`, greedily, and
    judge the answer against the record's fact (:func:`agrees`)."""
    from kite.runtime.generate import encode_prompt, generate
    from kite.upcycle import load_prefix

    clusters = list(question.clusters) if question.clusters is not None else None
    t0 = time.perf_counter()
    prefix, report = load_prefix(state, lm, clusters=clusters)
    load_ms = (time.perf_counter() - t0) * 1e3
    ids = encode_prompt(lm.tokenizer, question.prompt, chat=False, add_special_tokens=False)
    result = generate(lm, ids, max_new_tokens=question.max_new_tokens, prefix=prefix)
    fact = record["facts"][question.fact]
    return DemoAnswer(fact_key=question.fact, question=question.question, prompt=question.prompt.strip(),
                      clusters=clusters, continuation=result.text, answer=first_sentence(result.text),
                      fact=fact, agrees=agrees(result.text, fact), tokens_loaded=report.tokens,
                      load_ms=round(load_ms, 1), generate_ms=round(result.total_ms, 1))

