"""`kite upcycle train --layer-group auto`: the groupings a run measures, the sums they share, the
choice following the measured error, and what the run reports and codes with what it chose."""

from __future__ import annotations

import json

import pytest
import torch

from kite.errors import BadInput
from kite.upcycle import CompressSettings, StateFile, codec_settings
from kite.upcycle.capture import capture
from kite.upcycle.compress import capture_for
from kite.upcycle.codec.regenerator import Regenerator, RegeneratorFit
from kite.upcycle.train.layer_group import candidate_groups, choose_layer_group, descend, validation_documents
from tests.tiny_models import CORPUS


@pytest.fixture(scope="module")
def tiny_lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["llama"]), device="cpu")


def _fits(lm, groups: tuple[int, ...]) -> dict[int, RegeneratorFit]:
    L = lm.geometry.n_layers
    fits = {g: RegeneratorFit(n_layers=L, layer_group=g) for g in groups}
    for i in range(3):
        cap = capture(lm, CORPUS[i * 97:] + CORPUS[:i * 97], queries=True)
        for fit in fits.values():
            fit.add(cap.keys_pre, cap.values, cap.ids, query_sq=cap.query_sq)
    return fits


def test_a_finer_grouping_of_the_sums_finishes_as_a_fit_of_its_own(tiny_lm):
    """Each group's sums and Gram are a slice of a coarser group's: the bases are those a fit made
    at the finer grouping would have."""
    from kite.upcycle.codec import model_value_weights

    fits = _fits(tiny_lm, (1, 3))
    vw = model_value_weights(tiny_lm)
    meta = {"model_fingerprint": tiny_lm.fingerprints.base}
    per_layer = fits[3].regroup(1)
    assert per_layer.layer_group == 1 and per_layer.tokens == fits[1].tokens and per_layer.documents == 3
    assert per_layer.digest.hexdigest() == fits[1].digest.hexdigest()
    for plain in (True, False):
        a = per_layer.finish(meta, value_weights=None if plain else vw)
        b = fits[1].finish(meta, value_weights=None if plain else vw)
        assert a.grouped is b.grouped is False and a.weighted is b.weighted is (not plain)
        assert set(a.tensors) == set(b.tensors)
        for name, t in a.tensors.items():
            if name.endswith(".basis"):      # eigenvectors up to sign: compare the projectors of the top components
                t, u = t[0, :, :8].double(), b.tensors[name][0, :, :8].double()
                assert torch.allclose(t @ t.T, u @ u.T, atol=1e-6), name
            else:
                assert torch.allclose(t, b.tensors[name], rtol=1e-5, atol=1e-6), name
    same = fits[3].regroup(3).finish(meta, value_weights=vw)
    assert same.fingerprint == fits[3].finish(meta, value_weights=vw).fingerprint
    with pytest.raises(ValueError, match="layer group 2 does not divide this fit's 3"):
        fits[3].regroup(2)


@pytest.mark.parametrize("layers, width, want", [(30, 192, [1, 2, 3, 5, 6, 10, 15, 30]),   # SmolLM2-135M
                                                 (28, 512, [1, 2, 4, 7, 14, 28]),           # Qwen2-7B: 14,336 wide
                                                 (32, 1024, [1, 2, 4, 8, 16]),              # 32 x 1,024 > 16,384
                                                 (7, 4096, [1])])                          # no group fits: per layer
def test_the_candidates_are_the_divisors_of_the_widest_group_that_fits(layers, width, want):
    assert candidate_groups(layers, width) == want


def test_the_measured_documents_are_a_seeded_fifth_of_the_training_documents():
    keys = [f"d{i:02d}" for i in range(23)]
    got = validation_documents(keys, seed=0)
    assert len(got) == 2 and set(got) <= set(keys) and got == validation_documents(list(reversed(keys)), seed=0)
    assert got != validation_documents(keys, seed=1)
    assert len(validation_documents(keys[:9], 0)) == 1 and len(validation_documents(keys[:2], 0)) == 1
    with pytest.raises(BadInput, match="--layer-group auto: 1 training document"):
        validation_documents(keys[:1], 0)


# KL by layers per basis as the H200 measured them on SmolLM2 at 16x (train_speed_h200_20261205_e72f431_auto.json)
MEASURED = {1: 0.093364, 2: 0.033558, 3: 0.021923, 5: 0.018048, 6: 0.011999, 10: 0.010056, 15: 0.005962,
            30: 0.004319}


