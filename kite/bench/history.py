"""The results store: one JSON line per bench run in `$KITE_HOME/results/bench.jsonl`.

Appending rewrites the file through a temporary name and a rename (invariant 4) under an
exclusive lock, so two runs finishing at once both land and a reader never sees half a line.
`kite tune` and `kite capacity-plan` read it through `read_history`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
from pathlib import Path

from kite.errors import BadInput


def results_dir() -> Path:
    from kite.paths import kite_home

    return kite_home() / "results"


def history_path() -> Path:
    return results_dir() / "bench.jsonl"


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


STATUSES = ("passed", "failed", "error", "interrupted")


def run_status(record: dict) -> str:
    """How a run ended: passed; failed (a threshold, or no case); error (a case raised);
    interrupted (Ctrl-C). Lines recorded before `status` existed are read the same way."""
    if record.get("status") in STATUSES:
        return record["status"]
    error = record.get("error") or ""
    if record.get("interrupted") or error.startswith("interrupted"):
        return "interrupted"
    if error:
        return "error"
    return "passed" if record.get("passed") else "failed"


def record_of(result: dict, output: str) -> dict:
    """The history line of a run: how it ended, which cases finished, config, model fingerprint,
    machine, figures (over the finished cases)."""
    # results written before runs carried their own id: a hash of when, what and where (two runs
    # started in the same second into the same output shared one)
    body = json.dumps([result.get("started_at"), result["model"]["fingerprint"], output], sort_keys=True)
    rows = result.get("cases", [])
    return {
        "run_id": result.get("run_id") or hashlib.sha256(body.encode()).hexdigest()[:12],
        "started_at": result.get("started_at"), "finished_at": result.get("finished_at"),
        "status": run_status(result), "interrupted": bool(result.get("interrupted")),
        "complete": result.get("complete"), "passed": result.get("passed"), "error": result.get("error"),
        "output": str(Path(output).resolve()), "cases": len(rows),
        "cases_total": result.get("cases_total"), "completed_cases": [r["id"] for r in rows],
        "config": result.get("config"), "model": {k: result["model"][k] for k in ("spec", "fingerprint")},
        "machine": result.get("machine"), "figures": (result.get("summary") or {}).get("overall", {}),
        "families": (result.get("summary") or {}).get("families", {}),
        "thresholds": result.get("thresholds"), "notes": result.get("notes"),
    }


def append_run(record: dict) -> Path:
    """Add a run's line: one line a run, so a line already there with its run_id goes (and so do
    the duplicates older versions wrote)."""
    from kite.atomic import write_bytes

    path = history_path()
    with _locked(path):
        old = path.read_bytes() if path.exists() else b""
        lines = [line for line in old.splitlines() if line.strip()]
        lines.append(json.dumps(record, ensure_ascii=False, default=str).encode())
        seen: set[str] = set()
        kept = []
        for line in reversed(lines):   # the last line of a run_id stands
            run_id = _run_id(line)
            if run_id is None or run_id not in seen:
                kept.append(line)
            if run_id is not None:
                seen.add(run_id)
        write_bytes(path, b"\n".join(reversed(kept)) + b"\n")
    return path


def _run_id(line: bytes) -> str | None:
    try:
        return json.loads(line).get("run_id")
    except (ValueError, AttributeError):
        return None  # a damaged line is kept as it is: read_history names it


def read_history(path: Path | None = None) -> list[dict]:
    """Every recorded run, oldest first, each once (the last line of a run_id recorded twice),
    each with its `status` ([] when there is none yet)."""
    path = path or history_path()
    if not path.exists():
        return []
    runs: dict[str, dict] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{path}:{n}: damaged history line ({exc.msg})") from None
        rec["status"] = run_status(rec)
        rec.setdefault("interrupted", rec["status"] == "interrupted")
        runs.pop(rec.get("run_id") or f"line {n}", None)
        runs[rec.get("run_id") or f"line {n}"] = rec
    return list(runs.values())
