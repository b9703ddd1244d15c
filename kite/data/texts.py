"""Continuation pairs from real texts (`kite data pairs --texts`): a window of a document is the
context a state is made of, and the text right after it is what the reader adapter learns to
predict from that state: the task the held-out quality figures score (PPL of a document's next
tokens after its compressed context).

Texts come from files or folders (read recursively, ``.gz`` through gzip; a file that is not UTF-8
text is skipped, a text seen once already is skipped). Texts a measurement holds out are named with
``exclude``: a window more than ``MAX_SHARED`` of whose runs of ``NGRAM`` words occur in one of them
is dropped (the usual decontamination test, with room for a stock sentence: a warranty disclaimer
passes, a license quoted inside a package's copyright file does not).
"""

from __future__ import annotations

import gzip
import hashlib
import random
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kite.errors import BadInput

NGRAM = 13                  # words in a run compared with the excluded texts
MAX_SHARED = 0.01           # a window with more of its runs in an excluded text is dropped
MIN_CHARS = 2000            # shorter files are not read (they cannot hold a window)
_WORD = re.compile(r"\w+")


def read_texts(paths: Iterable[str | Path], what: str = "text path",
               progress: Callable[[str, int, int], None] | None = None) -> Iterator[tuple[str, str]]:
    """(name, text) of every readable text file under ``paths`` (files, or folders read recursively
    in sorted order; ``.gz`` decompressed), each distinct text once, read as it is asked for.
    BadInput naming ``what`` for a path that does not exist (before any text is read).
    ``progress(stage, files done, files)`` after each file."""
    files = []
    for root in (Path(p) for p in paths):
        if not root.exists():
            raise BadInput(f"{what} {root}: no such file or folder")
        files += [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    return _texts(files, progress)


def _texts(files: list[Path], progress) -> Iterator[tuple[str, str]]:
    seen = set()
    for i, f in enumerate(files):
        text = _read_text(f)
        if text is not None and len(text) >= MIN_CHARS:
            digest = hashlib.sha256(text.encode()).digest()
            if digest not in seen:
                seen.add(digest)
                yield str(f), text
        if progress is not None:
            progress("texts", i + 1, len(files))


def _read_text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
        text = data.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile):
        return None
    return None if "\x00" in text else text


def ngrams(text: str, n: int = NGRAM) -> set[int]:
    """Hashes of every run of ``n`` words of ``text`` (lower-cased, punctuation dropped)."""
    words = [w.lower() for w in _WORD.findall(text)]
    return {hash(tuple(words[i:i + n])) for i in range(len(words) - n + 1)}


def shared(runs: set[int], banned: set[int]) -> float:
    """The fraction of ``runs`` (:func:`ngrams`) that are in ``banned``."""
    return len(runs & banned) / len(runs) if runs else 0.0


def window_pairs(ids: list[int], decode, window_tokens: int, stride: int, pairs: int, prompt_tokens: int,
                 response_tokens: int, name: str) -> list[dict]:
    """Continuation pairs of windows of ``ids`` starting every ``stride`` tokens: a window's first
    ``window_tokens`` are the context; pair i's prompt runs from its end to (i + 1) x prompt +
    i x response tokens after it, its response is the next ``response_tokens``."""
    out, step = [], prompt_tokens + response_tokens
    for start in range(0, len(ids) - window_tokens - pairs * step + 1, stride):
        out += _window(ids, decode, start, window_tokens, pairs, prompt_tokens, response_tokens, name)
    return out


def _window(ids, decode, start, window_tokens, pairs, prompt_tokens, response_tokens, name) -> list[dict]:
    end, step = start + window_tokens, prompt_tokens + response_tokens
    context = decode(ids[start:end])
    out = []
    for i in range(pairs):
        p_end = end + prompt_tokens + i * step
        out.append({"id": f"{name}@{start}/{i}", "context": context, "prompt": decode(ids[end:p_end]),
                    "response": decode(ids[p_end:p_end + response_tokens]), "meta": {"family": "continuation"}})
    return out


@dataclass
class TextPairs:
    """What :func:`text_pairs` made and left out."""

    records: list[dict] = field(default_factory=list)
    texts: int = 0                  # texts read
    too_short: int = 0              # texts shorter than one window and its pairs
    windows: int = 0                # windows kept
    excluded: int = 0               # windows dropped for sharing runs of words with an excluded text

    def summary(self) -> dict:
        return {"texts": self.texts, "too_short": self.too_short, "windows": self.windows,
                "excluded_windows": self.excluded, "pairs": len(self.records)}


def text_pairs(texts: Iterable[tuple[str, str]], tokenize: Callable[[str], list[int]], decode: Callable[[list[int]], str],
               *, window_tokens: int = 2048, pairs_per_window: int = 4, prompt_tokens: int = 8,
               response_tokens: int = 120, windows_per_text: int = 2, max_windows: int | None = None,
               exclude: Iterable[str] = (), max_shared: float = MAX_SHARED, seed: int = 0) -> TextPairs:
    """Continuation pairs of ``texts`` ((name, text), :func:`read_texts`): up to ``windows_per_text``
    non-overlapping windows of each (drawn by ``seed`` among the windows the text holds), each a
    context of ``window_tokens`` tokens followed by ``pairs_per_window`` pairs of ``prompt_tokens`` +
    ``response_tokens`` (:func:`window_pairs`' layout). A window more than ``max_shared`` of whose
    runs of :data:`NGRAM` words occur in the ``exclude`` texts is dropped. ``max_windows``: at most
    this many windows in all, drawn by ``seed`` among those kept."""
    for name, v in (("window tokens", window_tokens), ("pairs a window", pairs_per_window),
                    ("prompt tokens", prompt_tokens), ("response tokens", response_tokens),
                    ("windows a text", windows_per_text), ("windows in all", 1 if max_windows is None else max_windows)):
        if v < 1:
            raise BadInput(f"{name}: {v}, expected at least 1")
    banned: set[int] = set()
    for text in exclude:
        banned |= ngrams(text)
    span = window_tokens + pairs_per_window * (prompt_tokens + response_tokens)
    out = TextPairs()
    rng = random.Random(f"kite-text-pairs:{seed}")
    windows = []
    for name, text in texts:
        out.texts += 1
        ids = tokenize(text)
        starts = list(range(0, len(ids) - span + 1, span))
        if not starts:
            out.too_short += 1
            continue
        for start in sorted(rng.sample(starts, min(windows_per_text, len(starts)))):
            recs = _window(ids, decode, start, window_tokens, pairs_per_window, prompt_tokens, response_tokens, name)
            whole = recs[0]["context"] + "".join(r["prompt"] + r["response"] for r in recs)
            if banned and shared(ngrams(whole), banned) > max_shared:
                out.excluded += 1
            else:
                windows.append(recs)
    if max_windows is not None and len(windows) > max_windows:
        keep = set(rng.sample(range(len(windows)), max_windows))
        windows = [w for i, w in enumerate(windows) if i in keep]
    out.windows = len(windows)
    out.records = [r for recs in windows for r in recs]
    return out