@pytest.mark.parametrize("errors, want_measured, want", [
    (MEASURED, [30, 15], 30),                                         # falls with the span: two measured
    ({g: 1 / e for g, e in MEASURED.items()}, sorted(MEASURED, reverse=True), 1),   # rises: all of them
    ({**MEASURED, 15: 0.004, 10: 0.003, 6: 0.0035}, [30, 15, 10, 6], 10),   # falling below the widest: followed
    ({**MEASURED, 10: 0.004}, [30, 15], 30),                          # a dip behind a worse grouping: not seen
    ({**MEASURED, 15: 0.004319}, [30, 15], 15),                       # a tie: the smaller group, then stop
])
def test_the_search_measures_widest_first_and_stops_at_the_first_no_better(errors, want_measured, want):
    seen = []
    got, best = descend(list(errors), lambda g: seen.append(g) or errors[g])
    assert seen == want_measured and list(got) == want_measured and best == want


def test_the_text_names_what_was_measured_and_what_the_search_left():
    from kite.cli.upcycle_train import choice_text

    rows = [{"layer_group": g, "kl": MEASURED[g]} for g in (15, 30)]
    said = choice_text({"documents": 4, "candidates": rows, "not_measured": [1, 2, 3, 5, 6, 10]})
    assert said == ("KL on 4 measured documents: 15 layers 0.0060, 30 layers 0.0043; 1, 2, 3, 5, 6, 10 not "
                    "measured, 15 being no better")
    assert choice_text({"documents": 1, "candidates": rows[:1], "not_measured": []}) == \
        "KL on 1 measured document: 15 layers 0.0060"


def test_the_choice_follows_the_measured_error(tiny_lm):
    """Each candidate's states are measured as the settings code them: the grouping coded at the
    lower ratio (less error) wins, whichever it is."""
    fit = _fits(tiny_lm, (3,))[3]
    ids = tiny_lm.tokenizer(CORPUS[500:] + CORPUS, add_special_tokens=False)["input_ids"]
    docs = [(capture_for(tiny_lm, "", ids=ids[:200], keep_cache=True), ids[200:240])]

    def finish(f):
        return f.finish({"model_fingerprint": tiny_lm.fingerprints.base})

    for easy in (1, 3):
        def settings(g, ratio, easy=easy):
            return CompressSettings(codec=codec_settings(2.0 if g == easy else 24.0), n_clusters=2, min_span_tokens=8,
                                    max_span_tokens=24)

        got = choose_layer_group(tiny_lm, fit, docs, [8.0], finish, settings)
        assert got.chosen == easy and [r["layer_group"] for r in got.candidates] == [1, 3] and not got.not_measured
        kl = {r["layer_group"]: r["kl"] for r in got.candidates}
        assert kl[easy] < kl[4 - easy] and all(len(r["kl_by_document"]) == 1 for r in got.candidates)
    assert got.to_dict()["chosen"] == 3 and got.to_dict()["documents"] == 1


def test_the_search_stops_where_a_narrower_grouping_is_no_better(tmp_path):
    """A 4-layer model: the whole-state bases (coded at a low ratio) beat 2 layers a basis, so the
    search stops there; 1 layer a basis is not measured, and the progress bar ends full."""
    from kite.model import load_model
    from kite.testing.tiny_models import make_tiny_model

    lm = load_model(str(make_tiny_model(tmp_path / "four", "llama", layers=4)), device="cpu")
    fit = _fits(lm, (4,))[4]
    ids = lm.tokenizer(CORPUS[500:] + CORPUS, add_special_tokens=False)["input_ids"]

    def settings(g, ratio):
        return CompressSettings(codec=codec_settings(2.0 if g == 4 else 24.0), n_clusters=2, min_span_tokens=8,
                                max_span_tokens=24)

    calls = []
    got = choose_layer_group(lm, fit, [(capture_for(lm, "", ids=ids[:200], keep_cache=True), ids[200:240])], [8.0],
                             lambda f: f.finish({"model_fingerprint": lm.fingerprints.base}), settings,
                             lambda stage, done, total: calls.append((done, total)))
    assert got.chosen == 4 and [r["layer_group"] for r in got.candidates] == [2, 4] and got.not_measured == [1]
    assert calls == [(1, 3), (2, 3), (2, 2)]


def _train(tiny_models, tmp_path, out, *extra, docs=5):
    from typer.testing import CliRunner

    from kite.cli.main import app
    from tests.test_train import _pairs_file

    folder = tmp_path / f"pairs{docs}"
    folder.mkdir(exist_ok=True)
    return CliRunner().invoke(app, ["upcycle", "train", "--model", str(tiny_models["llama"]), "--data-path",
                                    str(_pairs_file(folder, docs=docs)), "--output-dir", str(out), "--eval-fraction",
                                    "0.2", "--regenerator-only", "--json", *extra])


