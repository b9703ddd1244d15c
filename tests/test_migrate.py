"""`kite upcycle migrate`: fingerprints and names rewritten, geometry checked, journaled."""

from __future__ import annotations


import pytest
from typer.testing import CliRunner

from kite.cli.main import app
from kite.model.fingerprint import fingerprints, short
from kite.upcycle import codec
from kite.upcycle import migration as mig
from kite.upcycle.compress import CompressSettings, compress_document
from kite.upcycle.load import load_prefix
from kite.upcycle.format import StateFile
from tests.conftest import parse_json
from tests.tiny_models import CORPUS, make_tiny_model

runner = CliRunner()


@pytest.fixture()
def setup(tiny_models, tmp_path):
    """Two states of model A (one named by its fingerprint), model B of the same geometry."""
    from kite.model import load_model

    a = load_model(str(tiny_models["llama"]), device="cpu")
    b_dir = make_tiny_model(tmp_path / "model-b", "llama", seed=9)
    states = tmp_path / "states"
    states.mkdir()
    old = short(a.fingerprints.combined)
    settings = CompressSettings(codec=codec.settings_for("exact"), n_clusters=2, min_span_tokens=8)
    compress_document(a, CORPUS, states / f"contract.{old}.upc", settings)
    compress_document(a, CORPUS[:400], states / "notes.upc", settings)
    return a, b_dir, states, old, short(fingerprints(b_dir).combined)


