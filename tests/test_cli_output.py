"""Output a CI log can use: progress lines off a terminal (on stderr, never in `--json` stdout),
nothing cut at 80 columns, and Ctrl-C saying what was interrupted and what was kept (exit 130)."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from kite.cli.main import app
from tests.tiny_models import CORPUS

runner = CliRunner()
PROGRESS_LINE = re.compile(r"^\[\s*\d+\.\d+s\] (?P<stage>.+) (?P<done>\d+)/(?P<total>\d+)$")


def _progress(stderr: str) -> list[tuple[str, int, int]]:
    """The progress lines of a run's stderr as (stage, done, total)."""
    return [(m["stage"], int(m["done"]), int(m["total"]))
            for m in map(PROGRESS_LINE.match, stderr.splitlines()) if m]


@pytest.fixture()
def upcycle_cfg(tmp_path):
    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text("compression: {svd_ratio: 0.25, cluster_num: 2, min_span_tokens: 6, max_span_tokens: 14}\n"
                   "semantic_tagging: {generated_examples_per_label: 0}\n")
    return cfg


@pytest.fixture()
def doc(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text(CORPUS.replace(". ", ".\n\n"))
    return path


# --- 6. progress off a terminal -------------------------------------------------------------

def test_plain_progress_prints_first_and_last_step_and_at_most_every_interval(capsys):
    from kite.cli._progress import PlainProgress

    now = [0.0]
    p = PlainProgress(interval_s=5.0, clock=lambda: now[0])
    for done in range(1, 11):   # ten steps, one a second
        now[0] += 1.0
        p("prefill", done, 10)
    p("prefill", 10, 10)   # the same step again: not a second line
    now[0] += 0.1
    p("compress", 1, 3)
    lines = _progress(capsys.readouterr().err)
    assert lines == [("prefill", 1, 10), ("prefill", 6, 10), ("prefill", 10, 10), ("compress", 1, 3)]


def test_a_long_step_has_its_line_repeated_while_it_runs(capsys):
    from kite.cli._progress import PlainProgress

    now = [0.0]
    p = PlainProgress(clock=lambda: now[0], quiet_s=30.0)
    p.beat()   # nothing running yet
    p("tagger", 0, 1)
    for t in (10.0, 29.0, 31.0, 45.0, 62.0):   # a timer thread calls beat() every few seconds
        now[0] = t
        p.beat()
    p("tagger", 1, 1)
    now[0] = 200.0
    p.beat()   # nothing running: quiet
    assert capsys.readouterr().err.splitlines() == [
        "[    0.0s] tagger 0/1", "[   31.0s] tagger 0/1 (running)", "[   62.0s] tagger 0/1 (running)",
        "[   62.0s] tagger 1/1"]


def test_the_timer_thread_ends_with_the_progress(capsys, monkeypatch):
    import threading

    import kite.cli._common as common
    from kite.cli import _progress

    monkeypatch.setattr(common, "_err_console", None)   # made for capsys's stderr: not a terminal
    with _progress.progress_bar() as progress:
        assert any(t.name == "kite-progress" for t in threading.enumerate())
    assert not any(t.name == "kite-progress" for t in threading.enumerate())
    assert isinstance(progress, _progress.PlainProgress)


def test_compress_prints_progress_lines_on_stderr_and_only_json_on_stdout(tiny_models, tmp_path, upcycle_cfg,
                                                                          doc, one_thread):
    r = runner.invoke(app, ["upcycle", "compress", "--model", str(tiny_models["llama"]), "--input", str(doc),
                            "--output", str(tmp_path / "d.upc"), "--config", str(upcycle_cfg), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["n_tokens"] > 0   # stdout is the JSON document alone
    stages = {stage: (done, total) for stage, done, total in _progress(r.stderr)}
    assert stages["prefill"][0] == stages["prefill"][1] > 0   # each stage's last step is shown
    assert stages["compress"][0] == stages["compress"][1] == 3   # the tiny model's 3 layers


def test_eval_reports_its_full_context_pass_and_passkey_depths(tiny_models, upcycle_cfg, doc, one_thread):
    r = runner.invoke(app, ["upcycle", "eval", "--model", str(tiny_models["llama"]), "--input", str(doc),
                            "--config", str(upcycle_cfg), "--context-tokens", "120", "--continuation-tokens", "20",
                            "--probe", "passkey", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    lo, hi = got["ppl_delta_interval"]
    assert lo <= got["ppl_delta"] <= hi
    lines = _progress(r.stderr)
    assert ("full context", 1, 1) in lines and ("passkey", 5, 5) in lines
    assert {"prefill", "compress"} <= {stage for stage, _, _ in lines}


def test_eval_reads_the_model_at_the_precision_asked(tiny_models, upcycle_cfg, doc, one_thread):
    args = ["upcycle", "eval", "--model", str(tiny_models["llama"]), "--input", str(doc), "--config", str(upcycle_cfg),
            "--context-tokens", "120", "--continuation-tokens", "20", "--json"]
    low = runner.invoke(app, args + ["--dtype", "bf16"])
    assert low.exit_code == 0, low.output
    assert any("the model runs in bf16" in w for w in json.loads(low.stdout)["warnings"])
    full = runner.invoke(app, args + ["--dtype", "fp32"])
    assert full.exit_code == 0, full.output
    assert not any("the model runs in" in w for w in json.loads(full.stdout)["warnings"])


def test_eval_says_how_far_its_delta_moves_with_the_continuation(tiny_models, upcycle_cfg, doc, one_thread):
    r = runner.invoke(app, ["upcycle", "eval", "--model", str(tiny_models["llama"]), "--input", str(doc),
                            "--config", str(upcycle_cfg), "--context-tokens", "120", "--continuation-tokens", "80"])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stdout.splitlines() if "PPL full" in x)
    assert "95 % of resamples of the continuation:" in line, line


def test_eval_tagging_reports_every_step(tiny_models, tmp_path, one_thread):
    from kite.data import generate_contracts, to_jsonl

    cases = tmp_path / "cases.jsonl"
    cases.write_text(to_jsonl(generate_contracts(2, 90, 0)))
    r = runner.invoke(app, ["upcycle", "eval-tagging", "--model", str(tiny_models["llama"]), "--cases", str(cases),
                            "--examples-per-label", "2", "--mode", "standalone", "--json"])
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)
    lines = _progress(r.stderr)
    for step in ("model", "fit tagger", "fit query head", "standalone"):
        assert (step, 1, 1) in lines, lines


def test_a_model_conversion_message_goes_to_stderr_not_into_json(tiny_models, monkeypatch):
    from kite.model import loader

    real = loader.load_config_only

    def converting(spec, progress=None):
        progress("converting model.gguf to safetensors (once)")
        return real(spec)

    monkeypatch.setattr(loader, "load_config_only", converting)
    r = runner.invoke(app, ["model", "info", "--model", str(tiny_models["llama"]), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["n_layers"] == 3 and "converting model.gguf" in r.stderr


# --- 7. nothing cut at 80 columns -----------------------------------------------------------

def _commands(group, path=()):
    import click

    for name, cmd in group.commands.items():
        yield (*path, name)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))


def test_no_help_text_is_cut_off_a_terminal():
    import typer

    root = typer.main.get_command(app)
    cut = {}
    for path in [(), *_commands(root)]:
        r = runner.invoke(app, [*path, "--help"])
        assert r.exit_code == 0, (path, r.output)
        if "…" in r.output:
            cut[" ".join(path)] = [line for line in r.output.splitlines() if "…" in line]
    assert not cut


def test_yoco_fields_are_whole_off_a_terminal_and_fold_at_an_explicit_columns():
    from kite.yoco.signals import SIGNAL_FIELDS

    r = runner.invoke(app, ["yoco", "fields"])
    assert r.exit_code == 0
    rows = {line.split()[0]: line for line in r.stdout.splitlines()[1:] if line.strip()}
    for f in SIGNAL_FIELDS.values():   # one line per field: name, type, unit and the whole meaning
        assert f.name in rows and rows[f.name].rstrip().endswith(f.doc), rows.get(f.name)
    narrow = runner.invoke(app, ["yoco", "fields"], env={"COLUMNS": "60"})
    assert narrow.exit_code == 0 and "…" not in narrow.stdout
    assert max(map(len, narrow.stdout.splitlines())) <= 60
    # wrapped and folded onto more lines, never cut: the same characters as the wide table
    assert sorted("".join(narrow.stdout.split())) == sorted("".join(r.stdout.split()))


def test_long_lines_are_not_wrapped_off_a_terminal(capsys, monkeypatch):
    """A rich print off a terminal stays one line however long (a log is not wrapped at 80)."""
    import kite.cli._common as common

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(common, "_console", None)
    long = "x" * 150 + " " + "y" * 150
    common.console().print(long, highlight=False)
    assert capsys.readouterr().out == long + "\n"


# --- 8. Ctrl-C ----------------------------------------------------------------------------------

def test_ctrl_c_in_compress_says_nothing_was_written_and_exits_130(tiny_models, tmp_path, upcycle_cfg, doc,
                                                                   monkeypatch):
    from kite.upcycle import compress as compress_mod

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(compress_mod, "capture", interrupted)
    out = tmp_path / "d.upc"
    r = runner.invoke(app, ["upcycle", "compress", "--model", str(tiny_models["llama"]), "--input", str(doc),
                            "--output", str(out), "--config", str(upcycle_cfg)], prog_name="kite")
    assert r.exit_code == 130
    lines = [line for line in r.stderr.splitlines() if line.startswith("interrupted")]
    assert len(lines) == 1 and "kite upcycle compress" in lines[0] and str(out) in lines[0], r.stderr
    assert not out.exists() and not list(tmp_path.glob(".d.upc.*"))


def test_ctrl_c_elsewhere_names_the_command_and_the_default_kept(monkeypatch):
    from kite.cli._common import KEPT_BY_DEFAULT
    from kite.yoco import signals

    class Interrupting(dict):
        def values(self):
            raise KeyboardInterrupt

    monkeypatch.setattr(signals, "SIGNAL_FIELDS", Interrupting())
    r = runner.invoke(app, ["yoco", "fields"], prog_name="kite")
    assert r.exit_code == 130
    assert r.stderr.strip() == f"interrupted (Ctrl-C): kite yoco fields: {KEPT_BY_DEFAULT}"


def test_ctrl_c_in_migrate_says_the_folder_is_half_migrated_and_how_to_resume_or_roll_back(
        tiny_models, tmp_path, monkeypatch):
    import shlex

    from kite.model import load_model
    from kite.model.fingerprint import fingerprints, short
    from kite.upcycle import codec
    from kite.upcycle import migration as mig
    from kite.upcycle.compress import CompressSettings, compress_document
    from kite.upcycle.format import StateFile
    from tests.tiny_models import make_tiny_model

    a = load_model(str(tiny_models["llama"]), device="cpu")
    b_dir = make_tiny_model(tmp_path / "model-b", "llama", seed=9)
    states = tmp_path / "states"
    states.mkdir()
    settings = CompressSettings(codec=codec.settings_for("exact"), n_clusters=2, min_span_tokens=8)
    compress_document(a, CORPUS, states / "one.upc", settings)
    compress_document(a, CORPUS[:400], states / "two.upc", settings)
    old, new = short(a.fingerprints.combined), short(fingerprints(b_dir).combined)
    real, calls = mig.rewrite_header, {"n": 0}

    def crash_on_second(src, dest, meta):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(src, dest, meta)

    monkeypatch.setattr(mig, "rewrite_header", crash_on_second)
    args = ["upcycle", "migrate", "--old-model-fingerprint", old, "--new-model-fingerprint", new,
            "--upcycle-dir", str(states)]
    r = runner.invoke(app, args)
    assert r.exit_code == 130
    line = r.stderr.strip()
    assert "\n" not in line and "half-migrated (1 states moved" in line, line
    resume, rollback = re.findall(r"`([^`]+)`", line)
    assert shlex.split(resume)[1:] == args and shlex.split(rollback)[1:] == [
        "upcycle", "migrate", "--rollback", "--upcycle-dir", str(states)]
    monkeypatch.setattr(mig, "rewrite_header", real)
    again = runner.invoke(app, shlex.split(resume)[1:] + ["--json"])   # the printed command resumes it
    assert again.exit_code == 0, again.output
    assert not (states / mig.JOURNAL).exists()
    assert all(short(StateFile(p).meta["fingerprints"]["combined"]) == new for p in states.glob("*.upc"))


def test_a_stage_detail_keeps_one_line_rhythm_and_shows_the_latest_detail(capsys):
    """`stage · detail`: the interval is the stage's (a changing detail is not a new stage)."""
    from kite.cli._progress import PlainProgress

    t = [0.0]
    p = PlainProgress(interval_s=5.0, clock=lambda: t[0])
    for step in range(1, 11):
        t[0] = step * 1.0
        p(f"train · loss {1 / step:.3f}", step, 10)
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split("] ", 1)[1] for ln in lines] == ["train · loss 1.000 1/10", "train · loss 0.167 6/10",
                                                      "train · loss 0.100 10/10"]


@pytest.mark.parametrize("ratio, hinted", [("4", False), ("16", True)])
def test_compress_at_a_high_ratio_without_a_regenerator_points_to_one(tiny_models, tmp_path, upcycle_cfg, doc,
                                                                      one_thread, ratio, hinted):
    r = runner.invoke(app, ["upcycle", "compress", "--model", str(tiny_models["llama"]), "--input", str(doc),
                            "--output", str(tmp_path / "d.upc"), "--config", str(upcycle_cfg), "--ratio", ratio])
    assert r.exit_code == 0, r.output
    assert ("kite upcycle train --regenerator-only" in r.stdout) is hinted, r.stdout


def test_compress_at_a_high_ratio_on_a_regenerator_gives_no_hint(tiny_models, tmp_path, upcycle_cfg, doc, one_thread):
    from kite.model import load_model
    from kite.upcycle.capture import capture
    from kite.upcycle.codec.regenerator import RegeneratorFit

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    fit = RegeneratorFit(n_layers=lm.geometry.n_layers, layer_group=lm.geometry.n_layers)
    for i in range(3):
        cap = capture(lm, CORPUS[i * 97:] + CORPUS[:i * 97])
        fit.add(cap.keys_pre, cap.values, cap.ids)
    fit.finish({"model_fingerprint": lm.fingerprints.base}).save(tmp_path / "reg")
    r = runner.invoke(app, ["upcycle", "compress", "--model", str(tiny_models["llama"]), "--input", str(doc),
                            "--output", str(tmp_path / "d.upc"), "--config", str(upcycle_cfg), "--ratio", "16",
                            "--regenerator", str(tmp_path / "reg")])
    assert r.exit_code == 0, r.output
    assert "16" in r.stdout and "regenerator-only" not in r.stdout, r.stdout
