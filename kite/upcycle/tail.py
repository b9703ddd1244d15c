"""How many of a document's last tokens a state keeps as token ids for its loads to recompute
(``compression.recompute_tokens``, ``--recompute-tokens``; the load's side is
:mod:`kite.upcycle.load.tail`).

``auto``, the default, keeps a tail where a state's coding needs it: at 16x and above (the ratios
where a plain state's QA F1 falls under 0.9x the full context's on the GPU path, docs/compression.md,
"Recomputed tail") the last :data:`AUTO_TOKENS` tokens, at most an eighth of the document, so that a
load's forward stays a small share of the prefill the state replaces; below 16x, at presets and for
lossless states, none: their loads cost nothing more. A number asks for that many tokens whatever the
ratio (0: none).
"""

from __future__ import annotations

from kite.errors import BadInput

AUTO = "auto"
AUTO_RATIO = 16.0       # auto keeps a tail in states coded at this ratio or more
AUTO_TOKENS = 256       # ... of this many tokens
AUTO_SHARE = 8          # ... and at most 1/AUTO_SHARE of the document's tokens
MAX_TOKENS = 4096       # the most a state keeps (a forward of them at each load)
EXPECTED = f"'auto' or a count of the document's last tokens, 0 to {MAX_TOKENS}"    # what a setting may be


def parse_recompute(value, name: str = "recompute tokens") -> int | str:
    """A ``recompute_tokens`` setting as the config, a flag or a caller gives it ("auto", a count as a
    number or a string) -> ``"auto"`` or an int in 0..MAX_TOKENS; BadInput naming it (``name``: the
    setting as the user spelt it) and the value otherwise."""
    said = f"{name} {value}: {EXPECTED}"
    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO:
            return AUTO
        try:
            value = int(text)
        except ValueError:
            raise BadInput(said) from None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
        raise BadInput(said)
    return value


def recomputed_tail(n_tokens: int, asked: int | str, ratio: float | None = None) -> int:
    """How many of an ``n_tokens``-token document's last tokens its state keeps as ids: ``asked``
    (a count, or ``"auto"`` resolved by ``ratio``, the state's compression ratio, None for a preset),
    leaving at least one token coded. BadInput for a setting that is neither."""
    asked = parse_recompute(asked)
    if asked == AUTO:
        asked = min(AUTO_TOKENS, n_tokens // AUTO_SHARE) if ratio is not None and ratio >= AUTO_RATIO else 0
    return max(0, min(asked, n_tokens - 1))


__all__ = ["AUTO", "AUTO_RATIO", "AUTO_SHARE", "AUTO_TOKENS", "EXPECTED", "MAX_TOKENS", "parse_recompute", "recomputed_tail"]
