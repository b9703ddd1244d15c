"""The health store: EW gain records, decay toward the prior by age, several writers."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3

import pytest

from kite.errors import KiteError
from kite.yoco.health import HealthStore, health_from_gain


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


DAY = 86400.0


def test_default_path_is_under_kite_home(kite_home):
    with HealthStore() as store:
        assert store.path == kite_home / "health.sqlite"
    mode = sqlite3.connect(kite_home / "health.sqlite").execute("PRAGMA journal_mode").fetchone()
    assert mode[0] == "wal"


def test_prior_then_records_move_the_score(tmp_path):
    clock = Clock()
    with HealthStore(tmp_path / "h.sqlite", clock=clock) as store:
        assert store.score("s", "a") == pytest.approx(store.prior_health) == pytest.approx(0.75)
        store.record("s", "a", -0.02)  # first record: alpha = 1/2 (the prior counts as one)
        assert store.score("s", "a") == pytest.approx(health_from_gain((0.01 - 0.02) / 2))
        for _ in range(50):
            store.record("s", "a", 0.02)
        assert store.score("s", "a") > 0.97
        rec = store.records("s")[0]
        assert (rec.cluster, rec.loads, rec.hits) == ("a", 51, 50)


def test_decay_toward_the_prior_with_age(tmp_path):
    clock = Clock()
    with HealthStore(tmp_path / "h.sqlite", half_life_s=DAY, clock=clock) as store:
        for _ in range(30):
            store.record("s", "bad", -0.02)
        low = store.score("s", "bad")
        mean0 = store.records("s")[0].mean_gain
        clock.t += DAY  # one half-life: halfway back to the prior
        assert store.records("s")[0].mean_gain == pytest.approx(0.01 + (mean0 - 0.01) / 2)
        assert low < store.score("s", "bad") < store.prior_health
        clock.t += 30 * DAY
        assert store.score("s", "bad") == pytest.approx(store.prior_health, abs=1e-6)


def test_scores_reset_and_rename(tmp_path):
    with HealthStore(tmp_path / "h.sqlite", clock=Clock()) as store:
        store.record("old", "a", 0.02)
        store.record("old", "b", -0.02)
        store.record("other", "a", 0.0)
        scores = store.scores("old", ["a", "b", "c"])
        assert scores["a"] > 0.75 > scores["b"] and scores["c"] == store.prior_health
        assert store.rename_state("old", "new") == 2
        assert store.scores("old") == {} and set(store.scores("new")) == {"a", "b"}
        assert store.rename_state("old", "new") == 0  # a resumed migrate moves nothing
        store.record("old", "z", 0.0)
        with pytest.raises(KiteError, match="already has 2 records"):
            store.rename_state("old", "new")
        assert store.rename_state("old", "new", replace=True) == 1
        assert set(store.scores("new")) == {"z"}
        assert store.reset("new") == 1 and store.scores("new") == {}
        assert set(store.scores("other")) == {"a"}


def test_two_connections_interleave(tmp_path):
    path = tmp_path / "h.sqlite"
    with HealthStore(path) as one, HealthStore(path) as two:
        for i in range(20):
            (one if i % 2 else two).record("s", "a", 0.01)
        assert one.records("s")[0].loads == 20 and two.records("s")[0].loads == 20


def _writer(path: str, n: int) -> None:
    with HealthStore(path, busy_timeout_s=30) as store:
        for _ in range(n):
            store.record("s", "a", 0.01)


def test_two_processes_write_without_losing_records(tmp_path):
    path = str(tmp_path / "h.sqlite")
    HealthStore(path).close()  # create the schema once
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, 100)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with HealthStore(path) as store:
        assert store.records("s")[0].loads == 200


def test_bad_gain_rejected(tmp_path):
    with HealthStore(tmp_path / "h.sqlite") as store, pytest.raises(ValueError):
        store.record("s", "a", float("nan"))


def test_a_loads_labels_are_recorded_together_as_one_by_one(tmp_path):
    """A load's labels take one gain in one transaction: the same records as one call a label (a
    label named twice counts once), and a bad gain writes none of them."""
    clock = Clock()
    with HealthStore(tmp_path / "one.sqlite", clock=clock) as one, \
            HealthStore(tmp_path / "all.sqlite", clock=clock) as together:
        for gain in (-0.02, 0.03, 0.01):
            want = {label: one.record("s", label, gain) for label in ("a", "b", "c")}
            assert together.record_clusters("s", ["a", "b", "c", "a"], gain) == pytest.approx(want)
        assert [(r.cluster, r.mean_gain, r.loads, r.hits) for r in together.records("s")] == \
            [(r.cluster, r.mean_gain, r.loads, r.hits) for r in one.records("s")]
        with pytest.raises(ValueError):
            together.record_clusters("t", ["a", "b"], float("inf"))
        assert together.records("t") == []
