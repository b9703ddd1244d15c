"""Files KITE writes (kite/atomic.py): stale temp files of a killed writer are cleaned by the next
write, a missing output folder is refused unless asked for, permissions follow the umask."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kite.atomic import atomic_writer, check_output, remove_stale_temps, temp_pattern, write_text
from kite.cli.main import app
from kite.errors import BadInput

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

# A writer that dies (SIGKILL) in the middle of writing `target`, or one that stays alive holding its
# temp file; both print "ready" once the temp file is there.
WRITER = """
import sys, time
from kite.atomic import atomic_writer
with atomic_writer(sys.argv[1]) as fh:
    fh.write(b"half of it")
    fh.flush()
    print("ready", flush=True)
    time.sleep(120)   # the live writer itself (killed by the test), not a wait
"""


def _start_writer(target: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _temps(target: Path) -> list[str]:
    pattern = temp_pattern(target)
    return sorted(n for n in os.listdir(target.parent) if pattern.fullmatch(n))


def _write_in_new_process(target: Path, text: str) -> None:
    """The next run: a new process that writes `target`."""
    subprocess.run([sys.executable, "-c", "import sys; from kite.atomic import write_text; "
                    "write_text(sys.argv[1], sys.argv[2])", str(target), text],
                   cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_killed_writers_temp_file_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "doc.upc"
    target.write_text("old")
    killed = _start_writer(target)
    stale = _temps(target)
    assert len(stale) == 1
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert _temps(target) == stale and target.read_text() == "old"   # the old file, never a mix
    alive = _start_writer(target)       # a writer still at work: its temp file must survive
    try:
        working = sorted(set(_temps(target)) - set(stale))
        other_tool = tmp_path / ".doc.upc.partial.tmp"                 # not KITE's pattern
        other_target = tmp_path / f".notes.json.{stale[0].split('.')[-2]}.tmp"  # another target's
        other_tool.write_text("x")
        other_target.write_text("x")
        _write_in_new_process(target, "new")
        assert target.read_text() == "new"
        assert _temps(target) == working                                 # the stale one is gone
        assert other_tool.exists() and other_target.exists()
    finally:
        alive.kill()
        alive.wait()


def test_a_stale_temp_file_goes_only_when_older_than_this_process_and_unlocked(tmp_path):
    target = tmp_path / "results.json"
    old = tmp_path / ".results.json.abcd1234.tmp"
    new = tmp_path / ".results.json.efgh5678.tmp"
    old.write_text("left by a crash")
    new.write_text("another writer, between creating its file and locking it")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    write_text(target, "{}")
    assert not old.exists() and new.exists()
    assert remove_stale_temps(target) == []   # nothing left that is stale


def test_a_missing_folder_is_refused_and_not_made(tmp_path):
    target = tmp_path / "no" / "such" / "x.json"
    with pytest.raises(BadInput, match="the folder .*/no/such does not exist"):
        write_text(target, "{}")
    assert not (tmp_path / "no").exists()
    with pytest.raises(BadInput, match=r"--output .*: the folder .* does not exist; give --mkdir"):
        check_output(target, flag="--output")
    check_output(target, mkdir=True, flag="--output")
    write_text(target, "{}")
    assert target.read_text() == "{}"


def test_an_output_that_is_a_folder_is_refused_before_the_model_loads(tmp_path, monkeypatch, tiny_models):
    with pytest.raises(BadInput, match=r"^--output .*: is a folder; name the file to write$"):
        check_output(tmp_path, flag="--output")
    import kite.model

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kite.model, "load_model", no_model)
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document. " * 20)
    r = CliRunner().invoke(app, ["upcycle", "compress", "--model", str(tiny_models["llama"]), "--input", str(doc),
                                 "--output", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert "is a folder" in r.output and "model was loaded" not in r.output


def test_folders_under_kite_home_and_the_cache_are_made(kite_home, tmp_path, monkeypatch):
    monkeypatch.setenv("KITE_CACHE", str(tmp_path / "cache"))
    write_text(kite_home / "results" / "x.json", "{}")
    write_text(tmp_path / "cache" / "taggers" / "t.json", "{}")
    assert (kite_home / "results" / "x.json").exists() and (tmp_path / "cache" / "taggers" / "t.json").exists()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_files_follow_the_umask(tmp_path, umask, mode):
    before = os.umask(umask)
    try:
        write_text(tmp_path / "a.json", "{}")
        with atomic_writer(tmp_path / "b.upc") as fh:
            fh.write(b"x")
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "b.upc").stat().st_mode) == mode


def test_a_file_written_over_keeps_its_mode(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("a: 1\n")
    path.chmod(0o600)
    before = os.umask(0o022)
    try:
        write_text(path, "a: 2\n")
    finally:
        os.umask(before)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "a: 2\n"


# --- every command with an output path -----------------------------------------------------------

def _commands(tmp_path: Path) -> list[tuple[list[str], Path]]:
    doc = tmp_path / "doc.txt"
    doc.write_text("One clause. Another clause.\n")
    missing = tmp_path / "missing"
    return [
        (["upcycle", "compress", "--input", str(doc), "--output", str(missing / "x.upc")], missing),
        (["upcycle", "eval-tagging", "--queries", str(doc), "--save-tagger", str(missing / "t.json")], missing),
        (["data", "contracts", "--n", "1", "--out", str(missing / "c.jsonl")], missing),
        (["data", "traffic", "--n", "5", "--out", str(missing / "t.jsonl")], missing),
        (["bench", "cases", "--out", str(missing / "c.jsonl")], missing),
        (["bench", "run", "--output", str(missing / "r.json")], missing),
        (["bench", "run", "--output", str(tmp_path / "r.json"), "--plot", str(missing / "plots")], missing),
        (["bench", "run", "--output", str(tmp_path / "r.json"), "--upcycle", str(missing / "states")], missing),
        (["bench", "run", "--output", str(tmp_path / "r.json"), "--health-store", str(missing / "h.sqlite")],
         missing),
        (["yoco", "analyze", "--queries", str(doc), "--plot", str(missing / "h.png")], missing),
        (["shadow", "--golden", str(doc), "--candidate", str(doc), "--cases", str(doc), "--upcycle",
          str(missing / "states")], missing),
        (["serve", "--state-dir", str(missing / "states")], missing),
        (["gguf", "embed", str(doc), str(doc), "-o", str(missing / "m.gguf")], missing),
        (["gguf", "extract", str(doc), "--state", "s", "-o", str(missing / "s.upc")], missing),
    ]


def test_every_output_path_refuses_a_missing_folder(tmp_path):
    for args, missing in _commands(tmp_path):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "does not exist" in result.output and "--mkdir" in result.output, (args, result.output)
        assert not missing.exists(), args


def test_a_missing_folder_at_the_filesystem_root_is_not_made():
    result = runner.invoke(app, ["data", "traffic", "--n", "5", "--out", "/nonexistent_kite_dir/x/t.jsonl"])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not Path("/nonexistent_kite_dir").exists()


def test_mkdir_makes_the_folder(tmp_path, kite_home):
    out = tmp_path / "a" / "b" / "t.jsonl"
    result = runner.invoke(app, ["data", "traffic", "--n", "5", "--out", str(out), "--mkdir"])
    assert result.exit_code == 0, result.output
    assert out.exists()
    inside = kite_home / "data" / "t.jsonl"   # under KITE_HOME: no --mkdir needed
    result = runner.invoke(app, ["bench", "cases", "--n", "1", "--tokens", "200", "--out", str(inside)])
    assert result.exit_code == 0, result.output
    assert inside.exists()
