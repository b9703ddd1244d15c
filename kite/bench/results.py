"""Benchmark result files: one JSON envelope per run (schema `kite.bench.result/1`), read and checked
here. The envelope records the command, the git commit the code was at, the machine, when the run
started and its figures as rows (value, unit, ratio to a baseline, ratio to a hardware floor); what
else the run recorded stays under `raw`. `benchmarks/results/` holds them with an `index.jsonl`;
`docs/PERFORMANCE.md` and the capacity planner's calibration cite them by file name."""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kite.errors import BadInput

SCHEMA = "kite.bench.result/1"
COMMIT_SOURCES = ("recorded", "added-in")
STARTED_AT_SOURCES = ("recorded", "commit-date")
MACHINE_KINDS = ("gpu", "cpu")
_COMMIT = re.compile(r"[0-9a-f]{7,40}")
_STARTED_AT = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
_NAME = re.compile(r"[a-z0-9_]+_[a-z0-9-]+_\d{8}_(?:[0-9a-f]{7}|nocommit)(?:_[A-Za-z0-9_-]+)?\.json")


class BadResult(BadInput):
    """A result file that is missing, not JSON, or not the envelope (one line: the file and why)."""


@dataclass(frozen=True, slots=True)
class ResultRow:
    """One figure of a run. `x_baseline`: value / baseline for times (> 1 means better for
    throughputs, said in `baseline`); `x_floor`: value / the hardware floor, >= 1."""

    name: str
    value: float
    unit: str
    baseline: str | None = None
    x_baseline: float | None = None
    floor: str | None = None
    x_floor: float | None = None


@dataclass(frozen=True, slots=True)
class Result:
    """One run, as its result file holds it (`path` the file it was read from, None when built in memory)."""

    benchmark: str
    command: str | None
    commit: str | None
    commit_source: str
    machine: dict
    started_at: str
    started_at_source: str
    rows: tuple[ResultRow, ...]
    raw: Any
    path: Path | None = None

    @property
    def date(self) -> str:
        """The day the run started, YYYY-MM-DD."""
        return self.started_at[:10]

    def row(self, name: str) -> ResultRow:
        """The row called `name`; BadResult (naming the file) when the run has none."""
        for r in self.rows:
            if r.name == name:
                return r
        raise BadResult(f"{self.path or self.benchmark}: no row {name!r}")


def _fail(where: str, why: str) -> BadResult:
    return BadResult(f"{where}: not a {SCHEMA} result: {why}")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def validate(obj: Any, where: str = "result") -> None:
    """Raise BadResult (one line, starting with `where`) unless `obj` is a well-formed envelope:
    the schema, a benchmark name, command (text or null), commit (hex or null) with its source,
    the machine (name, kind gpu|cpu), started_at (UTC, ...Z) with its source, rows (name, numeric
    value, unit; ratios numeric or null; unique names) and raw."""
    if not isinstance(obj, dict):
        raise _fail(where, "not a JSON object")
    missing = [k for k in ("schema", "benchmark", "command", "commit", "commit_source", "machine", "started_at",
                           "started_at_source", "rows", "raw") if k not in obj]
    if missing:
        raise _fail(where, f"missing {', '.join(missing)}")
    if obj["schema"] != SCHEMA:
        raise _fail(where, f"schema {obj['schema']!r}")
    if not isinstance(obj["benchmark"], str) or not obj["benchmark"]:
        raise _fail(where, "benchmark must be a name")
    if obj["command"] is not None and not isinstance(obj["command"], str):
        raise _fail(where, "command must be text or null")
    if obj["commit"] is not None and not (isinstance(obj["commit"], str) and _COMMIT.fullmatch(obj["commit"])):
        raise _fail(where, f"commit {obj['commit']!r} is not a git hash")
    if obj["commit_source"] not in COMMIT_SOURCES:
        raise _fail(where, f"commit_source must be one of {', '.join(COMMIT_SOURCES)}")
    m = obj["machine"]
    if not (isinstance(m, dict) and isinstance(m.get("name"), str) and m.get("kind") in MACHINE_KINDS):
        raise _fail(where, "machine needs a name and a kind (gpu or cpu)")
    if not (isinstance(obj["started_at"], str) and _STARTED_AT.fullmatch(obj["started_at"])):
        raise _fail(where, f"started_at {obj['started_at']!r} is not YYYY-MM-DDTHH:MM:SSZ")
    if obj["started_at_source"] not in STARTED_AT_SOURCES:
        raise _fail(where, f"started_at_source must be one of {', '.join(STARTED_AT_SOURCES)}")
    if not isinstance(obj["rows"], list):
        raise _fail(where, "rows must be a list")
    seen: set[str] = set()
    for i, r in enumerate(obj["rows"]):
        if not (isinstance(r, dict) and isinstance(r.get("name"), str) and r["name"]):
            raise _fail(where, f"row {i} has no name")
        if r["name"] in seen:
            raise _fail(where, f"row {r['name']!r} appears twice")
        seen.add(r["name"])
        if not _number(r.get("value")) or not isinstance(r.get("unit"), str):
            raise _fail(where, f"row {r['name']!r} needs a numeric value and a unit")
        for k in ("x_baseline", "x_floor"):
            if r.get(k) is not None and not _number(r[k]):
                raise _fail(where, f"row {r['name']!r}: {k} must be a number or null")
        for k in ("baseline", "floor"):
            if r.get(k) is not None and not isinstance(r[k], str):
                raise _fail(where, f"row {r['name']!r}: {k} must be text or null")


