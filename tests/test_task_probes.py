"""Task probes of `kite upcycle eval` (kite.upcycle.quality): passkeys planted where asked, the
questions answered from the full context and from the state, answers scored as SQuAD scores them."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from kite.cli.main import app
from tests.tiny_models import CORPUS

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["llama"]), device="cpu")


@pytest.fixture()
def exact():
    from kite.upcycle import codec
    from kite.upcycle.compress import CompressSettings

    return CompressSettings(codec=codec.settings_for("exact"), n_clusters=2, min_span_tokens=8)


# --- scoring ----------------------------------------------------------------------------------

def test_normalize_answer_drops_case_punctuation_articles_and_extra_spaces():
    from kite.data.answers import normalize_answer

    assert normalize_answer("  The  Courts of  LONDON, England. ") == "courts of london england"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"   # an article only as a whole word


def test_f1_counts_shared_tokens_after_normalization():
    from kite.data.answers import f1_score

    assert f1_score("USD 1,250,000.", "usd 1250000") == 1.0
    assert f1_score("the courts of Geneva", "Geneva") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert f1_score("twelve months", "twelve (12) months") == pytest.approx(0.8)
    assert f1_score("nothing alike", "Geneva") == 0.0
    assert f1_score("", "") == 1.0 and f1_score("", "Geneva") == 0.0


def test_the_scored_answer_is_the_first_line():
    from kite.data.answers import answer_text

    assert answer_text("  Paris.\nThe Supplier shall") == "Paris."


def test_a_key_is_retrieved_when_the_first_number_is_the_key():
    from kite.upcycle.quality import first_number

    assert first_number(" 48213. Remember it") == "48213"
    assert first_number(" 4821 and then 48213") == "4821"
    assert first_number(" no digits") is None


# --- planting ---------------------------------------------------------------------------------

def test_plant_keys_puts_each_fact_at_its_depth_in_a_context_of_the_asked_length(tiny_lm):
    from kite.upcycle.quality import KEY_LABELS, key_depths, passkey_sentences, plant_keys

    ids = tiny_lm.tokenizer(CORPUS * 3, add_special_tokens=False)["input_ids"]
    depths = key_depths(3)
    assert depths == (0.1667, 0.5, 0.8333)
    ctx, planted = plant_keys(tiny_lm, ids, 300, depths, KEY_LABELS[:3], random.Random(0))
    assert len(ctx) == 300
    assert len({k["passkey"] for k in planted}) == 3
    body = 300 - sum(len(tiny_lm.tokenizer(passkey_sentences(k["label"], k["passkey"])[0],
                                           add_special_tokens=False)["input_ids"]) for k in planted)
    before = 0
    for k in planted:
        fact = tiny_lm.tokenizer(passkey_sentences(k["label"], k["passkey"])[0], add_special_tokens=False)["input_ids"]
        assert ctx[k["position"]:k["position"] + len(fact)] == fact
        assert k["position"] - before == int(body * k["depth"])   # text before it: its depth of the text
        before += len(fact)
        assert k["label"] in k["question"] and k["passkey"] not in k["question"]
    assert planted[0]["position"] < planted[1]["position"] < planted[2]["position"]


def test_plant_keys_refuses_a_context_too_short_for_its_facts(tiny_lm):
    from kite.errors import BadInput
    from kite.upcycle.quality import plant_keys

    with pytest.raises(BadInput, match="cannot hold 3 passkey facts"):
        plant_keys(tiny_lm, list(range(500)), 10, (0.2, 0.5, 0.8), ("red", "green", "blue"), random.Random(0))


# --- the probes, full context against an exact state ---------------------------------------------

def test_passkey_single_key_asks_each_depth_and_an_exact_state_answers_as_the_full_context(tiny_lm, exact, one_thread):
    from kite.upcycle import PASSKEY_DEPTHS, passkey_probe

    steps = []
    out = passkey_probe(tiny_lm, CORPUS * 2, 160, exact, progress=lambda *a: steps.append(a))
    assert out["kind"] == "passkey" and [c["depth"] for c in out["cases"]] == list(PASSKEY_DEPTHS)
    assert steps[-1] == ("passkey", 5, 5)
    for case in out["cases"]:
        assert case["context_tokens"] == 160 and case["label"] is None
        assert case["state_text"] == case["full_text"]   # nothing lost: the same greedy answer
        assert case["state"] == case["full"]
    assert out["state_accuracy"] == out["full_accuracy"] == sum(c["full"] for c in out["cases"]) / 5
    assert out["compression_ratio"] < 1   # fp32 against raw fp16


def test_several_keys_share_one_context_and_each_is_asked(tiny_lm, exact, one_thread):
    from kite.upcycle import passkey_probe

    out = passkey_probe(tiny_lm, CORPUS * 2, 200, exact, keys=3, full=False)
    assert out["kind"] == "keys" and out["keys"] == 3
    assert [c["label"] for c in out["cases"]] == ["red", "green", "blue"]
    assert len({c["position"] for c in out["cases"]}) == 3
    assert out["full_accuracy"] is None and all(c["full"] is None for c in out["cases"])


def test_qa_scores_the_first_line_of_each_answer_against_the_reference(tiny_lm, exact, one_thread):
    from kite.upcycle import qa_probe

    record = {"id": "tiny-0", "text": CORPUS, "questions": [
        {"family": "qa", "label": "payment", "prompt": "The fees total", "answer": "USD 120,000"},
        {"family": "summary", "label": None, "prompt": "In short,", "answer": "not asked"},
        {"family": "qa", "label": "warranty", "prompt": "The warranty period is", "answer": "twelve months"}]}
    out = qa_probe(tiny_lm, 0, exact, records=[record])
    assert [c["label"] for c in out["cases"]] == ["payment", "warranty"]   # the qa family only
    from kite.data.answers import f1_score

    for case in out["cases"]:
        assert case["state_answer"] == case["full_answer"] and "\n" not in case["state_answer"]
        assert case["state_f1"] == round(f1_score(case["state_answer"], case["reference"]), 4)
    assert out["state_f1"] == out["full_f1"]


def test_qa_asks_about_the_held_out_contracts_by_default():
    from kite.upcycle.quality import QA_SEED
    from kite.upcycle.study.held_out import held_out_docs

    held_out = held_out_docs(2, licenses=())
    assert {f"contract-s{QA_SEED}-{i:05d}" for i in range(2)} == set(held_out)


# --- the command --------------------------------------------------------------------------------

def test_eval_reports_each_probe_asked_in_json(tiny_models, tmp_path, one_thread):
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS.replace(". ", ".\n\n"))
    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text("compression: {svd_ratio: 0.25, cluster_num: 2, min_span_tokens: 6, max_span_tokens: 14}\n"
                   "semantic_tagging: {generated_examples_per_label: 0}\n")
    r = runner.invoke(app, ["upcycle", "eval", "--model", str(tiny_models["llama"]), "--input", str(doc),
                            "--config", str(cfg), "--context-tokens", "300", "--continuation-tokens", "20",
                            "--probe", "keys,passkey,keys", "--json"])
    assert r.exit_code == 0, r.output
    probes = json.loads(r.stdout)["probes"]
    assert list(probes) == ["keys", "passkey"]   # each once, in the order asked
    assert len(probes["passkey"]["cases"]) == 5 and len(probes["keys"]["cases"]) == 3
    assert 0 <= probes["passkey"]["state_accuracy"] <= 1


def _eval_args(tiny_models, tmp_path) -> list[str]:
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS.replace(". ", ".\n\n"))
    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text("compression: {svd_ratio: 0.25, cluster_num: 2, min_span_tokens: 6, max_span_tokens: 14}\n"
                   "semantic_tagging: {generated_examples_per_label: 0}\n")
    return ["upcycle", "eval", "--model", str(tiny_models["llama"]), "--input", str(doc), "--config", str(cfg),
            "--context-tokens", "300", "--continuation-tokens", "20"]


def test_eval_asks_qa_about_as_many_held_out_contracts_as_given(tiny_models, tmp_path, one_thread, monkeypatch):
    # the tiny model's context (512) cannot hold a contract: the contracts' records stand in for them
    import kite.upcycle.quality as quality

    def contexts(lm, context_tokens, *, contracts=quality.QA_CONTRACTS, **kw):
        return [({"id": f"contract-{i}"}, [], []) for i in range(contracts)]

    asked = []

    def probe(lm, context_tokens, settings, tagger=None, *, records=None, **kw):
        asked.append([r["id"] for r in records])
        return {"kind": "qa", "cases": []}

    monkeypatch.setattr(quality, "qa_contexts", contexts)
    monkeypatch.setattr(quality, "qa_probe", probe)
    for extra in ([], ["--qa-contracts", "6"]):
        r = runner.invoke(app, _eval_args(tiny_models, tmp_path) + ["--probe", "qa", "--json", *extra])
        assert r.exit_code == 0, r.output
    assert asked == [[f"contract-{i}" for i in range(quality.QA_CONTRACTS)], [f"contract-{i}" for i in range(6)]]


def test_eval_refuses_qa_on_a_model_too_short_for_a_contract_before_any_work(tiny_models, tmp_path, one_thread):
    r = runner.invoke(app, _eval_args(tiny_models, tmp_path) + ["--probe", "passkey,qa"])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: --probe qa: a held-out contract of "), r.output
    assert "exceed the model's context of 512" in lines[-1]
    assert "prefill" not in r.output and "compress" not in r.output    # refused before the document's state


@pytest.mark.parametrize("args, said", [
    *[(["--probe", v], f"--probe {v}: expected one of passkey, keys, qa") for v in ("nosuch", "passkey,nosuch", "passkey,")],
    (["--qa-contracts", "3"], "--qa-contracts: only with --probe qa"),
    (["--probe", "passkey", "--qa-contracts", "3"], "--qa-contracts: only with --probe qa")])
def test_eval_refuses_bad_probe_flags_in_one_line_before_the_model_loads(monkeypatch, tmp_path, args, said):
    import kite.model
    import kite.model.loader

    def loaded(*a, **k):
        raise AssertionError("the model was loaded")

    for module in (kite.model, kite.model.loader):
        monkeypatch.setattr(module, "load_model", loaded)
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    r = runner.invoke(app, ["upcycle", "eval", "--input", str(doc), *args])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and said in lines[0], r.output


@pytest.mark.slow
def test_embedded_model_retrieves_a_passkey_from_full_context_and_from_a_4x_state(embedded, one_thread):
    """The 135M model finds a key stated once in a 512-token license excerpt; a 4x state keeps it."""
    from kite.upcycle import passkey_probe
    from kite.upcycle.compress import CompressSettings
    from kite.upcycle.codec import settings_for

    text = open("/usr/share/common-licenses/GPL-3").read()
    out = passkey_probe(embedded, text, 512, CompressSettings(codec=settings_for("ratio=4")), depths=(0.5,))
    case = out["cases"][0]
    assert case["full"], case["full_text"]
    assert case["state"], case["state_text"]
