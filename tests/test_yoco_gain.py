"""The measured gain the fused pipeline feeds the health store: the relative drop of the prompt's
own NLL with the state (kite.yoco.fused.prompt_nll / measured_gain), on a tiny random model."""

from __future__ import annotations

import math

import pytest


RULES = """rules:
  - name: default
    condition: true
    action: {load_all_clusters: true}
"""


@pytest.fixture(scope="module")
def setup(tiny_contract_state):
    return tiny_contract_state


def test_measured_gain_is_the_relative_drop():
    from kite.yoco.fused import measured_gain

    assert measured_gain(4.0, 3.0) == pytest.approx(0.25)
    assert measured_gain(4.0, 5.0) == pytest.approx(-0.25)
    assert measured_gain(0.0, 0.0) == 0.0
    assert measured_gain(None, 1.0) is None and measured_gain(1.0, None) is None


def test_prompt_nll_is_the_teacher_forced_nll_of_the_prompt(setup):
    """The same number as the benchmark's reference PPL of prompt[1:] after prompt[0] (an
    independent path: kite.bench.scoring), with and without the state."""
    from kite.bench.scoring import perplexity, reference_logits
    from kite.upcycle.load import load_prefix
    from kite.yoco.fused import prompt_nll

    lm, _, state = setup
    ids = lm.tokenizer("Any breach shall be settled by the court of", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 3
    prefix, _ = load_prefix(state, lm)
    for pre in (None, prefix):
        want = math.log2(perplexity(reference_logits(lm, pre, ids[:1], ids[1:]), ids[1:]))
        assert prompt_nll(lm, ids, pre) == pytest.approx(want, rel=1e-4)
    assert prompt_nll(lm, ids[:1]) is None and prompt_nll(lm, ids[:1], prefix) is None


def test_answer_records_the_prompt_nll_gain(setup, tmp_path):
    from kite.upcycle.load import load_prefix
    from kite.yoco.fused import answer, measured_gain, prompt_nll
    from kite.yoco.health import HealthStore, health_from_gain
    from kite.yoco.rules import parse_rules

    lm, tagger, state = setup
    rules = parse_rules(RULES)
    ids = lm.tokenizer("The court of Shanghai settles any breach", add_special_tokens=False)["input_ids"]
    with HealthStore(tmp_path / "h.sqlite") as health:
        out = answer(lm, tagger, rules, state, "Which court settles a breach?", ids, health=health,
                     max_new_tokens=2, min_hit_gain=-1.0)
        assert out.load is not None and "gain" in out.timings_ms
        prefix, _ = load_prefix(state, lm)
        want = measured_gain(prompt_nll(lm, ids), prompt_nll(lm, ids, prefix))
        assert out.gain == pytest.approx(want, abs=1e-6)
        recs = health.records("contract")
        assert recs and {r.cluster for r in recs} == set(out.load.labels)
        # first load: the prior counts as one load, so the mean moves half-way to the gain
        for r in recs:
            assert r.loads == 1 and r.hits == int(out.gain > 0)
            assert r.mean_gain == pytest.approx(health.prior_gain + (out.gain - health.prior_gain) / 2,
                                                abs=1e-6)
            assert r.health == pytest.approx(health_from_gain(r.mean_gain))
        # a one-token prompt has no gain to measure: nothing is recorded
        one = answer(lm, tagger, rules, state, "court?", ids[:1], health=health, max_new_tokens=1,
                     min_hit_gain=-1.0)
        assert one.load is not None and one.gain is None
        assert all(r.loads == 1 for r in health.records("contract"))


def test_generate_reports_the_prompt_nll_it_prefilled(setup):
    """`generate` takes the prompt's NLL from its own prefill (the gain's with-state side costs no
    extra forward), in one forward or in chunks."""
    from kite.runtime.generate import generate
    from kite.upcycle.load import load_prefix
    from kite.yoco.fused import prompt_nll

    lm, _, state = setup
    ids = lm.tokenizer("Any breach shall be settled by the court of", add_special_tokens=False)["input_ids"]
    prefix, _ = load_prefix(state, lm)
    for pre in (None, prefix):
        want = prompt_nll(lm, ids, pre)
        for chunk in (None, 2):
            got = generate(lm, ids, max_new_tokens=1, prefix=pre, prefill_chunk=chunk).prompt_nll_bits
            assert got == pytest.approx(want, rel=1e-5)
    assert generate(lm, ids[:1], max_new_tokens=1).prompt_nll_bits is None


def test_without_a_health_store_the_state_stands_at_the_prior(setup):
    """No store means no evidence: the health is the prior a new state gets in a store, not a
    score below the v1 rules' `unhealthy_state` cut."""
    from kite.upcycle.format import StateFile
    from kite.yoco.fused import state_info
    from kite.yoco.health import HealthStore

    _, _, state = setup
    with StateFile(state) as st:
        bare = state_info(st, None)
        with HealthStore(setup[2].parent / "fresh.sqlite") as fresh:
            new = state_info(st, fresh)
    assert bare.health_score() == pytest.approx(new.health_score())
    assert bare.health_score() >= 0.55


def test_the_signals_pass_gives_each_querys_nll_as_prompt_nll_does(setup):
    """Queries of different lengths in one right-padded pass: each one's NLL is the teacher-forced
    NLL of its own tokens (padding never leaks in); a one-token query has none."""
    from kite.yoco.fused import prompt_nll
    from kite.yoco.intent import query_signals

    lm, tagger, _ = setup
    queries = ["Which court settles a breach of this agreement?", "Who pays?", "court"]
    sigs = query_signals(lm, queries, tagger)
    for q, sig in zip(queries, sigs):
        ids = lm.tokenizer(q, add_special_tokens=False)["input_ids"]
        assert sig.ids == tuple(ids)
        want = prompt_nll(lm, ids)
        assert (sig.nll_bits is None) == (want is None), q
        if want is not None:
            assert sig.nll_bits == pytest.approx(want, rel=1e-4)


def test_a_prompt_that_is_the_query_costs_no_second_forward_for_its_gain(setup, tmp_path, monkeypatch):
    """The server's completions send the prompt as the query: the gain's side without the state comes
    from the signals' pass (the same figure as prompt_nll's forward), no extra forward runs."""
    import kite.yoco.fused as fused
    from kite.upcycle.load import load_prefix
    from kite.yoco.rules import parse_rules

    lm, tagger, state = setup
    query = "Which court settles any breach of the agreement?"
    ids = lm.tokenizer(query, add_special_tokens=False)["input_ids"]
    prefix, _ = load_prefix(state, lm)
    want = fused.measured_gain(fused.prompt_nll(lm, ids), fused.prompt_nll(lm, ids, prefix))

    def no_forward(*a, **k):
        raise AssertionError("a second forward ran for the gain")

    monkeypatch.setattr(fused, "prompt_nll", no_forward)
    out = fused.answer(lm, tagger, parse_rules(RULES), state, query, ids, max_new_tokens=2, min_hit_gain=-1.0)
    assert out.load is not None and out.gain == pytest.approx(want, abs=1e-5)


def test_a_decision_reads_its_querys_novelty_once_and_remembers_the_query(setup):
    """The novelty a decision reads is the query's against the queries before it, computed once (a
    server decides a burst's requests one after another on the batch thread), and the query is then
    one of the recent ones."""
    from kite.yoco.fused import answer
    from kite.yoco.novelty import NoveltyTracker, similarity
    from kite.yoco.rules import parse_rules

    class Counting(NoveltyTracker):
        computed = 0

        def _novelty(self, q, h):
            self.computed += 1
            return super()._novelty(q, h)

    lm, tagger, state = setup
    tracker = Counting()
    before, query = "Which court settles a breach?", "Which court settles a breach of contract?"
    tracker.observe(before)
    ids = lm.tokenizer(query, add_special_tokens=False)["input_ids"]
    out = answer(lm, tagger, parse_rules(RULES), state, query, ids, novelty=tracker, max_new_tokens=1,
                 min_hit_gain=-1.0)
    assert tracker.computed == 2 and len(tracker) == 2
    assert out.signals.query_novelty == pytest.approx(1 - similarity(before, query))
    assert tracker.novelty(query) == 0.0
