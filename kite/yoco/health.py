"""The health store: per (state, cluster label), an exponentially weighted record of the gain
measured when it was loaded, decaying toward a prior with age. SQLite in WAL mode, so several
processes (server workers, `kite bench`) can record at once.

Gain is what a request that loaded the cluster measured, `kite.yoco.fused.measured_gain`: the
relative drop of the prompt's own NLL with the state (positive = the state told the model
something about the query; docs/rules-dsl.md "The measured gain"). Health squashes it into 0-1:
    health = clip(0.5 + gain / (2·gain_scale), 0, 1)      (gain_scale 0.02: +2% F1 → 1.0)
Between loads the mean gain relaxes toward `prior_gain` with half-life `half_life_s`:
    mean(t) = prior + (mean − prior)·2^(−age/half_life)
and a new gain g moves it by α = max(alpha, 1/(weight + 2)) (the prior counts as one load).
"""

from __future__ import annotations

import math
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kite.errors import KiteError

DEFAULT_GAIN_SCALE = 0.02
DEFAULT_PRIOR_GAIN = 0.01  # optimistic: a new cluster gets loaded and measured
DEFAULT_HALF_LIFE_S = 7 * 24 * 3600.0
DEFAULT_ALPHA = 0.1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS cluster_health (
    state_id   TEXT NOT NULL,
    cluster    TEXT NOT NULL,
    mean_gain  REAL NOT NULL,
    weight     REAL NOT NULL,
    loads      INTEGER NOT NULL,
    hits       INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (state_id, cluster)
)
"""


def health_from_gain(gain: float, gain_scale: float = DEFAULT_GAIN_SCALE) -> float:
    """Gain (quality delta) → health in [0, 1]; 0 gain is 0.5."""
    return min(1.0, max(0.0, 0.5 + gain / (2.0 * gain_scale)))


def gain_from_health(health: float, gain_scale: float = DEFAULT_GAIN_SCALE) -> float:
    """Health in [0, 1] → expected gain; the inverse of `health_from_gain` inside the clip."""
    return (2.0 * health - 1.0) * gain_scale


@dataclass(frozen=True, slots=True)
class HealthRecord:
    state_id: str
    cluster: str
    mean_gain: float  # decayed to now
    health: float
    loads: int
    hits: int  # loads whose measured gain was > 0 (for yoco_hit_rate)
    updated_at: float


class HealthStore:
    """Per (state_id, cluster) gain records in SQLite (WAL). Every method is one short
    transaction; `busy_timeout_s` covers other processes holding the write lock."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 half_life_s: float = DEFAULT_HALF_LIFE_S, prior_gain: float = DEFAULT_PRIOR_GAIN,
                 gain_scale: float = DEFAULT_GAIN_SCALE, alpha: float = DEFAULT_ALPHA,
                 busy_timeout_s: float = 10.0, clock: Callable[[], float] = time.time):
        if path is None:
            from kite.paths import kite_home

            path = kite_home() / "health.sqlite"
        if half_life_s <= 0 or gain_scale <= 0 or not 0 < alpha <= 1:
            raise ValueError("half_life_s and gain_scale must be > 0, alpha in (0, 1]")
        self.path = Path(path)
        self.half_life_s, self.prior_gain = half_life_s, prior_gain
        self.gain_scale, self.alpha, self.clock = gain_scale, alpha, clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None,
                                       check_same_thread=False)
            self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._db.execute(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise KiteError(f"{self.path}: cannot open the health store ({exc})") from None
        self._lock = threading.Lock()

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "HealthStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def prior_health(self) -> float:
        return health_from_gain(self.prior_gain, self.gain_scale)

    def _decay(self, mean: float, weight: float, updated_at: float, now: float) -> tuple[float, float]:
        age = max(0.0, now - updated_at)
        f = 0.5 ** (age / self.half_life_s)
        return self.prior_gain + (mean - self.prior_gain) * f, weight * f

    def record(self, state_id: str, cluster: str, gain: float) -> float:
        """Add one measured gain; return the cluster's new health."""
        return self.record_clusters(state_id, [cluster], gain)[cluster]

    def record_clusters(self, state_id: str, clusters, gain: float) -> dict[str, float]:
        """Add one measured gain to each of a state's ``clusters`` (a load's labels), in one
        transaction; return each one's new health."""
        if not math.isfinite(gain):
            raise ValueError(f"gain must be finite, got {gain!r}")
        now = self.clock()
        out = {}
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")  # take the write lock before reading
            try:
                for cluster in dict.fromkeys(clusters):
                    row = self._db.execute(
                        "SELECT mean_gain, weight, loads, hits, updated_at FROM cluster_health "
                        "WHERE state_id = ? AND cluster = ?", (state_id, cluster)).fetchone()
                    if row is None:
                        mean, weight, loads, hits = self.prior_gain, 0.0, 0, 0
                    else:
                        mean, weight = self._decay(row[0], row[1], row[4], now)
                        loads, hits = row[2], row[3]
                    a = max(self.alpha, 1.0 / (weight + 2.0))
                    mean += a * (gain - mean)
                    self._db.execute(
                        "INSERT OR REPLACE INTO cluster_health VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (state_id, cluster, mean, weight + 1.0, loads + 1, hits + (gain > 0), now))
                    out[cluster] = health_from_gain(mean, self.gain_scale)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return out

    def score(self, state_id: str, cluster: str) -> float:
        """Health in [0, 1] now; the prior's health for a cluster never loaded."""
        with self._lock:
            row = self._db.execute(
                "SELECT mean_gain, weight, updated_at FROM cluster_health "
                "WHERE state_id = ? AND cluster = ?", (state_id, cluster)).fetchone()
        if row is None:
            return self.prior_health
        mean, _ = self._decay(row[0], row[1], row[2], self.clock())
        return health_from_gain(mean, self.gain_scale)

    def scores(self, state_id: str, clusters: list[str] | None = None) -> dict[str, float]:
        """Health of every recorded cluster of a state, plus the prior for `clusters` not yet
        recorded (pass the state's labels to get all of them)."""
        out = {r.cluster: r.health for r in self.records(state_id)}
        if clusters is not None:
            out = {c: out.get(c, self.prior_health) for c in clusters}
        return out

    def records(self, state_id: str) -> list[HealthRecord]:
        now = self.clock()
        with self._lock:
            rows = self._db.execute(
                "SELECT cluster, mean_gain, weight, loads, hits, updated_at FROM cluster_health "
                "WHERE state_id = ? ORDER BY cluster", (state_id,)).fetchall()
        out = []
        for cluster, mean, weight, loads, hits, updated in rows:
            m, _ = self._decay(mean, weight, updated, now)
            out.append(HealthRecord(state_id, cluster, m, health_from_gain(m, self.gain_scale),
                                    loads, hits, updated))
        return out

    def reset(self, state_id: str) -> int:
        """Forget a state's records (after its content changed); return how many went."""
        with self._lock:
            return self._db.execute("DELETE FROM cluster_health WHERE state_id = ?",
                                    (state_id,)).rowcount

    def rename_state(self, old: str, new: str, replace: bool = False) -> int:
        """Move a state's records to a new id (migrate). Idempotent: renaming again after it
        succeeded moves nothing. Refuses to merge into an id that has records unless `replace`."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                n_old = self._db.execute("SELECT COUNT(*) FROM cluster_health WHERE state_id = ?",
                                         (old,)).fetchone()[0]
                if n_old and old != new:
                    n_new = self._db.execute("SELECT COUNT(*) FROM cluster_health "
                                             "WHERE state_id = ?", (new,)).fetchone()[0]
                    if n_new and not replace:
                        raise KiteError(f"health store: state {new!r} already has {n_new} "
                                        f"records; rename with replace=True to overwrite them")
                    self._db.execute("DELETE FROM cluster_health WHERE state_id = ?", (new,))
                    self._db.execute("UPDATE cluster_health SET state_id = ? WHERE state_id = ?",
                                     (new, old))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return n_old if old != new else 0
