"""`kite demo` (what `make demo` ends with): its questions, the rule that judges an answer against
the contract's fact, its bad input, and, on the embedded model, that every answer is right."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kite.bench.demo import (DEMO_SEED, DEMO_TOKENS, QUESTIONS, DemoQuestion, agrees, contract_for_state,
                             first_sentence)
from kite.cli.main import app
from kite.data.contracts import generate_contracts, to_jsonl
from tests.conftest import parse_json
from tests.tiny_models import CORPUS

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- the judging rule


@pytest.mark.parametrize("answer, fact", [
    (" New York.\n\nThe Parties shall not be liable for", "New York"),
    (" the courts of new york, applying the laws of", "New York"),
    ("\n\nNew York", "New York"),
    (" USD 1,183,250, and amounts payable to", "USD 1,183,250"),
    (" usd 1183250.", "USD 1,183,250"),
    (" Hong Kong; the parties", "Hong Kong"),
])
def test_an_answer_that_states_the_fact_agrees(answer, fact):
    assert agrees(answer, fact)


@pytest.mark.parametrize("answer, fact", [
    (" London.", "New York"),                              # another city
    (" EUR 1,183,250, and", "USD 1,183,250"),               # another currency
    (" the amount set out in Schedule 2.", "USD 1,183,250"),
    ("", "New York"),
])
def test_a_wrong_answer_disagrees(answer, fact):
    assert not agrees(answer, fact)


@pytest.mark.parametrize("answer, fact", [
    (" USD 1,183,25", "USD 1,183,250"),                    # cut short
    (" USD 11,183,250", "USD 1,183,250"),                  # a digit more
    (" USD 1,183,2500", "USD 1,183,250"),
    (" York.", "New York"),                                 # part of the fact
    (" London. New York is where", "New York"),            # the fact only after the first sentence
    (" London\nNew York", "New York"),
    (" Yorkshire", "York"),                                 # the fact inside a longer word
])
def test_a_near_miss_disagrees(answer, fact):
    assert not agrees(answer, fact)


def test_the_first_sentence_ends_at_a_stop_or_a_line_break_not_inside_a_number():
    assert first_sentence("  USD 1.5 million. Next sentence") == "USD 1.5 million."
    assert first_sentence(" New York\nThe Parties") == "New York"
    assert first_sentence(" no end at all ") == "no end at all"


# ---------------------------------------------------------------- the questions


def test_every_question_asks_for_a_fact_the_demo_contract_states():
    record = generate_contracts(1, DEMO_TOKENS, DEMO_SEED)[0]
    for q in QUESTIONS:
        fact = record["facts"][q.fact]
        assert fact and fact in record["text"], q.fact
        assert q.prompt.startswith("\n") and q.prompt.strip(), q.fact
    assert {q.clusters for q in QUESTIONS} == {None, ("payment",)}   # the whole state and one cluster


def test_demo_script_generates_the_contract_the_questions_are_tested_on():
    script = (ROOT / "scripts" / "demo.sh").read_text()
    assert f"--n 1 --tokens {DEMO_TOKENS} --seed {DEMO_SEED}" in script
    assert "$KITE demo --contract" in script


def test_the_state_is_matched_to_its_contract_by_the_documents_hash(tiny_contract_state):
    from kite.errors import BadInput
    from kite.upcycle import StateFile

    text = CORPUS.replace(". ", ".\n\n", 3)   # the document the fixture's state was made from
    other = generate_contracts(2, 700, 1)
    state = StateFile(tiny_contract_state[2])
    assert contract_for_state([*other, {"id": "mine", "text": text}], state)["id"] == "mine"
    with pytest.raises(BadInput, match="made from none of the contracts given"):
        contract_for_state(other, state)


# ---------------------------------------------------------------- the command


@pytest.fixture()
def no_model(monkeypatch):
    """Any model load fails the test (the command must have failed before it)."""
    import kite.model

    def loaded(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kite.model, "load_model", loaded)


def refused(args: list[str], fragment: str) -> None:
    result = runner.invoke(app, args)
    assert "the model was loaded" not in result.output, result.output
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], result.output


def test_a_missing_file_is_one_line_and_exit_2(no_model, tmp_path, tiny_contract_state):
    contracts = tmp_path / "contracts.jsonl"
    contracts.write_text(to_jsonl(generate_contracts(1, 700, 1)))
    refused(["demo", "--contract", str(contracts), "--state", str(tmp_path / "nosuch.upc")], "no such state file")
    refused(["demo", "--contract", str(tmp_path / "nosuch.jsonl"), "--state", str(tiny_contract_state[2])],
            "no such file")


def test_a_state_of_another_document_or_a_contract_without_the_facts_is_exit_2(no_model, tmp_path,
                                                                                 tiny_contract_state):
    contracts = tmp_path / "contracts.jsonl"
    contracts.write_text(to_jsonl(generate_contracts(1, 700, 1)))
    state = str(tiny_contract_state[2])
    refused(["demo", "--contract", str(contracts), "--state", state], "made from none of the contracts given")
    bare = tmp_path / "bare.jsonl"
    bare.write_text(to_jsonl([{"id": "bare", "text": CORPUS.replace(". ", ".\n\n", 3), "spans": []}]))
    refused(["demo", "--contract", str(bare), "--state", state], "has no fact jurisdiction, payment")


def test_a_wrong_answer_is_said_to_be_and_exits_1(monkeypatch, tmp_path, tiny_models, tiny_contract_state):
    """The tiny random model cannot know the fact: its answer is reported as disagreeing."""
    import kite.bench.demo

    monkeypatch.setattr(kite.bench.demo, "QUESTIONS",
                        (DemoQuestion("jurisdiction", "Which courts?", max_new_tokens=4),))
    contracts = tmp_path / "contracts.jsonl"
    contracts.write_text(to_jsonl([{"id": "tiny", "text": CORPUS.replace(". ", ".\n\n", 3), "spans": [],
                                    "facts": {"jurisdiction": "Wilmington"}}]))
    args = ["demo", "--contract", str(contracts), "--state", str(tiny_contract_state[2]),
            "--model", str(tiny_models["llama"])]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "DISAGREES" in result.stdout and "0 of 1 answers agree with the contract" in result.stdout
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 1, result.output
    doc = parse_json(result.stdout)
    assert (doc["agree"], doc["total"], doc["answers"][0]["fact"]) == (0, 1, "Wilmington")
    assert doc["answers"][0]["agrees"] is False


# ---------------------------------------------------------------- on the embedded model


@pytest.mark.slow
def test_every_demo_answer_agrees_with_the_contract(embedded, tmp_path):
    """The demo's contract (same seed and size), compressed with the defaults `kite upcycle compress`
    runs with, and `kite demo` on it: every answer from the state states the contract's fact."""
    from kite.upcycle import open_pipeline

    record = generate_contracts(1, DEMO_TOKENS, DEMO_SEED)[0]
    contracts, state = tmp_path / "contract.jsonl", tmp_path / "contract.upc"
    contracts.write_text(to_jsonl([record]))
    open_pipeline(lm=embedded).compress(record["text"], state, source_name="contract.txt")
    result = runner.invoke(app, ["demo", "--contract", str(contracts), "--state", str(state), "--json"])
    assert result.exit_code in (0, 1), result.output   # 1: an answer disagrees (listed below)
    doc = parse_json(result.stdout)
    wrong = [(a["question"], a["continuation"], a["fact"]) for a in doc["answers"] if not a["agrees"]]
    assert not wrong, f"answers that disagree with the contract: {wrong}"
    assert result.exit_code == 0, result.output
    assert doc["agree"] == doc["total"] == len(QUESTIONS)
    assert [a["fact"] for a in doc["answers"]] == [record["facts"][q.fact] for q in QUESTIONS]
