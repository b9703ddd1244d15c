"""Reading JSONL files whose every problem is reported as `file:line: what is wrong` (BadInput)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kite.errors import BadInput


def read_jsonl(path: str | os.PathLike[str]) -> list[dict]:
    """Every non-blank line of `path` (`-` = stdin) as a JSON object, in order.

    Raises BadInput naming the file, line (and column for JSON syntax errors) on a missing file,
    non-UTF-8 bytes, bad JSON or a line that is not an object, and on a file with no records.
    """
    name = str(path)
    if name == "-":
        raw = sys.stdin.buffer.read()
    else:
        try:
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            raise BadInput(f"{name}: no such file") from None
        except IsADirectoryError:
            raise BadInput(f"{name}: is a folder, expected a JSONL file") from None
    records = []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadInput(f"{name}:{lineno}: not UTF-8 (byte {exc.start + 1} of the line)") \
                from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{name}:{lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise BadInput(f"{name}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        obj["_line"] = lineno
        records.append(obj)
    if not records:
        raise BadInput(f"{name}: no records (the file is empty)")
    return records


def read_cases(path: str | os.PathLike[str]) -> list[dict]:
    """Contract cases (docs/bench-cases.md): each needs `id`, a non-empty `text`, and `spans`
    of `{start, end, label}` inside the text. Raises BadInput with file:line on the first problem.
    """
    records = read_jsonl(path)
    seen: dict[str, int] = {}
    for rec in records:
        where = f"{path}:{rec['_line']}"
        cid = rec.get("id")
        if not isinstance(cid, str) or not cid:
            raise BadInput(f"{where}: missing 'id' (a non-empty string)")
        if cid in seen:
            raise BadInput(f"{where}: duplicate id {cid!r} (first on line {seen[cid]})")
        seen[cid] = rec["_line"]
        text = rec.get("text")
        if not isinstance(text, str):
            raise BadInput(f"{where}: case {cid!r} has no document ('text' must be a string)")
        if not text.strip():
            raise BadInput(f"{where}: case {cid!r} has an empty document")
        _check_spans(rec.get("spans", []), len(text), f"{where}: case {cid!r}")
        prev = rec.get("previous_version")
        if prev is not None:
            if not isinstance(prev, dict) or not isinstance(prev.get("text"), str):
                raise BadInput(f"{where}: case {cid!r}: 'previous_version' needs a 'text' string")
            _check_spans(prev.get("spans", []), len(prev["text"]),
                         f"{where}: case {cid!r} previous_version")
        questions = rec.get("questions", [])
        if not isinstance(questions, list):
            raise BadInput(f"{where}: case {cid!r}: 'questions' must be a list")
        for k, q in enumerate(questions):
            if not isinstance(q, dict) or not isinstance(q.get("question"), str) \
                    or not isinstance(q.get("answer"), str):
                raise BadInput(f"{where}: case {cid!r} question {k}: needs 'question' and "
                               "'answer' strings")
    return records


def read_labeled(path: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """Labeled examples, one `{"text": ..., "label": ...}` a line, as (text, label) pairs."""
    out = []
    for rec in read_jsonl(path):
        where = f"{path}:{rec['_line']}"
        text, label = rec.get("text"), rec.get("label")
        if not isinstance(text, str) or not text.strip():
            raise BadInput(f"{where}: 'text' must be a non-empty string")
        if not isinstance(label, str) or not label.strip():
            raise BadInput(f"{where}: 'label' must be a non-empty string")
        out.append((text, label))
    return out


def _check_spans(spans: object, n: int, where: str) -> None:
    if not isinstance(spans, list):
        raise BadInput(f"{where}: 'spans' must be a list")
    for k, sp in enumerate(spans):
        if not isinstance(sp, dict):
            raise BadInput(f"{where} span {k}: expected an object with start, end, label")
        start, end, label = sp.get("start"), sp.get("end"), sp.get("label")
        if not isinstance(start, int) or not isinstance(end, int) or isinstance(start, bool):
            raise BadInput(f"{where} span {k}: 'start' and 'end' must be integers")
        if not 0 <= start < end <= n:
            raise BadInput(f"{where} span {k}: [{start}, {end}) is outside the text (0-{n})")
        if not isinstance(label, str) or not label:
            raise BadInput(f"{where} span {k}: 'label' must be a non-empty string")
