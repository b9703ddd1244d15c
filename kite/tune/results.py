"""The sweep's results file (JSON, rewritten atomically after every point): what was measured
under which conditions, and each point's parameters and figures.

`--resume` reads it back: a point of the new sweep whose parameters were measured under the same
conditions (`context`: cases, model, rule and upcycle config files, answer length, device) is read,
not run again. Objectives and constraints are not conditions: they are applied afresh to the
figures, so a finished sweep can be re-judged with other constraints by resuming it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kite.errors import BadInput

FORMAT = 1


def point_id(params: dict) -> str:
    """A point's name, from its parameters alone: the same point has the same id in every run."""
    blob = json.dumps({k: params[k] for k in sorted(params)}, sort_keys=True, default=str)
    return "p-" + hashlib.sha256(blob.encode()).hexdigest()[:8]


def file_sha256(path: str | Path | None) -> str | None:
    if path is None:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def write_results(path: str | Path, doc: dict) -> None:
    from kite.atomic import write_text

    write_text(path, json.dumps(doc, indent=1, default=str) + "\n")


def read_results(path: str | Path) -> dict:
    """A results file written by `kite tune auto`; BadInput when it is missing or is not one."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"--resume: {p} does not exist (nothing to resume; leave --resume out to start)") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise BadInput(f"--resume: {p} is not a kite tune results file ({exc})") from None
    if not isinstance(doc, dict) or doc.get("kite_tune") != FORMAT or not isinstance(doc.get("points"), list):
        raise BadInput(f"--resume: {p} is not a kite tune results file (format {FORMAT})")
    return doc


def finished_points(doc: dict, context: dict, path: str | Path) -> dict[str, dict]:
    """The measured points of an earlier run, by id, when it ran under `context`; BadInput
    naming the first condition that changed otherwise."""
    old = doc.get("context") or {}
    for key, now in context.items():
        if old.get(key) != now:
            raise BadInput(f"--resume: {path} was measured with {key} = {old.get(key)!r}, this run has "
                           f"{now!r}; its points would not compare (rerun without --resume, or give "
                           f"another --results)")
    return {p["id"]: p for p in doc["points"] if p.get("status") in ("measured", "resumed") and p.get("figures")}