def test_train_measures_every_grouping_and_codes_its_states_with_the_one_it_keeps(tiny_models, tmp_path):
    from tests.conftest import parse_json

    res = _train(tiny_models, tmp_path, tmp_path / "run", "--layer-group", "auto", "--ratio", "8")
    assert res.exit_code == 0, res.output
    rep = parse_json(res.output)
    choice = rep["regenerator"]["layer_group_choice"]
    assert [r["layer_group"] for r in choice["candidates"]] == [1, 3] and choice["documents"] == 1
    assert choice["chosen"] == min(choice["candidates"], key=lambda r: (r["kl"], r["layer_group"]))["layer_group"]
    assert all(r["kl"] >= 0 and len(r["kl_by_document"]) == 1 for r in choice["candidates"])
    reg = Regenerator.load(tmp_path / "run" / "regenerator")
    assert reg.meta["layer_group_choice"] == choice
    assert reg.grouped is (choice["chosen"] == 3)
    assert reg.meta["calibration"]["documents"] == rep["train_documents"] == 4    # the measured one added back
    assert rep["stages"]["calibrate_choose"]["count"] == 2
    assert rep["stages"]["calibrate_capture"]["count"] == 4
    states = sorted((tmp_path / "run" / "states").rglob("*.upc"))
    assert len(states) == 5                  # every document's, the measured and the held-out one too
    for path in states:
        with StateFile(path) as sf:
            assert sf.meta["regenerator"]["fingerprint"] == reg.fingerprint
            assert (sf.meta.get("layer_groups") is not None) is reg.grouped
    again = _train(tiny_models, tmp_path, tmp_path / "run", "--layer-group", "auto", "--ratio", "8", "--resume")
    assert again.exit_code == 0, again.output
    assert parse_json(again.output)["regenerator"]["fingerprint"] == reg.fingerprint
    other = _train(tiny_models, tmp_path, tmp_path / "run", "--layer-group", "3", "--ratio", "8", "--resume")
    assert other.exit_code != 0 and "holds another run (its layer-group differs)" in other.output


def test_two_runs_on_the_same_documents_fingerprint_the_same_regenerator(tiny_models, tmp_path):
    """The search's record in the regenerator is what it measured, not how long it took: a second run
    from scratch fits the same bases and names them by the same fingerprint (its states load with
    either folder)."""
    from tests.conftest import parse_json

    fps = []
    for name in ("one", "two"):
        res = _train(tiny_models, tmp_path, tmp_path / name, "--layer-group", "auto", "--ratio", "8")
        assert res.exit_code == 0, res.output
        rep = parse_json(res.output)["regenerator"]
        fps.append(rep["fingerprint"])
        choice = Regenerator.load(tmp_path / name / "regenerator").meta["layer_group_choice"]
        assert "seconds" not in json.dumps(choice) and choice == rep["layer_group_choice"]   # no clock in it
    assert fps[0] == fps[1]


def test_train_says_what_each_grouping_measured(tiny_models, tmp_path):
    from typer.testing import CliRunner

    from kite.cli.main import app
    from tests.test_train import _pairs_file

    res = CliRunner().invoke(app, ["upcycle", "train", "--model", str(tiny_models["llama"]), "--data-path",
                                   str(_pairs_file(tmp_path)), "--output-dir", str(tmp_path / "run"),
                                   "--eval-fraction", "0.2", "--regenerator-only"])      # auto: the default
    assert res.exit_code == 0, res.output
    line = next(x for x in res.stdout.splitlines() if x.strip().startswith("regenerator "))
    assert "(KL on 1 measured document: 1 layer 0." in line and ", 3 layers 0." in line, line


@pytest.mark.parametrize("value, docs, said", [
    ("two", 5, "--layer-group two: a whole number of layers, at least 1, or auto"),
    ("0", 5, "--layer-group 0: a whole number of layers, at least 1, or auto"),
    ("auto", 2, "--layer-group auto: 1 training document; the choice is measured on documents the calibration "
                "leaves out, so it needs at least 2"),
])
def test_train_refuses_a_bad_layer_group_in_one_line_before_the_model_loads(tiny_models, tmp_path, value, docs, said,
                                                                           monkeypatch):
    import kite.model
    import kite.model.loader

    def loaded(*a, **k):
        raise AssertionError("the model was loaded")

    for module in (kite.model, kite.model.loader):
        monkeypatch.setattr(module, "load_model", loaded)
    res = _train(tiny_models, tmp_path, tmp_path / "run", "--layer-group", value, docs=docs)
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip() and not line.startswith("[")]
    assert len(lines) == 1 and said in lines[0], res.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["auto", "3"])
