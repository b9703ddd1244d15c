"""Query novelty: exact edit distances and the tracker's window."""

from __future__ import annotations

import random

import pytest

from kite.yoco.novelty import NoveltyTracker, edit_distance, similarity


def dp_distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def test_edit_distance_matches_the_textbook_dp():
    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice("ab违约 ") for _ in range(rng.randint(0, 90)))
        b = "".join(rng.choice("ab违约 ") for _ in range(rng.randint(0, 90)))
        assert edit_distance(a, b) == dp_distance(a, b)
    assert edit_distance("kitten", "sitting") == 3
    assert similarity("", "") == 1.0 and similarity("abc", "") == 0.0


def test_tracker_exact_window_matches_brute_force():
    rng = random.Random(1)
    tracker = NoveltyTracker(maxlen=8, max_exact=None)
    recent: list[str] = []
    for _ in range(200):
        q = "".join(rng.choice("abcd ") for _ in range(rng.randint(0, 16)))
        want = 1.0 if not recent else 1.0 - max(similarity(q, r) for r in recent)
        assert tracker.observe(q) == pytest.approx(want)
        recent = (recent + [q])[-8:]
    assert len(tracker) == 8


def test_novelty_semantics():
    t = NoveltyTracker(maxlen=2)
    assert t.observe("查询合同编号CN2023-0876的违约条款") == 1.0  # nothing seen yet
    assert t.novelty("查询合同编号CN2023-0876的违约条款") == 0.0  # exact repeat
    assert t.novelty("查询合同编号CN2023-0877的违约条款") == pytest.approx(1 / 22)
    t.observe("a")
    t.observe("b")  # the window holds 2: the first query is gone
    assert t.novelty("查询合同编号CN2023-0876的违约条款") == 1.0
    assert t.novelty("") == 1.0


def test_capped_scan_never_understates_novelty():
    rng = random.Random(2)
    words = "contract breach court clause payment damages notice term".split()
    exact, capped = NoveltyTracker(max_exact=None), NoveltyTracker(max_exact=2)
    for _ in range(150):
        q = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
        assert capped.observe(q) >= exact.observe(q) - 1e-12
