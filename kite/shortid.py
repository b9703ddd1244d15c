"""Two long ids (fingerprints, content addresses) shown side by side in a message, cut short where
they still differ: a message that says "fingerprint 3f4a7011d963 ≠ 3f4a7011d963" helps nobody."""

from __future__ import annotations

FP_PREFIX = "kite-fp1:"


def apart(a: str | None, b: str | None, least: int = 12, prefix: str = FP_PREFIX,
          missing: str = "none") -> tuple[str, str]:
    """``a`` and ``b`` without ``prefix``, each cut to the shortest length (at least ``least``
    characters) at which they differ (``least`` when they are equal); the whole id where it is
    shorter. ``missing`` stands for a None or empty id."""
    x = (a or "").removeprefix(prefix)
    y = (b or "").removeprefix(prefix)
    at = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    n = least if x == y else max(least, at + 1)
    return x[:n] or missing, y[:n] or missing