def test_dry_run_changes_nothing(setup):
    _, b_dir, states, old, new = setup
    before = {p.name: p.read_bytes() for p in states.iterdir()}
    result = runner.invoke(app, ["upcycle", "migrate", "--old-model-fingerprint", old, "--new-model-fingerprint",
                                 new, "--upcycle-dir", str(states), "--new-model", str(b_dir), "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    report = parse_json(result.stdout)
    assert [f["action"] for f in report["files"]] == ["migrate", "migrate"]
    assert {p.name: p.read_bytes() for p in states.iterdir()} == before


def test_migrate_rewrites_fingerprints_and_names_and_loads(setup):
    from kite.model import load_model

    _, b_dir, states, old, new = setup
    result = runner.invoke(app, ["upcycle", "migrate", "--old-model-fingerprint", old, "--new-model-fingerprint",
                                 new, "--upcycle-dir", str(states), "--new-model", str(b_dir), "--json"])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in states.iterdir())
    assert names == sorted([f"contract.{new}.upc", "notes.upc"])  # no journal left behind
    meta = StateFile(states / f"contract.{new}.upc").meta
    assert short(meta["fingerprints"]["combined"]) == new
    assert short(meta["fingerprints"]["migrated_from"]) == old
    prefix, _ = load_prefix(states / "notes.upc", load_model(str(b_dir), device="cpu"))
    assert prefix.next_position > 0
    again = runner.invoke(app, ["upcycle", "migrate", "--old-model-fingerprint", old, "--new-model-fingerprint",
                                new, "--upcycle-dir", str(states), "--json"])
    assert {f["action"] for f in parse_json(again.stdout)["files"]} == {"skip"}


def test_other_geometry_is_refused_unless_forced(setup, tiny_models):
    _, _, states, old, _ = setup
    qwen = tiny_models["qwen2"]  # other RoPE theta: keys would be rotated wrongly
    new = short(fingerprints(qwen).combined)
    args = ["upcycle", "migrate", "--old-model-fingerprint", old, "--new-model-fingerprint", new,
            "--upcycle-dir", str(states), "--new-model", str(qwen)]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "geometry differs" in result.output
    assert (states / f"contract.{old}.upc").exists()
    assert runner.invoke(app, args + ["--force"]).exit_code == 0
    assert (states / f"contract.{new}.upc").exists()


def test_wrong_new_fingerprint_for_the_model(setup):
    _, b_dir, states, old, _ = setup
    result = runner.invoke(app, ["upcycle", "migrate", "--old-model-fingerprint", old, "--new-model-fingerprint",
                                 "deadbeefdead", "--upcycle-dir", str(states), "--new-model", str(b_dir)])
    assert result.exit_code == 2 and "is not the fingerprint of --new-model" in result.output


def test_bad_fingerprint_argument(setup):
    _, _, states, _, _ = setup
    result = runner.invoke(app, ["upcycle", "migrate", "--old-model-fingerprint", "xyz", "--new-model-fingerprint",
                                 "abcdef012345", "--upcycle-dir", str(states)])
    assert result.exit_code == 2 and "expected a fingerprint" in result.output


def _interrupt_second_file(monkeypatch, states, old, new, new_fps) -> None:
    """Run a migration that dies (a power cut) while rewriting its second file."""
    real, calls = mig.rewrite_header, {"n": 0}

    def crash_on_second(src, dest, meta):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("power cut")
        return real(src, dest, meta)

    monkeypatch.setattr(mig, "rewrite_header", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        mig.migrate(states, old, new, new_fps=new_fps)
    monkeypatch.setattr(mig, "rewrite_header", real)


def test_interrupted_run_resumes(setup, monkeypatch):
    _, b_dir, states, old, new = setup
    new_fps = fingerprints(b_dir)
    _interrupt_second_file(monkeypatch, states, old, new, new_fps)
    assert (states / mig.JOURNAL).exists()
    report = mig.migrate(states, old, new, new_fps=new_fps)
    assert report.resumed
    assert not (states / mig.JOURNAL).exists()
    for path in states.glob("*.upc"):
        assert short(StateFile(path).meta["fingerprints"]["combined"]) == new


def test_interrupted_run_rolls_back(setup, monkeypatch):
    _, b_dir, states, old, new = setup
    before = {p.name: StateFile(p).meta["fingerprints"] for p in states.glob("*.upc")}
    _interrupt_second_file(monkeypatch, states, old, new, fingerprints(b_dir))
    other = runner.invoke(app, ["upcycle", "migrate", "--old-model-fingerprint", "abcdef012345",
                                "--new-model-fingerprint", new, "--upcycle-dir", str(states)])
    assert other.exit_code == 1 and "unfinished migration" in other.output
    result = runner.invoke(app, ["upcycle", "migrate", "--rollback", "--upcycle-dir", str(states), "--json"])
    assert result.exit_code == 0, result.output
    after = {p.name: StateFile(p).meta["fingerprints"] for p in states.glob("*.upc")}
    assert after == before
    assert not (states / mig.JOURNAL).exists()


def test_health_records_reset(setup):
    from kite.yoco.health import HealthStore

    _, b_dir, states, old, new = setup
    store = HealthStore()
    store.record("notes", "breach", 0.02)
    assert store.records("notes")
    mig.migrate(states, old, new, new_fps=fingerprints(b_dir), health=store)
    assert not store.records("notes")


def test_migrate_says_old_and_new_fingerprint_for_each_file(setup):
    _, b_dir, states, old, new = setup
    result = runner.invoke(app, ["upcycle", "migrate", "--old-model-fingerprint", old, "--new-model-fingerprint",
                                 new, "--upcycle-dir", str(states), "--new-model", str(b_dir), "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("would migrate")]
    assert len(lines) == 2, result.stdout
    for line in lines:  # notes.upc keeps its name: the line still says what changes
        assert f"fingerprint {old} → {new}" in line and line == line.rstrip(), line


@pytest.mark.parametrize("part,form", [("combined", "full"), ("model", "full"), ("tokenizer", "short")])
def test_any_of_the_three_fingerprints_names_the_states_and_the_plan_says_which(setup, part, form):
    """`kite upcycle inspect` shows the combined fingerprint (and the model's and tokenizer's):
    whichever is copied, in either form, names the states it made."""
    a, b_dir, states, _, new = setup
    fp = getattr(a.fingerprints, part)
    old = fp if form == "full" else short(fp)
    shown = parse_json(runner.invoke(app, ["upcycle", "inspect", str(states / "notes.upc"), "--json"]).stdout)
    assert fp in (shown["fingerprint"], shown["fingerprints"][part])
    result = runner.invoke(app, ["upcycle", "migrate", "--old-model-fingerprint", old, "--new-model-fingerprint",
                                 new, "--upcycle-dir", str(states), "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    files = parse_json(result.stdout)["files"]
    assert [f["action"] for f in files] == ["migrate", "migrate"]
    assert {f["matched"] for f in files} == {part} and all(part in f["reason"] for f in files)


def test_a_fingerprint_that_names_no_state_is_reported(setup):
    _, _, states, old, new = setup
    before = {p.name: p.read_bytes() for p in states.iterdir()}
    result = runner.invoke(app, ["upcycle", "migrate", "--old-model-fingerprint", "deadbeefdead",
                                 "--new-model-fingerprint", new, "--upcycle-dir", str(states)])
    assert result.exit_code == 2
    assert "names no state" in result.output and f"{old} (2 files)" in result.output
    assert {p.name: p.read_bytes() for p in states.iterdir()} == before


def test_a_state_coded_on_a_regenerator_moves_it_to_the_new_model(setup, tmp_path, monkeypatch):
    """The regenerator is copied for the new model (same bases), the state names the copy and loads
    on the new model with it; new states of the new model are coded on it; a rollback of an
    interrupted migration names the old one again."""
    import torch

    from kite.model import load_model
    from kite.upcycle.capture import capture
    from kite.upcycle.codec import RegeneratorFit
    from kite.upcycle.codec.regenerator import install, resolve

    a, b_dir, _, old, new = setup
    fit = RegeneratorFit(n_layers=a.geometry.n_layers)
    cap = capture(a, CORPUS)
    fit.add(cap.keys_pre, cap.values, cap.ids)
    reg = fit.finish({"model_fingerprint": a.fingerprints.base})
    install(reg)
    states = tmp_path / "regen-states"
    states.mkdir()
    ratio8 = CompressSettings(codec=codec.settings_for(8), n_clusters=2, min_span_tokens=8)
    for name in ("r", "s"):
        compress_document(a, CORPUS, states / f"{name}.{old}.upc", ratio8, regenerator=reg)
    b = load_model(str(b_dir), device="cpu")
    _interrupt_second_file(monkeypatch, states, old, new, b.fingerprints)
    mig.rollback(states)
    for path in states.glob("*.upc"):
        assert StateFile(path).meta["regenerator"]["fingerprint"] == reg.fingerprint
    report = mig.migrate(states, old, new, new_fps=b.fingerprints)
    done = [f for f in report.files if f.action == "migrate"]
    assert len(done) == 2
    moved_fps = {StateFile(f.new_path).meta["regenerator"]["fingerprint"] for f in done}
    assert len(moved_fps) == 1 and reg.fingerprint not in moved_fps       # one copy for both states
    assert all(f"regenerator {short(reg.fingerprint)}" in f.reason for f in done)
    moved = resolve(moved_fps.pop())
    moved.check_model(b)                                        # now the new model's
    assert all(torch.equal(moved.tensors[k], reg.tensors[k]) for k in reg.tensors)
    prefix, _ = load_prefix(done[0].new_path, b)                # decodes with the moved copy
    assert all(torch.isfinite(k).all() for k in prefix.keys)
    compress_document(b, CORPUS[:400], states / "new-model.upc", ratio8, regenerator=moved)
