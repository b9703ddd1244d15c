"""Query novelty: 1 − the highest similarity to a recent query, where similarity is
1 − Levenshtein distance / length of the longer string.

Fast for short queries in three steps: an exact repeat is a dictionary hit; every recent query
gets, from character and character-pair histograms (one numpy operation over the whole window),
an upper bound on its similarity (shared characters / longer length, since distance ≥ longer −
shared) and a rank (shared pairs / longer length); exact distances (Myers' bit-parallel
algorithm, Hyyrö's form, over Python ints) are computed in rank order for
the queries whose bound can still beat the best found, at most `max_exact` of them.
"""

from __future__ import annotations

import threading

import numpy as np

_UNI = 128  # characters hash into histogram buckets; a collision only loosens the bound
_BI = 256  # character pairs hash into these (an ordering heuristic, not a bound)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance between `a` and `b` (insert, delete, substitute each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    return _myers(_peq(a), len(a), b)


def _peq(pattern: str) -> dict[str, int]:
    peq: dict[str, int] = {}
    bit = 1
    for ch in pattern:
        peq[ch] = peq.get(ch, 0) | bit
        bit <<= 1
    return peq


def _myers(peq: dict[str, int], m: int, text: str) -> int:
    """Edit distance of a pattern (as `peq`, length m > 0) to `text`.

    No masking: Python ints act as infinite two's complement, bits above m never flow down
    (only `+` carries, and it carries up), and only bit m−1 is read.
    """
    last = 1 << (m - 1)
    pv, mv, score = (1 << m) - 1, 0, m
    get = peq.get
    for ch in text:
        eq = get(ch, 0)
        xv = eq | mv
        xh = (((eq & pv) + pv) ^ pv) | eq
        ph = mv | ~(xh | pv)
        mh = pv & xh
        if ph & last:
            score += 1
        elif mh & last:
            score -= 1
        ph = (ph << 1) | 1
        pv = (mh << 1) | ~(xv | ph)
        mv = ph & xv
    return score


def similarity(a: str, b: str) -> float:
    """1 − normalized edit distance, in [0, 1]; two empty strings are identical."""
    n = max(len(a), len(b))
    return 1.0 if n == 0 else 1.0 - edit_distance(a, b) / n


def _histogram(text: str) -> np.ndarray:
    """Character counts (by bucket), then character-pair counts (by bucket)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    prev = np.concatenate(([0], codes[:-1]))
    return np.concatenate((np.bincount(codes % _UNI, minlength=_UNI),
                           np.bincount((prev * 1_000_003 + codes) % _BI, minlength=_BI)
                           )).astype(np.int16)


class NoveltyTracker:
    """The last `maxlen` queries (each cut to `max_chars`), and how novel a new one is.

    At most `max_exact` exact distances per call (the best-ranked candidates): the result is
    exact whenever the bound rules out the rest, which a near-duplicate makes it do; otherwise
    it is the best among those candidates, so novelty can only be overstated (a novel-looking
    query is treated as riskier, never the reverse). `max_exact=None` is always exact, at one
    distance per recent query at worst (benchmarks/yoco_decision.py measures both).
    """

    def __init__(self, maxlen: int = 128, max_chars: int = 256, max_exact: int | None = 6):
        if maxlen < 1 or max_chars < 1:
            raise ValueError("maxlen and max_chars must be >= 1")
        self.maxlen, self.max_chars = maxlen, max_chars
        self.max_exact = maxlen if max_exact is None else max(1, max_exact)
        self._texts: list[str] = []
        self._hist = np.zeros((maxlen, _UNI + _BI), dtype=np.int16)
        self._lens = np.zeros(maxlen, dtype=np.float64)
        self._next = 0  # ring slot the next query goes to
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._texts)

    def novelty(self, query: str) -> float:
        """1 − max similarity to the recent queries (1.0 when there are none). Does not record."""
        q = query[: self.max_chars]
        h = _histogram(q)
        with self._lock:
            return self._novelty(q, h)

    def observe(self, query: str) -> float:
        """The novelty of `query`, then remember it."""
        q = query[: self.max_chars]
        h = _histogram(q)
        with self._lock:
            value = self._novelty(q, h)
            slot = self._next
            if slot < len(self._texts):
                old = self._texts[slot]
                self._counts[old] -= 1
                if not self._counts[old]:
                    del self._counts[old]
                self._texts[slot] = q
            else:
                self._texts.append(q)
            self._counts[q] = self._counts.get(q, 0) + 1
            self._hist[slot] = h
            self._lens[slot] = len(q)
            self._next = (slot + 1) % self.maxlen
        return value

    def _novelty(self, q: str, h: np.ndarray) -> float:
        k = len(self._texts)
        if k == 0:
            return 1.0
        if q in self._counts:
            return 0.0
        n = len(q)
        if n == 0:
            return 1.0  # every recent query is non-empty (an empty one would be an exact hit)
        longer = np.maximum(self._lens[:k], n)
        shared = np.minimum(self._hist[:k], h)
        # distance >= longer - shared characters, so similarity <= shared / longer (a bound);
        # shared character pairs / longer ranks the likely-closest first (a heuristic).
        upper = (shared[:, :_UNI].sum(axis=1) / longer).tolist()
        order = np.argsort(-shared[:, _UNI:].sum(axis=1) / longer, kind="stable").tolist()
        peq = _peq(q)
        best, computed = 0.0, 0
        for i in order:
            if upper[i] <= best:
                continue  # cannot beat what we have
            if computed == self.max_exact:
                break
            text = self._texts[i]
            computed += 1
            sim = 1.0 - _myers(peq, n, text) / max(n, len(text))
            if sim > best:
                best = sim
                if best >= 1.0:
                    break
        return 1.0 - best
