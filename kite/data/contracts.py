"""Deterministic synthetic contracts with ground truth: clause spans, questions, two versions.

`generate_contracts(n, tokens, seed)` returns one JSON-able record per contract (the bench case
format, documented field by field in docs/bench-cases.md). Contract `i` of seed `s` depends only
on `(s, i)`: the same seed gives byte-identical output, and asking for more contracts only appends.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kite.data.clauses import (ACTIVITIES, ADJECTIVES, BOILERPLATE, BY_ID, CLOZE, CLOZE_PAY_DAYS,
                               DEFINITIONS, DEPTS, EXTRA, FUZZY, LABELS, MAIN, METRICS, NEEDLES,
                               PHASES, QA, RESOURCES, SCHEDULE_ITEMS, SCOPE_SENTENCES, THINGS,
                               VERBS)
from kite.errors import BadInput

FORMAT_VERSION = 1
WORDS_TO_TOKENS = 1.45  # SmolLM2 tokenizer on this text: 1.40-1.50 tokens per word

_PREFIX = ["Northwind", "Bluestone", "Crescent", "Halcyon", "Ironbridge", "Juniper", "Kestrel",
           "Lakeshore", "Meridian", "Oakridge", "Pinecrest", "Quarrystone", "Redwood", "Silverline",
           "Thornfield", "Umberland", "Vantage", "Willowbrook", "Yarrow", "Zephyr", "Aldermoor",
           "Brightwater", "Copperfield", "Driftwood", "Evergreen", "Foxglove", "Granite Peak"]
_CORE = ["Logistics", "Analytics", "Robotics", "Foods", "Textiles", "Energy", "Software",
         "Pharma", "Marine", "Holdings", "Systems", "Biotech", "Media", "Engineering", "Materials",
         "Networks", "Instruments", "Retail"]
_SUFFIX = ["Ltd.", "Inc.", "LLC", "GmbH", "S.A.", "Co., Ltd.", "plc", "B.V.", "AG", "Pte. Ltd."]
_ROLES_A = ["the Supplier", "the Provider", "the Contractor", "the Vendor", "the Licensor",
            "the Consultant"]
_ROLES_B = ["the Customer", "the Client", "the Purchaser", "the Company", "the Buyer"]
_CITIES = ["Singapore", "London", "New York", "Hong Kong", "Shanghai", "Geneva", "Zurich",
           "Frankfurt", "Toronto", "Sydney", "Chicago", "Dublin", "Amsterdam", "Stockholm",
           "Tokyo", "Seoul", "Paris", "Madrid", "Milan", "Vienna", "Boston", "Wilmington",
           "Shenzhen", "Munich", "Oslo", "Copenhagen", "Brussels", "Melbourne"]
_LAWS = ["the laws of England and Wales", "the laws of the State of New York", "Swiss law",
         "the laws of Singapore", "German law", "the laws of the People's Republic of China",
         "the laws of the State of Delaware", "Dutch law", "the laws of Ontario", "French law",
         "Irish law", "the laws of Hong Kong SAR", "Swedish law", "Japanese law"]
_TITLES = ["Master Services Agreement", "Supply Agreement", "Software Development Agreement",
           "Consulting Agreement", "Equipment Purchase Agreement", "Framework Agreement",
           "Technology Licence Agreement", "Maintenance and Support Agreement",
           "Distribution Agreement", "Logistics Services Agreement"]
_CURRENCIES = ["USD", "EUR", "GBP", "CHF", "SGD", "CNY"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December"]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                 "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
                 "seventeen", "eighteen", "nineteen", "twenty"]
_TENS = {20: "twenty", 30: "thirty", 40: "forty", 45: "forty-five", 60: "sixty", 90: "ninety",
         120: "one hundred and twenty", 180: "one hundred and eighty", 14: "fourteen",
         15: "fifteen", 5: "five", 7: "seven", 10: "ten", 3: "three", 28: "twenty-eight",
         24: "twenty-four", 36: "thirty-six", 18: "eighteen", 6: "six", 12: "twelve", 9: "nine"}
# Clause types whose key fact changes between versions (intellectual property keeps its owner so
# the owner's name stays a unique answer).
_CHANGEABLE = ("jurisdiction", "confidentiality", "force_majeure", "payment", "termination",
               "warranty")


@dataclass(slots=True)
class _Paragraph:
    text: str  # with slots still unfilled for version-dependent facts
    label: str | None
    role: str  # main, secondary, boilerplate, definitions, scope, preamble, needle, schedule,
    # signature


@dataclass(slots=True)
class _Contract:
    """The random draws of one contract; rendering it twice (two versions) draws nothing more."""

    slots: dict[str, str]
    facts: dict[str, dict[str, str]]  # version ("current", "previous") -> key fact slots
    paragraphs: list[_Paragraph] = field(default_factory=list)


def generate_contracts(n: int, tokens: int = 2000, seed: int = 0,
                       count_tokens: Callable[[str], int] | None = None) -> list[dict]:
    """`n` contract records of about `tokens` tokens each (the current version's text).

    `count_tokens` (e.g. `lambda s: len(tok(s).input_ids)`) measures length exactly; without it a
    words × 1.45 estimate is used. A contract never goes below its core (preamble, one clause of
    each type, signatures: ~700 tokens), so small `tokens` give that.
    """
    if n < 0:
        raise BadInput(f"--n {n}: the number of contracts cannot be negative")
    _check_tokens(tokens)
    return [generate_contract(i, tokens, seed, count_tokens) for i in range(n)]


MAX_TOKENS = 1 << 20    # a contract longer than the longest contexts (1M tokens) tests nothing more


def _check_tokens(tokens: int) -> None:
    if tokens < 1:
        raise BadInput(f"--tokens {tokens}: must be a positive number of tokens")
    if tokens > MAX_TOKENS:
        raise BadInput(f"--tokens {tokens}: at most {MAX_TOKENS:,} tokens a contract (the longest contexts)")


def iter_contracts(tokens: int, seed: int, start: int = 0,
                   count_tokens: Callable[[str], int] | None = None) -> Iterator[dict]:
    _check_tokens(tokens)
    i = start
    while True:
        yield generate_contract(i, tokens, seed, count_tokens)
        i += 1


def contract_id(seed: int, index: int) -> str:
    return f"contract-s{seed}-{index:05d}"


def generate_contract(index: int, tokens: int, seed: int,
                      count_tokens: Callable[[str], int] | None = None) -> dict:
    """Contract `index` of seed `seed` (independent of every other index)."""
    rng = random.Random(f"kite-contracts:{seed}:{index}")
    measure = count_tokens or _estimate_tokens
    c = _draw(rng)
    _layout(c, rng, tokens, measure)
    current = _render(c, "current")
    previous = _render(c, "previous")
    s, cur, prev = c.slots, c.facts["current"], c.facts["previous"]
    changed = [lab for lab in LABELS if _key_fact(lab, cur) != _key_fact(lab, prev)]
    questions = _questions(rng, c, changed)
    needle_start = current["text"].index(s["needle_sentence"])
    return {
        "format": FORMAT_VERSION,
        "id": contract_id(seed, index),
        "seed": seed,
        "index": index,
        "title": s["title"],
        "year": int(s["year"]),
        "parties": {"a": {"name": s["a"], "role": s["A"]}, "b": {"name": s["b"], "role": s["B"]}},
        "text": current["text"],
        "tokens": measure(current["text"]),
        "tokens_measured_by": "tokenizer" if count_tokens else f"words*{WORDS_TO_TOKENS}",
        "spans": current["spans"],
        "facts": {lab: _key_fact(lab, cur) for lab in LABELS},
        "needle": {"text": s["needle_sentence"], "start": needle_start,
                   "end": needle_start + len(s["needle_sentence"]),
                   "question": s["needle_question"], "answer": s["needle_code"]},
        "previous_version": {
            "year": int(s["prev_year"]),
            "title": f"{s['title']} ({s['prev_year']} version)",
            "text": previous["text"],
            "spans": previous["spans"],
            "facts": {lab: _key_fact(lab, prev) for lab in LABELS},
            "changed_labels": changed,
        },
        "summary": _summary(c),
        "questions": questions,
    }


def labeled_examples(seed: int, per_label: int, exclude_ids: Iterable[str] = (),
                     tokens: int = 600) -> list[tuple[str, str]]:
    """`per_label` (clause text, label) pairs for every label, for few-shot tagging.

    Drawn from contracts of seed `seed` whose ids are not in `exclude_ids` (the contracts being
    scored), at most one span per label per contract, so examples and scored clauses never share
    a contract. Ordered by label, then by contract index.
    """
    if per_label < 1:
        raise BadInput(f"per_label {per_label}: need at least one example per label")
    excluded = set(exclude_ids)
    found: dict[str, list[str]] = {lab: [] for lab in LABELS}
    for rec in iter_contracts(tokens, seed):
        if rec["id"] in excluded:
            continue
        taken: set[str] = set()
        for span in rec["spans"]:
            lab = span["label"]
            if len(found[lab]) < per_label and lab not in taken:
                found[lab].append(rec["text"][span["start"]:span["end"]])
                taken.add(lab)
        if all(len(found[lab]) >= per_label for lab in LABELS):
            break
    return [(text, lab) for lab in LABELS for text in found[lab]]


def to_jsonl(records: Iterable[dict]) -> str:
    """One compact JSON object a line, keys in generation order, non-ASCII kept (UTF-8)."""
    return "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n"
                   for r in records)


# ---------------------------------------------------------------- drawing and laying out


def _draw(rng: random.Random) -> _Contract:
    a_name, b_name = _company(rng), _company(rng)
    while b_name.split()[0] == a_name.split()[0]:
        b_name = _company(rng)
    year = rng.choice([2023, 2024, 2025])
    prev_year = rng.choice([2021, 2022])
    code = f"{rng.choice('KMPRTVXZ')}{rng.randint(10, 99)}-{rng.randint(1000, 9999)}"
    needle, needle_q = rng.choice(NEEDLES)
    currency = rng.choice(_CURRENCIES)
    slots = {
        "a": a_name, "b": b_name, "A": rng.choice(_ROLES_A), "B": rng.choice(_ROLES_B),
        "title": rng.choice(_TITLES), "year": str(year), "prev_year": str(prev_year),
        "date": _date(rng, year), "prev_date": _date(rng, prev_year),
        "city_a": rng.choice(_CITIES), "city_b": rng.choice(_CITIES),
        "needle_code": code, "needle_sentence": needle.format(code=code),
        "needle_question": needle_q, "currency": currency,
    }
    cur = _draw_facts(rng, slots)
    prev = dict(cur)
    changed = ["breach"] + rng.sample(_CHANGEABLE, rng.randint(1, 2))
    for lab in changed:
        for _ in range(20):  # redraw until the key fact differs
            alt = _draw_facts(rng, slots)
            keys = _FACT_KEYS[lab]
            if any(alt[k] != cur[k] for k in keys):
                prev.update({k: alt[k] for k in keys})
                break
    return _Contract(slots=slots, facts={"current": cur, "previous": prev})


_FACT_KEYS = {
    "breach": ("penalty",), "jurisdiction": ("court", "law"), "confidentiality": ("duration",),
    "intellectual_property": ("owner",), "force_majeure": ("notice",),
    "payment": ("price", "pay_days"), "termination": ("term_notice",), "warranty": ("period",),
}


def _key_fact(label: str, facts: dict[str, str]) -> str:
    """The short reference answer of `label`'s question (a substring of the clause text)."""
    return {"breach": facts["penalty"], "jurisdiction": facts["court"],
            "confidentiality": facts["duration"], "intellectual_property": facts["owner"],
            "force_majeure": facts["notice"], "payment": facts["price"],
            "termination": facts["term_notice"], "warranty": facts["period"]}[label]


def _draw_facts(rng: random.Random, slots: dict[str, str]) -> dict[str, str]:
    cur = slots["currency"]
    price = rng.randrange(80, 4000) * 1000 + rng.choice([0, 0, 500, 250])
    kind = rng.randrange(3)
    if kind == 0:
        penalty = f"{rng.choice([5, 8, 10, 12, 15, 20, 25, 30])}% of the total contract price"
    elif kind == 1:
        rate = rng.choice(["0.1", "0.2", "0.3", "0.5", "1"])
        cap = rng.choice([5, 10, 15, 20])
        penalty = (f"{rate}% of the contract price for each day of delay, capped at {cap}% of the "
                   "contract price")
    else:
        penalty = f"{cur} {rng.randrange(10, 400) * 1000:,}"
    return {
        "penalty": penalty,
        "court": rng.choice(_CITIES),
        "law": rng.choice(_LAWS),
        "duration": _amount(rng, rng.choice([2, 3, 4, 5, 6, 7, 10]), "years"),
        "owner": slots[rng.choice(["a", "b"])],
        "notice": _amount(rng, rng.choice([3, 5, 7, 10, 14, 15, 20, 30]), "days"),
        "price": f"{cur} {price:,}",
        "pay_days": _amount(rng, rng.choice([10, 14, 15, 20, 30, 45, 60, 90]), "days"),
        "term_notice": _amount(rng, rng.choice([14, 30, 45, 60, 90, 120, 180]), "days"),
        "period": _amount(rng, rng.choice([6, 9, 12, 18, 24, 36]), "months"),
    }


def _layout(c: _Contract, rng: random.Random, tokens: int, measure: Callable[[str], int]) -> None:
    """Choose the paragraphs: core first, then extras/boilerplate/schedules until `tokens`."""
    s = c.slots
    head = [
        _Paragraph(f"{s['title'].upper()}", None, "preamble"),
        _Paragraph(_preamble(rng, s), None, "preamble"),
        _Paragraph(_recital(rng, s) + " " + s["needle_sentence"], None, "needle"),
    ]
    clauses = []
    extras_left = {lab: rng.sample(EXTRA[lab], len(EXTRA[lab])) for lab in LABELS}
    for lab in LABELS:
        k = rng.randint(1, 3)
        sents = [rng.choice(MAIN[lab])] + [extras_left[lab].pop() for _ in range(k)]
        main, rest = sents[0], sents[1:]
        if rng.random() < 0.35:  # the key sentence is usually first, not always
            rest.insert(rng.randint(0, len(rest)), main)
        else:
            rest.insert(0, main)
        clauses.append(_Paragraph(" ".join(_fill_numbers(rng, x) for x in rest), lab, "main"))
    rng.shuffle(clauses)
    body: list[_Paragraph] = list(clauses)
    boiler = rng.sample(BOILERPLATE, len(BOILERPLATE))
    definitions: list[str] | None = None  # drawn when first needed: short contracts unchanged
    tail = [_Paragraph(_signature(s), None, "signature")]

    def total() -> int:
        return sum(measure(_fill(p.text, s, c.facts["current"])) + 1 for p in head + body + tail)

    budget = total()
    k_sched = 1
    while budget < tokens:
        roll = rng.random()
        open_labels = [lab for lab in LABELS if len(extras_left[lab]) >= 2]
        if roll < 0.5 and open_labels:
            lab = rng.choice(open_labels)
            sents = [extras_left[lab].pop() for _ in range(min(len(extras_left[lab]),
                                                                rng.randint(2, 3)))]
            para = _Paragraph(" ".join(_fill_numbers(rng, x) for x in sents), lab, "secondary")
        elif roll < 0.8 and boiler:
            para = _Paragraph(_fill_numbers(rng, boiler.pop()), None, "boilerplate")
        elif not boiler and rng.random() < 0.7:  # long documents: definitions, scope of work
            if definitions is None:
                definitions = rng.sample(DEFINITIONS, len(DEFINITIONS))
            if definitions and rng.random() < 0.4:
                para = _Paragraph(" ".join(definitions.pop().replace("{city}", s["city_a"])
                                           for _ in range(min(len(definitions), 3))),
                                  None, "definitions")
            else:
                para = _Paragraph(_scope(rng), None, "scope")
        else:
            items = []
            for _ in range(rng.randint(3, 6)):
                items.append(rng.choice(SCHEDULE_ITEMS).format(
                    k=k_sched, adj=rng.choice(ADJECTIVES), thing=rng.choice(THINGS),
                    dept=rng.choice(DEPTS), date=_date(rng, int(s["year"]))))
                k_sched += 1
            para = _Paragraph(" ".join(items), None, "schedule")
        body.insert(rng.randint(0, len(body)), para)
        budget += measure(_fill(para.text, s, c.facts["current"])) + 1
    c.paragraphs = head + body + tail


def _render(c: _Contract, version: str) -> dict:
    """Text and labeled spans of one version; clause paragraphs are numbered sections."""
    slots = dict(c.slots)
    facts = c.facts[version]
    if version == "previous":
        slots["date"] = slots["prev_date"]
    parts, spans, pos, section = [], [], 0, 1
    for p in c.paragraphs:
        text = _fill(p.text, slots, facts)
        number = ""
        if p.role in ("main", "secondary", "boilerplate"):
            number = f"{section}. "
            section += 1
        if p.label is not None:  # the span is the clause itself, without its section number
            t = BY_ID[p.label]
            start = pos + len(number)
            spans.append({"start": start, "end": start + len(text), "label": p.label,
                          "label_en": t.en, "label_zh": t.zh, "role": p.role})
        parts.append(number + text)
        pos += len(number) + len(text) + 2
    return {"text": "\n\n".join(parts), "spans": spans}


def _questions(rng: random.Random, c: _Contract, changed: list[str]) -> list[dict]:
    """The questions of one contract. Each has a `question` (as a user would ask it: YOCO's
    query) and a `prompt` (a completion-style sentence start whose continuation is `answer`:
    what the bench asks the model). The random draws are those of format 1 before prompts."""
    cur, prev = c.facts["current"], c.facts["previous"]
    py = c.slots["prev_year"]
    qs: list[dict] = [{"family": "summary", "label": None,
                       "question": "Summarize the main obligations and terms of this contract.",
                       "prompt": "In short, the main terms of this Agreement are:",
                       "answer": _summary(c)}]
    for lab in LABELS:
        qs.append({"family": "qa", "label": lab, "question": rng.choice(QA[lab]),
                   "prompt": CLOZE[lab], "answer": _key_fact(lab, cur)})
    needle_stem = c.slots["needle_sentence"].split(c.slots["needle_code"])[0].rstrip()
    qs.append({"family": "needle", "label": None, "question": c.slots["needle_question"],
               "prompt": f"In short, {needle_stem[0].lower()}{needle_stem[1:]}",
               "answer": c.slots["needle_code"]})
    for lab in rng.sample(list(LABELS), 3):
        qs.append({"family": "fuzzy", "label": lab, "question": rng.choice(FUZZY[lab]),
                   "prompt": CLOZE_PAY_DAYS if lab == "payment" else CLOZE[lab],
                   "answer": cur["pay_days"] if lab == "payment" else _key_fact(lab, cur)})
    qs.append({"family": "multihop", "label": "breach",
               "question": ("Find the clause about the other party's rights after a breach and "
                            f"compare it with the {py} version: what changed?"),
               "prompt": f"In short, compared with the {py} version, the liquidated damages "
                         "changed from",
               "answer": f"{prev['penalty']} in the {py} version to {cur['penalty']}.",
               "answer_previous": prev["penalty"], "answer_current": cur["penalty"]})
    other = [lab for lab in changed if lab != "breach"]
    lab = rng.choice(other)
    qs.append({"family": "multihop", "label": lab,
               "question": f"How does the {BY_ID[lab].en} clause differ from the {py} version?",
               "prompt": f"In short, the {BY_ID[lab].en} clause changed from",
               "answer": f"{_key_fact(lab, prev)} in the {py} version to {_key_fact(lab, cur)}.",
               "answer_previous": _key_fact(lab, prev), "answer_current": _key_fact(lab, cur)})
    same = rng.choice([x for x in LABELS if x not in changed])
    qs.append({"family": "multihop", "label": same,
               "question": f"Did the {BY_ID[same].en} clause change since the {py} version?",
               "prompt": f"In short, compared with the {py} version, the {BY_ID[same].en} "
                         "clause is",
               "answer": f"unchanged: {_key_fact(same, cur)} in both versions.",
               "answer_previous": _key_fact(same, prev), "answer_current": _key_fact(same, cur)})
    qs.append({"family": "multihop", "label": None,
               "question": f"Which clauses changed between the {py} version and this one?",
               "prompt": f"In short, the clauses that changed since the {py} version are",
               "answer": ", ".join(BY_ID[x].en for x in changed) + ".",
               "answer_labels": list(changed)})
    for k, q in enumerate(qs):
        q["id"] = f"q{k}"
    return [{"id": q.pop("id"), **q} for q in qs]


def _summary(c: _Contract) -> str:
    s, f = c.slots, c.facts["current"]
    return (f"{s['title']} dated {s['date']} between {s['a']} ({s['A'][4:]}) and {s['b']} "
            f"({s['B'][4:]}). {s['b']} pays {f['price']}, invoices due within {f['pay_days']}. "
            f"Breach: liquidated damages of {f['penalty']}. Confidentiality lasts {f['duration']}. "
            f"Intellectual property belongs to {f['owner'].rstrip('.')}. "
            f"Warranty of {f['period']}. "
            f"Force majeure must be notified within {f['notice']}. Termination for convenience "
            f"on notice of {f['term_notice']}. Disputes go to the courts of {f['court']} under "
            f"{f['law']}.")


# ---------------------------------------------------------------- small pieces


def _preamble(rng: random.Random, s: dict[str, str]) -> str:
    forms = [
        "This {title} (the \"Agreement\") is made on {date} between {a}, a company with its "
        "principal office in {city_a} (\"{A_}\"), and {b}, a company with its principal office in "
        "{city_b} (\"{B_}\").",
        "THIS AGREEMENT is entered into as of {date} by and between {a} of {city_a} (hereinafter "
        "\"{A_}\") and {b} of {city_b} (hereinafter \"{B_}\"), each a \"Party\".",
        "Dated {date}. Parties: (1) {a}, registered in {city_a} (\"{A_}\"); and (2) {b}, "
        "registered in {city_b} (\"{B_}\").",
    ]
    # {date} stays a slot: the two versions carry different dates.
    return rng.choice(forms).format(**{**s, "date": "{date}"}, A_=s["A"][4:], B_=s["B"][4:])


def _recital(rng: random.Random, s: dict[str, str]) -> str:
    forms = [
        "WHEREAS {A} has expertise in the supply of the services described in the schedules, and "
        "{B} wishes to engage {A} on the terms set out below.",
        "Background: {B} intends to modernise its operations and has selected {A} after a "
        "competitive tender to deliver the work described in this Agreement.",
        "The parties have agreed to cooperate on the project described below and wish to record "
        "the terms of their cooperation in writing.",
    ]
    return rng.choice(forms).format(**s)


def _signature(s: dict[str, str]) -> str:
    return (f"IN WITNESS WHEREOF the parties have signed this Agreement. For {s['a']}: "
            f"authorised signatory. For {s['b']}: authorised signatory.")


def _scope(rng: random.Random) -> str:
    """A scope-of-work paragraph: 3-4 sentences with drawn slots (unlimited variety)."""
    acts = rng.sample(ACTIVITIES, 3)
    sents = rng.sample(SCOPE_SENTENCES, rng.randint(3, 4))
    return " ".join(t.format(A="{A}", B="{B}", verb=rng.choice(VERBS), adj=rng.choice(ADJECTIVES),
                             thing=rng.choice(THINGS), dept=rng.choice(DEPTS),
                             activity=acts[0], activity2=acts[1], activity3=acts[2],
                             resource=rng.choice(RESOURCES), phase=rng.choice(PHASES),
                             metric=rng.choice(METRICS)) for t in sents)


def _company(rng: random.Random) -> str:
    return f"{rng.choice(_PREFIX)} {rng.choice(_CORE)} {rng.choice(_SUFFIX)}"


def _date(rng: random.Random, year: int) -> str:
    m, d = rng.randrange(12), rng.randint(1, 28)
    form = rng.randrange(3)
    if form == 0:
        return f"{_MONTHS[m]} {d}, {year}"
    if form == 1:
        return f"{d} {_MONTHS[m]} {year}"
    return f"{year}-{m + 1:02d}-{d:02d}"


def _amount(rng: random.Random, n: int, unit: str) -> str:
    """`ten (10) days` or `10 days` (the exact string is the reference answer)."""
    word = _NUMBER_WORDS[n] if n < len(_NUMBER_WORDS) else _TENS.get(n)
    if word and rng.random() < 0.5:
        return f"{word} ({n}) {unit}"
    return f"{n} {unit}"


def _fill_numbers(rng: random.Random, template: str) -> str:
    """Fill the small-number slots now (they are the same in both versions)."""
    return template.replace("{n}", str(rng.choice([5, 7, 10, 14, 15, 21, 30]))).replace(
        "{n2}", str(rng.choice([3, 5, 10, 20, 30, 60])))


def _fill(template: str, slots: dict[str, str], facts: dict[str, str]) -> str:
    values = {**slots, **facts}
    out = template
    for key in ("A", "B", "a", "b", "date", "law", "penalty", "court", "duration", "owner",
                "notice", "price", "pay_days", "term_notice", "period"):
        out = out.replace("{" + key + "}", values.get(key, ""))
    # A role name opening a sentence is capitalised ("The Supplier shall ...").
    for role in (slots["A"], slots["B"]):
        out = out.replace(f". {role}", f". {role[0].upper()}{role[1:]}")
        if out.startswith(role):
            out = role[0].upper() + out[1:]
    return out


def _estimate_tokens(text: str) -> int:
    return round(len(text.split()) * WORDS_TO_TOKENS)
