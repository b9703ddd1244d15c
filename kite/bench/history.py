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


def record_of(result: dict, output: str) -> dict:
    """The history line of a run: config, model fingerprint, machine, figures."""
    body = json.dumps([result.get("started_at"), result["model"]["fingerprint"], output], sort_keys=True)
    return {
        "run_id": hashlib.sha256(body.encode()).hexdigest()[:12],
        "started_at": result.get("started_at"), "finished_at": result.get("finished_at"),
        "complete": result.get("complete"), "passed": result.get("passed"), "error": result.get("error"),
        "output": str(Path(output).resolve()), "cases": len(result.get("cases", [])),
        "config": result.get("config"), "model": {k: result["model"][k] for k in ("spec", "fingerprint")},
        "machine": result.get("machine"), "figures": (result.get("summary") or {}).get("overall", {}),
        "families": (result.get("summary") or {}).get("families", {}),
        "thresholds": result.get("thresholds"), "notes": result.get("notes"),
    }


def append_run(record: dict) -> Path:
    from kite.atomic import write_bytes

    path = history_path()
    with _locked(path):
        old = path.read_bytes() if path.exists() else b""
        if old and not old.endswith(b"\n"):
            old += b"\n"
        write_bytes(path, old + json.dumps(record, ensure_ascii=False, default=str).encode() + b"\n")
    return path


def read_history(path: Path | None = None) -> list[dict]:
    """Every recorded run, oldest first ([] when there is none yet)."""
    path = path or history_path()
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise BadInput(f"{path}:{n}: damaged history line ({exc.msg})") from None
    return out
