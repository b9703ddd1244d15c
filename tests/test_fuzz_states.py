"""Crafted and damaged states through the public load path (`StateFile` + `load_prefix`, what
`kite generate --upc` calls): 1,000 mutants of a small PCA-coded state of the tiny Llama, five
kinds (kite.upcycle.format.mutants), each refused with one line or loaded exactly as the original:
never a crash, an internal exception, or KV that differs without an error. Then (slow) 500 of the
same state written without the header's content digest (as before it): still never a crash nor an
internal exception, the parts' structure checked against their layer and cluster."""

from __future__ import annotations

import pytest

from kite.upcycle.format import MUTANT_KINDS, make_mutant
from kite.upcycle.study import BAD_OUTCOMES, OUTCOMES, counts, fuzz_states, make_fuzz_state
from tests.tiny_models import CORPUS

N_MUTANTS = 1000
N_UNBOUND = 500
DOC = CORPUS.replace(". ", ".\n\n", 3)

# Without the header's content digest (a state written before it) a reader has only each part's own
# structure to go by: what it cannot tell, strict (the day a check catches it, the xfail must go).
UNBOUND = {
    "blob": "without a content digest nothing binds a part's values: a value edited and its checksum "
            "recomputed loads into other KV",
}
# (keys swapped between twin parts, of the same size and widths, load into other KV too: this
# state's parts have none, tests/test_state_checks.py pins that limit on a state that has them)


@pytest.fixture(scope="module")
def state(tiny_models, tmp_path_factory):
    return make_fuzz_state(tiny_models["llama"], DOC, tmp_path_factory.mktemp("fuzz") / "small.upc")


@pytest.fixture(scope="module")
def outcomes(tiny_models, state):
    return fuzz_states(tiny_models["llama"], state, N_MUTANTS, seed=0, batch=N_MUTANTS // 2, workers=2)


@pytest.fixture(scope="module")
def unbound_outcomes(tiny_models, tmp_path_factory):
    state = make_fuzz_state(tiny_models["llama"], DOC, tmp_path_factory.mktemp("fuzz") / "older.upc", content=False)
    return fuzz_states(tiny_models["llama"], state, N_UNBOUND, seed=1, batch=N_UNBOUND // 2, workers=2)


def test_every_mutant_has_one_outcome_of_its_kind(outcomes):
    assert [o.index for o in outcomes] == list(range(N_MUTANTS))
    assert all(o.outcome in OUTCOMES for o in outcomes)
    by_kind = counts(outcomes)
    assert sorted(by_kind) == sorted(MUTANT_KINDS)
    assert all(sum(c.values()) == N_MUTANTS // len(MUTANT_KINDS) for c in by_kind.values())


@pytest.mark.parametrize("kind", MUTANT_KINDS)
def test_no_mutant_crashes_escapes_or_loads_differently(outcomes, kind):
    _assert_clean(outcomes, kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.xfail(reason=UNBOUND[k], strict=True))
                                  if k in UNBOUND else k for k in MUTANT_KINDS])
def test_without_a_content_digest_no_mutant_crashes_or_escapes(unbound_outcomes, kind):
    assert not [o for o in unbound_outcomes if o.kind == kind and o.outcome in ("crash", "internal")]
    _assert_clean(unbound_outcomes, kind)


def _assert_clean(outcomes, kind):
    bad = [o for o in outcomes if o.kind == kind and o.outcome in BAD_OUTCOMES]
    shown = "\n".join(f"{o.outcome}: {o.name} ({o.detail})" for o in bad[:10])
    assert not bad, f"{len(bad)} of the {kind} mutants: {counts(outcomes)[kind]}\n{shown}"


def test_refusals_are_one_line(outcomes):
    refused = [o for o in outcomes if o.outcome == "refused"]
    assert refused
    assert all(o.detail and "\n" not in o.detail for o in refused)


def test_mutants_are_made_from_the_seed_and_index_alone(state):
    data = state.read_bytes()
    for i in range(2 * len(MUTANT_KINDS)):
        a, b = make_mutant(data, i, seed=3), make_mutant(data, i, seed=3)
        assert (a.kind, a.name, a.data) == (b.kind, b.name, b.data)
        assert a.kind == MUTANT_KINDS[i % len(MUTANT_KINDS)]
    assert any(make_mutant(data, i, seed=3).data != make_mutant(data, i, seed=4).data for i in range(5))


def crashing_load(path, lm):
    """A loader for the fuzzer's own test: a native crash on mutants 1 and 5, an internal exception on
    2 and 6, the public load path otherwise."""
    import os
    import signal

    from kite.upcycle.study.state_fuzz import load_state

    index = int(path.stem[1:]) if path.stem.startswith("m") else -1
    if index % 4 == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    if index % 4 == 2:
        raise KeyError("codes")
    return load_state(path, lm)


@pytest.mark.slow
def test_the_fuzzer_counts_a_crash_and_goes_on(tiny_models, state):
    got = fuzz_states(tiny_models["llama"], state, 8, seed=0, batch=8, loader=f"{__name__}:crashing_load")
    assert [o.index for o in got] == list(range(8))
    assert [o.index for o in got if o.outcome == "crash"] == [1, 5]
    assert all(o.detail == "killed by SIGSEGV" for o in got if o.outcome == "crash")
    assert [o.index for o in got if o.outcome == "internal"] == [2, 6]
    assert all(o.outcome in ("refused", "identical") for o in got if o.index % 4 in (0, 3))
