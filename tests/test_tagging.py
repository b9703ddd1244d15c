"""Clause tagger: order independence, storage, bad input (tiny Llama); accuracy (embedded)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from typer.testing import CliRunner

from kite.data import LABELS, generate_contracts, labeled_examples, to_jsonl
from kite.errors import BadInput
from kite.upcycle.tagging import (
    ClauseTagger,
    candidate_layers,
    embed_spans_in_document,
    evaluate_tagging,
    hidden_states_at,
)
from tests.tiny_models import tiny_config, tiny_tokenizer


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls on a busy 2-core machine: a second thread only adds spin-waiting (40x slower).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=len(tok), layers=2)
    config.max_position_embeddings = 4096  # the tiny BPE spends ~3 tokens a word
    model = AutoModelForCausalLM.from_config(config)
    return model.eval(), tok


@pytest.fixture(scope="module")
def data():
    cases = generate_contracts(2, 700, seed=11)
    examples = labeled_examples(11, 2, exclude_ids=[c["id"] for c in cases])
    texts = [c["text"][s["start"]:s["end"]] for c in cases for s in c["spans"]]
    return cases, examples, texts


def test_label_and_example_order_do_not_change_predictions(tiny, data):
    model, tok = tiny
    _, examples, texts = data
    a = ClauseTagger.fit(model, tok, examples, list(LABELS))
    rng = random.Random(3)
    shuffled_labels, shuffled_examples = list(LABELS), list(examples)
    rng.shuffle(shuffled_labels)
    rng.shuffle(shuffled_examples)
    b = ClauseTagger.fit(model, tok, shuffled_examples, shuffled_labels)
    assert a.labels == b.labels == sorted(LABELS)
    ra, rb = a.tag_texts(model, tok, texts), b.tag_texts(model, tok, texts)
    assert [r.label for r in ra] == [r.label for r in rb]
    assert [r.probs for r in ra] == [r.probs for r in rb]
    for r in ra:
        assert abs(sum(r.probs.values()) - 1) < 1e-5 and 0 < r.confidence <= 1
        assert r.confidence == max(r.probs.values())


def test_to_dict_round_trip_is_json_and_identical(tiny, data):
    model, tok = tiny
    _, examples, texts = data
    tagger = ClauseTagger.fit(model, tok, examples)
    restored = ClauseTagger.from_dict(json.loads(json.dumps(tagger.to_dict())))
    E = tagger.embed_texts(model, tok, texts)
    assert E.shape == (len(texts), 64 * len(tagger.embedding_layers))
    assert [r.probs for r in restored.predict_embeddings(E)] == \
        [r.probs for r in tagger.predict_embeddings(E)]
    assert restored.embedding_layers == tagger.embedding_layers
    assert tagger.validation["folds"] == 2 and tagger.method in ("ridge", "centroid")
    with pytest.raises(BadInput, match="format"):
        ClauseTagger.from_dict({"format": "other"})
    broken = tagger.to_dict()
    broken["weights"] = broken["weights"][:3]
    with pytest.raises(BadInput, match="weights"):
        ClauseTagger.from_dict(broken)


def test_bad_examples(tiny):
    model, tok = tiny
    two = [("Pay within 30 days.", "payment"), ("Courts of Paris.", "jurisdiction")]
    with pytest.raises(BadInput, match="label 'warranty' has no example"):
        ClauseTagger.fit(model, tok, two, ["payment", "jurisdiction", "warranty"])
    with pytest.raises(BadInput, match="label 'jurisdiction', which is not among the labels"):
        ClauseTagger.fit(model, tok, two, ["payment", "warranty"])
    with pytest.raises(BadInput, match="text is empty"):
        ClauseTagger.fit(model, tok, [*two, ("  ", "payment")])
    with pytest.raises(BadInput, match="at least 2 labels"):
        ClauseTagger.fit(model, tok, two[:1])
    with pytest.raises(BadInput, match="tagging method"):
        ClauseTagger.fit(model, tok, two, methods=["knn"])
    with pytest.raises(BadInput, match="pair"):
        ClauseTagger.fit(model, tok, [("text only",)])
    # one example per label still fits (unvalidated)
    tagger = ClauseTagger.fit(model, tok, two)
    assert tagger.validation["folds"] == 0 and tagger.method == "ridge"
    assert tagger.tag_texts(model, tok, ["Pay within 30 days."])[0].label in ("payment",
                                                                             "jurisdiction")


def test_hidden_states_and_in_document_pooling_match_hf(tiny, data):
    model, tok = tiny
    cases, examples, _ = data
    ids = torch.tensor([tok("The parties agree that the supplier shall deliver.")["input_ids"]])
    ref = model(input_ids=ids, output_hidden_states=True).hidden_states
    got = hidden_states_at(model, ids, None, [0, 1])
    for h in (0, 1):
        torch.testing.assert_close(got[h], ref[h].float())
    assert candidate_layers(2) == [1] and candidate_layers(30)[0] == 1
    # a "document" that is exactly one span pools to the standalone embedding of that span
    tagger = ClauseTagger.fit(model, tok, examples)
    text = examples[0][0]
    E_doc = embed_spans_in_document(tagger, model, tok, text, [{"start": 0, "end": len(text)}])
    torch.testing.assert_close(E_doc, tagger.embed_texts(model, tok, [text]), rtol=1e-4,
                               atol=1e-5)
    report = evaluate_tagging(model, tok, cases, examples, tagger=tagger, mode="both")
    n = sum(len(c["spans"]) for c in cases)
    for mode in ("standalone", "in_document"):
        r = report[mode]
        assert r["n"] == n == sum(sum(row.values()) for row in r["confusion"].values())
        assert set(r["per_label"]) == set(LABELS)
    with pytest.raises(BadInput, match="token span"):
        tagger.pool_spans(got, [(3, 3)])


def test_prompt_method_is_order_independent(tiny):
    model, tok = tiny
    ex = [("Pay the fee within 30 days of invoice.", "payment"),
          ("All invoices are due in 45 days.", "payment"),
          ("The courts of Paris decide disputes.", "jurisdiction"),
          ("Disputes go to the courts in London.", "jurisdiction")]
    a = ClauseTagger.fit(model, tok, ex, methods=["prompt"],
                         label_names={"payment": "payment terms"})
    b = ClauseTagger.fit(model, tok, ex[::-1], ["payment", "jurisdiction"], methods=["prompt"],
                         label_names={"payment": "payment terms"})
    assert a.method == b.method == "prompt" and a.to_dict() == b.to_dict()
    texts = ["Invoices are payable in 10 days.", "Courts of Tokyo."]
    assert [r.probs for r in a.tag_texts(model, tok, texts)] == \
        [r.probs for r in b.tag_texts(model, tok, texts)]
    c = ClauseTagger.from_dict(json.loads(json.dumps(a.to_dict())))
    assert [r.probs for r in c.tag_texts(model, tok, texts)] == \
        [r.probs for r in a.tag_texts(model, tok, texts)]


def test_query_head_fits_on_questions_round_trips_and_old_taggers_still_load(tiny, data):
    from kite.data.traffic import calibration_queries, generate_traffic
    from kite.upcycle.tagging import calibration_set, evaluate_queries

    model, tok = tiny
    _, examples, _ = data
    tagger = ClauseTagger.fit(model, tok, examples)
    old = json.loads(json.dumps(tagger.to_dict()))
    old.pop("query_head")  # a tagger saved before query calibration
    legacy = ClauseTagger.from_dict(old)
    assert legacy.query_head is None and legacy.query_layers == tagger.embedding_layers
    queries = ["Which courts decide disputes?", "hi"]
    assert [r.probs for r in legacy.tag_queries(model, tok, queries)] == \
        [r.probs for r in tagger.tag_texts(model, tok, queries)]

    calib = calibration_set(tagger.labels, n=200)
    bench_phrasings = {r["query"] for r in generate_traffic(200, 0)}
    assert calib and not {q for q, _, _ in calib} & bench_phrasings
    head = tagger.fit_queries(model, tok, calib, layers=[1])
    assert head is tagger.query_head and tagger.query_layers == [1]
    v = head.validation
    assert v["folds"] == 5 and v["per_class"][""] > 0 and 0 <= v["accuracy"] <= 1
    restored = ClauseTagger.from_dict(json.loads(json.dumps(tagger.to_dict())))
    res, back = tagger.tag_queries(model, tok, queries), restored.tag_queries(model, tok, queries)
    assert [r.probs for r in res] == [r.probs for r in back]
    for r in res:  # "no clause" is spread over the labels: probs still sum to 1
        assert abs(sum(r.probs.values()) - 1) < 1e-5 and set(r.probs) == set(LABELS)
        assert r.label in ("", *LABELS)
    report = evaluate_queries(model, tok, tagger, generate_traffic(40, 0))
    assert report["query_head"]["all"]["n"] == report["clause_head"]["all"]["n"] == 40
    assert report["clause_head"]["all"]["no_label"] == 0  # the clause head always names one
    with pytest.raises(BadInput, match="not among the tagger's labels"):
        tagger.fit_queries(model, tok, [("x", "nope", "g")])
    with pytest.raises(BadInput, match="at least 2 phrasings"):
        tagger.fit_queries(model, tok, [("x", None, "g"), ("y", None, "g")])
    broken = tagger.to_dict()
    broken["query_head"]["weights"] = broken["query_head"]["weights"][:2]
    with pytest.raises(BadInput, match="query head"):
        ClauseTagger.from_dict(broken)
    assert calibration_queries(5, 1) == calibration_queries(5, 1)
    assert calibration_set(["a", "b"]) == []  # other labels: no generated calibration


def test_eval_tagging_cli_rejects_bad_input_before_loading_a_model(tmp_path):
    from kite.cli._common import new_app
    from kite.cli.upcycle_tagging import eval_tagging

    app = new_app("test")
    app.command("eval-tagging")(eval_tagging)
    app.command("noop")(lambda: None)
    runner = CliRunner()
    bad = tmp_path / "cases.jsonl"
    bad.write_text('{"id": "a", "text": "x"}\nnot json\n')
    res = runner.invoke(app, ["eval-tagging", "--cases", str(bad)])
    assert res.exit_code == 2 and "cases.jsonl:2:1: invalid JSON" in res.output
    good = tmp_path / "good.jsonl"
    good.write_text(to_jsonl(generate_contracts(1, 600, 0)))
    ex = tmp_path / "ex.jsonl"
    ex.write_text('{"text": "Pay within 30 days.", "label": "payment"}\n')
    res = runner.invoke(app, ["eval-tagging", "--cases", str(good), "--examples", str(ex)])
    assert res.exit_code == 2 and "has no labeled example" in res.output
    res = runner.invoke(app, ["eval-tagging", "--cases", str(good), "--mode", "sideways"])
    assert res.exit_code == 2 and "--mode sideways" in res.output
    res = runner.invoke(app, ["eval-tagging", "--cases", str(good), "--examples-per-label", "0"])
    assert res.exit_code == 2
    res = runner.invoke(app, ["eval-tagging"])
    assert res.exit_code == 2 and "--queries" in res.output
    q = tmp_path / "q.jsonl"
    q.write_text('{"query": "hi", "label": "nonsense"}\n')
    res = runner.invoke(app, ["eval-tagging", "--queries", str(q)])
    assert res.exit_code == 2 and "q.jsonl:1: label 'nonsense'" in res.output


@pytest.mark.slow
def test_embedded_model_tags_unseen_contracts(embedded):
    """≥ 90% on spans of contracts no example came from (measured figures: docs/tagging.md)."""
    cases = generate_contracts(6, 1000, seed=300)
    examples = labeled_examples(300, 3, exclude_ids=[c["id"] for c in cases])
    report = evaluate_tagging(embedded.model, embedded.tokenizer, cases, examples, mode="both")
    assert report["validation"]["folds"] == 3 and report["validation"]["accuracy"] >= 0.9
    assert report["standalone"]["accuracy"] >= 0.9, report["standalone"]["confusion"]
    assert report["in_document"]["accuracy"] >= 0.9, report["in_document"]["confusion"]


def test_eval_tagging_summary_says_none_wrong_when_all_are_right():
    from kite.cli.upcycle_tagging import mode_summary

    r = {"n": 2, "correct": 2, "s": 0.1, "mean_confidence_correct": 0.91, "mean_confidence_wrong": None,
         "confusion": {"payment": {"payment": 1, "breach": 0}, "breach": {"payment": 0, "breach": 1}}}
    line = mode_summary("in_document", r)
    assert line == "in-document: 2/2 correct in 0.1 s; mean confidence 0.91 right, none wrong"
    r.update(correct=0, mean_confidence_correct=None, mean_confidence_wrong=0.4,
             confusion={"payment": {"payment": 0, "breach": 2}})
    line = mode_summary("standalone", r)
    assert "None" not in line and "none right, 0.4 wrong; most confused: payment→breach ×2" in line


def _random_tagger(dim: int = 12, labels: tuple[str, ...] = ("a", "b", "c")) -> ClauseTagger:
    from kite.upcycle.tagging.tagger import QueryHead

    g = torch.Generator().manual_seed(5)
    C = len(labels)
    head = QueryHead(layers=[1], temperature=0.7, lam=1.0, mean=torch.randn(dim, generator=g),
                     scale=torch.rand(dim, generator=g) + 0.5, weights=torch.randn(dim, C + 1, generator=g),
                     bias=torch.randn(C + 1, generator=g))
    return ClauseTagger(labels=list(labels), method="ridge", embedding_layers=[1], temperature=1.3,
                        mean=torch.randn(dim, generator=g), scale=torch.rand(dim, generator=g) + 0.5,
                        weights=torch.randn(dim, C, generator=g), bias=torch.randn(C, generator=g), query_head=head)


def test_heads_score_embeddings_of_any_float_dtype_as_float32():
    from kite.upcycle.tagging.tagger import linear_scores

    tagger = _random_tagger()
    head = tagger.query_head
    E = torch.randn(4, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = (E.float() - head.mean) / head.scale @ head.weights + head.bias
    got = linear_scores(E, head.mean, head.scale, head.weights, head.bias)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    # a bf16 embedding is read as float32, as a float64 one is
    assert [r.probs for r in tagger.predict_queries(E.bfloat16())] == \
        [r.probs for r in tagger.predict_queries(E.bfloat16().double())]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_heads_score_a_gpu_embedding_on_the_gpu_as_the_cpu_does():
    tagger = _random_tagger()
    E = torch.randn(6, 12, generator=torch.Generator().manual_seed(2))
    for predict in (tagger.predict_queries, tagger.predict_embeddings):
        cpu, gpu = predict(E), predict(E.cuda())
        assert [r.label for r in gpu] == [r.label for r in cpu]
        for a, b in zip(cpu, gpu):
            assert all(abs(a.probs[k] - b.probs[k]) < 1e-5 for k in a.probs)
