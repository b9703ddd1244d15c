"""Cut a document into spans: paragraphs and sentences, ~32–128 tokens, covering every token once."""

from __future__ import annotations

import re
from bisect import bisect_left

_PARA = re.compile(r"\n\s*\n")
_SENT = re.compile(r"(?<=[.!?;:。；！？])\s+")


def _boundaries(text: str) -> dict[int, int]:
    """Character positions where a span may start: 2 = paragraph start, 1 = sentence start."""
    marks: dict[int, int] = {}
    for m in _SENT.finditer(text):
        marks[m.end()] = 1
    for m in _PARA.finditer(text):
        marks[m.end()] = 2
    return marks


def cut_spans(text: str, offsets: list[tuple[int, int]], min_tokens: int = 32,
              max_tokens: int = 128) -> list[tuple[int, int]]:
    """Token ranges [start, end) that partition tokens 0..len(offsets).

    Paragraph starts are preferred cut points (once a span has 8 tokens, so a heading joins the
    paragraph it heads); sentence starts are used once a span reaches `min_tokens`; no span
    exceeds `max_tokens`. `offsets` are the tokens' (char_start, char_end).
    """
    n = len(offsets)
    if n == 0:
        return []
    starts = [s for s, _ in offsets]
    cuts: dict[int, int] = {}
    for char, strength in _boundaries(text).items():
        tok = bisect_left(starts, char)
        if 0 < tok < n:
            cuts[tok] = max(cuts.get(tok, 0), strength)
    spans: list[tuple[int, int]] = []
    begin = 0
    for tok in sorted(cuts):
        length = tok - begin
        if (cuts[tok] == 2 and length >= 8) or (cuts[tok] == 1 and length >= min_tokens):
            spans.append((begin, tok))
            begin = tok
    spans.append((begin, n))
    out: list[tuple[int, int]] = []
    for s, e in spans:  # split what is too long at even steps
        parts = -(-(e - s) // max_tokens)
        step = -(-(e - s) // parts)
        out.extend((a, min(a + step, e)) for a in range(s, e, step))
    if len(out) > 1 and out[-1][1] - out[-1][0] < 8:  # a tiny tail joins its neighbour
        (a, _), (_, e) = out[-2], out[-1]
        if e - a <= max_tokens:
            out[-2:] = [(a, e)]
    return out