def test_a_given_regenerator_refuses_a_layer_group(tiny_models, tmp_path, tiny_lm, value):
    from tests.test_train import _train as train_adapter

    fit = _fits(tiny_lm, (1,))[1]
    fit.finish({"model_fingerprint": tiny_lm.fingerprints.base}).save(tmp_path / "reg")
    res = train_adapter(tiny_models, tmp_path, tmp_path / "run", "--layer-group", value, "--regenerator",
                        str(tmp_path / "reg"))
    assert res.exit_code == 2 and "--regenerator --layer-group: a given regenerator's layer groups are its own" \
        in res.output, res.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_train_measures_the_groupings_and_codes_its_states_as_on_the_host(tiny_models, tmp_path):
    """The measurement runs where the model is: on a GPU the candidates' states are coded by the GPU's
    encoders, the choice and its figures come back, and the states the run keeps load."""
    from kite.model import load_model
    from kite.upcycle import TrainRequest, UpcycleConfig, load_prefix, read_pairs, train_upcycle
    from tests.test_train import _pairs_file

    lm = load_model(str(tiny_models["llama"]), device="cuda")
    pairs = read_pairs(_pairs_file(tmp_path, docs=6))
    req = TrainRequest(data_path="pairs", output_dir=tmp_path / "run", ratios=[8.0], eval_fraction=0.2,
                       adapter=False, layer_group="auto")
    rep = train_upcycle(lm, pairs, UpcycleConfig(), req)
    choice = rep["regenerator"]["layer_group_choice"]
    assert [r["layer_group"] for r in choice["candidates"]] == [1, 3] and choice["documents"] == 1
    assert all(r["kl"] >= 0 for r in choice["candidates"])
    reg = Regenerator.load(tmp_path / "run" / "regenerator")
    assert reg.grouped is (choice["chosen"] == 3)
    states = sorted((tmp_path / "run" / "states").rglob("*.upc"))
    assert len(states) == 6
    for path in states:
        prefix, _ = load_prefix(path, lm, regenerator=reg)
        assert all(torch.isfinite(k).all() for k in prefix.keys)


def test_the_full_context_continues_the_capture_s_cache_as_a_second_prefill_would(tiny_lm):
    """The search's baseline reads the continuation after the capture's own cache (one prefill of the
    document, not two): the logits are those of a fresh prefill of the context."""
    from kite.upcycle.quality import full_logits

    ids = tiny_lm.tokenizer(CORPUS, add_special_tokens=False)["input_ids"]
    ctx, cont = ids[:300], ids[300:340]
    cap = capture(tiny_lm, "", ids=ctx, keep_cache=True, chunk_tokens=128)
    continued = full_logits(tiny_lm, ctx, cont, cache=cap.cache)
    fresh = full_logits(tiny_lm, ctx, cont)
    assert continued.shape == fresh.shape == (len(cont) - 1, fresh.shape[1])
    torch.testing.assert_close(continued, fresh, rtol=1e-4, atol=1e-4)


def test_the_search_hands_back_each_capture_as_it_was_made(tiny_lm):
    """After the search a capture's cache holds its context again (the calibration and the teacher go
    on with it), so a second search on the same captures measures the same; a capture made without
    its cache is refused."""
    fit = _fits(tiny_lm, (3,))[3]
    ids = tiny_lm.tokenizer(CORPUS[300:] + CORPUS, add_special_tokens=False)["input_ids"]
    cap = capture_for(tiny_lm, "", ids=ids[:200], keep_cache=True)

    def settings(g, ratio):
        return CompressSettings(codec=codec_settings(8.0), n_clusters=2, min_span_tokens=8, max_span_tokens=24)

    def finish(f):
        return f.finish({"model_fingerprint": tiny_lm.fingerprints.base})

    first = choose_layer_group(tiny_lm, fit, [(cap, ids[200:240])], [8.0], finish, settings)
    assert cap.cache.get_seq_length() == 200
    again = choose_layer_group(tiny_lm, fit, [(cap, ids[200:240])], [8.0], finish, settings)
    assert [r["kl"] for r in again.candidates] == [r["kl"] for r in first.candidates]
    with pytest.raises(ValueError, match="cache kept"):
        choose_layer_group(tiny_lm, fit, [(capture(tiny_lm, "", ids=ids[:200]), ids[200:240])], [8.0], finish,
                           settings)