def result_from_dict(obj: Any, where: str = "result", path: Path | None = None) -> Result:
    """The envelope `obj` as a Result, validated first."""
    validate(obj, where)
    rows = tuple(ResultRow(r["name"], r["value"], r["unit"], r.get("baseline"), r.get("x_baseline"),
                           r.get("floor"), r.get("x_floor")) for r in obj["rows"])
    return Result(obj["benchmark"], obj["command"], obj["commit"], obj["commit_source"], dict(obj["machine"]),
                  obj["started_at"], obj["started_at_source"], rows, obj["raw"], path)


def load_result(path: str | Path) -> Result:
    """Read and validate one result file; BadResult (one line naming the file) when it is missing,
    not JSON or not the envelope."""
    p = Path(path)
    try:
        obj = json.loads(p.read_text())
    except FileNotFoundError:
        raise BadResult(f"{p}: no such result file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadResult(f"{p}: not a JSON result file ({e})") from None
    return result_from_dict(obj, str(p), p)


def attached_name(result_file: str | Path, name: str) -> str:
    """The file beside `result_file` that holds its attachment `name` (data too bulky for the
    envelope, gzipped JSON): `<result's stem>.<name>.json.gz`."""
    return f"{Path(result_file).stem}.{name}.json.gz"


def load_attached(result: Result, name: str) -> Any:
    """The attachment `name` of a result read from a file (`raw["attached"]` names it; it lies beside
    the file); BadResult when the result has none of that name or its file is missing or unreadable."""
    attached = result.raw.get("attached") if isinstance(result.raw, dict) else None
    if result.path is None or not isinstance(attached, dict) or name not in attached:
        raise BadResult(f"{result.path or result.benchmark}: no attachment {name!r}")
    p = result.path.parent / attached[name]
    try:
        return json.loads(gzip.decompress(p.read_bytes()))
    except FileNotFoundError:
        raise BadResult(f"{p}: no such attachment file (the result {result.path.name} names it)") from None
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadResult(f"{p}: not a gzipped JSON attachment ({e})") from None


def result_name(benchmark: str, machine_slug: str, started_at: str, commit: str | None,
                label: str | None = None) -> str:
    """The file name of a run: `<benchmark>_<machine-slug>_<YYYYMMDD>_<commit7>[_<label>].json`
    ("nocommit" where the commit is unknown)."""
    day = started_at[:10].replace("-", "")
    name = f"{benchmark}_{machine_slug}_{day}_{commit[:7] if commit else 'nocommit'}"
    name = f"{name}_{label}.json" if label else f"{name}.json"
    if not _NAME.fullmatch(name):
        raise BadInput(f"result name {name!r}: benchmark and machine slug must be lower-case words")
    return name


def index_entry(result: Result, file: str) -> dict:
    """The index line of `result`, stored as `file`."""
    return {"file": file, "benchmark": result.benchmark, "machine": result.machine["name"],
            "started_at": result.started_at, "commit": result.commit}


def build_index(folder: str | Path) -> list[dict]:
    """The index of every result file in `folder` (each validated), oldest first."""
    folder = Path(folder)
    entries = [index_entry(load_result(p), p.name) for p in sorted(folder.glob("*.json"))]
    return sorted(entries, key=lambda e: (e["started_at"], e["file"]))


def write_index(folder: str | Path) -> list[dict]:
    """Rewrite `folder`/index.jsonl from the result files there; returns its entries."""
    entries = build_index(folder)
    (Path(folder) / "index.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    return entries
