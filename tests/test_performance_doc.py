"""docs/PERFORMANCE.md is backed: every table is the rendering of its rows' result files, and the
check fails on a row no result backs (a missing file, no commit, a missing row), on a hand-edited
figure and on a table row outside the rendered tables. The result envelope is validated."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kite.bench.perfdoc import check_doc, load_spec, render_doc
from kite.bench.results import BadResult, build_index, load_result, validate
from kite.errors import BadInput

ROOT = Path(__file__).resolve().parents[1]
DOC, SPEC, RESULTS = ROOT / "docs" / "PERFORMANCE.md", ROOT / "benchmarks" / "performance_rows.yaml", ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "scripts" / "render_performance.py"


def test_the_doc_is_its_rendering_and_every_row_is_backed():
    spec = load_spec(SPEC)
    text = DOC.read_text()
    assert check_doc(text, spec, RESULTS) == []
    assert render_doc(text, spec, RESULTS) == text
    assert len(text.splitlines()) <= 400
    assert sum(len(rows) for rows in spec.values()) >= 20


def test_docs_hold_no_raw_outputs_and_the_index_lists_every_result():
    assert not [p.name for p in (ROOT / "docs").iterdir() if p.suffix in (".json", ".jsonl", ".log", ".txt")]
    index = [json.loads(line) for line in (RESULTS / "index.jsonl").read_text().splitlines()]
    assert index == build_index(RESULTS)
    assert {e["file"] for e in index} == {p.name for p in RESULTS.glob("*.json")}


@pytest.fixture
def planted(tmp_path) -> tuple[Path, Path, Path]:
    """A copy of the doc, its spec and the result files its rows cite."""
    results = tmp_path / "results"
    results.mkdir()
    for rows in load_spec(SPEC).values():
        for row in rows:
            shutil.copy(RESULTS / row.result, results / row.result)
    shutil.copy(DOC, tmp_path / "PERFORMANCE.md")
    shutil.copy(SPEC, tmp_path / "rows.yaml")
    return tmp_path / "PERFORMANCE.md", tmp_path / "rows.yaml", results


def _check(doc: Path, spec: Path, results: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--check", "--doc", str(doc), "--spec", str(spec),
                           "--results", str(results)], capture_output=True, text=True, cwd=ROOT, timeout=120)


def _first_row(spec: Path) -> str:
    return next(line for line in spec.read_text().splitlines() if line.strip().startswith("row: "))


def test_the_check_script_passes_the_copy_and_fails_a_row_whose_result_lacks_it(planted):
    doc, spec, results = planted
    assert _check(doc, spec, results).returncode == 0
    line = _first_row(spec)
    spec.write_text(spec.read_text().replace(line, line.split("row:")[0] + "row: a figure nobody measured", 1))
    done = _check(doc, spec, results)
    assert done.returncode == 1 and "no row 'a figure nobody measured'" in done.stderr


def test_a_missing_result_file_or_one_without_a_commit_fails(planted):
    doc, spec, results = planted
    specs = load_spec(spec)
    first = next(iter(specs.values()))[0]
    obj = json.loads((results / first.result).read_text())
    (results / first.result).write_text(json.dumps({**obj, "commit": None}))
    assert any("no commit recorded" in p for p in check_doc(doc.read_text(), specs, results))
    (results / first.result).unlink()
    assert any("no such result file" in p for p in check_doc(doc.read_text(), specs, results))


def test_a_hand_edited_figure_and_a_row_outside_the_tables_fail(planted):
    doc, spec, results = planted
    specs, text = load_spec(spec), doc.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| ") and line.count("](") == 1)
    cells = row.split(" | ")
    edited = text.replace(row, " | ".join([cells[0], "12345 ms", *cells[2:]]), 1)
    assert edited != text
    assert any("differs from its rendering" in p for p in check_doc(edited, specs, results))
    unbacked = text + "\n| TTFT from a state | 9.9 ms | 50× faster |\n"
    problems = check_doc(unbacked, specs, results)
    assert len(problems) == 1 and "a table row outside the rendered tables" in problems[0]
    doc.write_text(unbacked)
    assert _check(doc, spec, results).returncode == 1


def test_rendering_fills_empty_tables(planted):
    doc, spec, results = planted
    specs, text = load_spec(spec), doc.read_text()
    start, end = text.index("<!-- table:decode -->"), text.index("<!-- /table:decode -->")
    emptied = text[:start] + "<!-- table:decode -->\n" + text[end:]
    assert check_doc(emptied, specs, results)
    assert render_doc(emptied, specs, results) == text


GOOD = {"schema": "kite.bench.result/1", "benchmark": "gpu_speed", "command": "benchmarks/gpu_speed.py",
        "commit": "6da86f2", "commit_source": "recorded", "machine": {"name": "NVIDIA H200", "kind": "gpu"},
        "started_at": "2026-12-02T15:49:50Z", "started_at_source": "recorded",
        "rows": [{"name": "step", "value": 1.5, "unit": "ms", "baseline": None, "x_baseline": None,
                  "floor": "bytes at 4.8 TB/s", "x_floor": 1.2}], "raw": {}}


@pytest.mark.parametrize("change, message", [
    ({"schema": "kite.bench.result/0"}, "schema"),
    ({"commit": "HEAD"}, "not a git hash"),
    ({"commit_source": "guessed"}, "commit_source"),
    ({"machine": {"name": "H200"}}, "machine needs a name and a kind"),
    ({"started_at": "2026-12-02 15:49"}, "is not YYYY-MM-DDTHH:MM:SSZ"),
    ({"rows": [{"name": "step", "value": "fast", "unit": "ms"}]}, "numeric value"),
    ({"rows": [{"name": "a", "value": 1, "unit": ""}, {"name": "a", "value": 2, "unit": ""}]}, "appears twice"),
])
def test_a_bad_envelope_is_one_line(change, message):
    validate(GOOD)
    with pytest.raises(BadResult) as err:
        validate({**GOOD, **change}, "x.json")
    assert str(err.value).startswith("x.json: not a kite.bench.result/1 result") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_load_result_names_the_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(GOOD))
    res = load_result(path)
    assert res.row("step").x_floor == 1.2 and res.date == "2026-12-02" and res.path == path
    with pytest.raises(BadResult, match="no row 'other'"):
        res.row("other")
    path.write_text("{not json")
    with pytest.raises(BadResult, match="not a JSON result file"):
        load_result(path)
    with pytest.raises(BadResult, match="no such result file"):
        load_result(tmp_path / "gone.json")


def test_result_names_follow_the_spec_and_the_index_is_rebuilt(tmp_path):
    from kite.bench.results import result_name, write_index

    assert result_name("gpu_speed", "h200", "2026-12-02T15:49:50Z", "6da86f26026e") == "gpu_speed_h200_20261202_6da86f2.json"
    assert result_name("lanes_decode", "cpu2", "2026-12-02T15:49:50Z", None, "a") == "lanes_decode_cpu2_20261202_nocommit_a.json"
    with pytest.raises(BadInput, match="lower-case"):
        result_name("GPU Speed", "h200", "2026-12-02T15:49:50Z", "6da86f2")
    (tmp_path / "gpu_speed_h200_20261202_6da86f2.json").write_text(json.dumps(GOOD))
    entries = write_index(tmp_path)
    assert entries == [{"file": "gpu_speed_h200_20261202_6da86f2.json", "benchmark": "gpu_speed",
                        "machine": "NVIDIA H200", "started_at": "2026-12-02T15:49:50Z", "commit": "6da86f2"}]
    assert json.loads((tmp_path / "index.jsonl").read_text()) == entries[0]
