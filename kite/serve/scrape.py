"""Reading a running server's `/metrics`: one scrape, parsed with prometheus_client's parser into
samples and histograms that `kite monitor` subtracts and reads percentiles from."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kite.errors import KiteError
from kite.serve.client import ServerUnreachable, check_server_url

Labels = frozenset  # of (name, value) pairs


class NotKiteMetrics(KiteError):
    """The URL answered, but not with a KITE server's metrics (exit 1: the server is the problem)."""


@dataclass(frozen=True, slots=True)
class Histogram:
    """A Prometheus histogram: `buckets` are (upper bound `le`, cumulative count), ascending, the
    last one +Inf; `count` and `sum` (in the metric's unit) as exposed."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def minus(self, earlier: Histogram | None) -> Histogram:
        """The observations made since `earlier` (a scrape of the same histogram)."""
        if earlier is None:
            return self
        before = dict(earlier.buckets)
        return Histogram(tuple((le, n - before.get(le, 0.0)) for le, n in self.buckets),
                         self.count - earlier.count, self.sum - earlier.sum)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0-1) estimated as Prometheus' histogram_quantile does: linear within the
        bucket that holds rank q·count, from the bucket below's bound (0 for the first); a rank in
        the +Inf bucket gives the highest finite bound (a lower bound, then). None without
        observations."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower, below = None, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank and cumulative > below:
                if math.isinf(le):
                    return lower
                if lower is None:  # the first bucket: from 0, unless its bound is not above 0
                    if le <= 0:
                        return le
                    lower = 0.0
                return lower + (le - lower) * (rank - below) / (cumulative - below)
            lower, below = le, cumulative
        return lower

    @staticmethod
    def added(parts: Iterable[Histogram]) -> Histogram | None:
        """Label series of one histogram summed (the same buckets each)."""
        parts = list(parts)
        if not parts:
            return None
        sums: dict[float, float] = {}
        for h in parts:
            for le, n in h.buckets:
                sums[le] = sums.get(le, 0.0) + n
        return Histogram(tuple(sorted(sums.items())), sum(h.count for h in parts), sum(h.sum for h in parts))


@dataclass(frozen=True, slots=True)
class Scrape:
    """One reading of `/metrics`: every sample by name and labels, and when it answered
    (`at`: a monotonic clock's seconds, for intervals; `wall`: Unix time)."""

    samples: dict[str, dict[Labels, float]]
    at: float
    wall: float

    def value(self, name: str, **labels: str) -> float | None:
        """The one sample `name` whose labels include `labels` (None when there is none)."""
        found = self.matching(name, labels)
        return next(iter(found.values())) if found else None

    def total(self, name: str, exclude: dict[str, Iterable[str]] | None = None, **labels: str) -> float:
        """The sum of `name` over its series that have `labels` and none of `exclude`'s values."""
        out = 0.0
        for series, v in self.matching(name, labels).items():
            d = dict(series)
            if exclude and any(d.get(k) in vals for k, vals in exclude.items()):
                continue
            out += v
        return out

    def matching(self, name: str, labels: dict[str, str]) -> dict[Labels, float]:
        want = set(labels.items())
        return {s: v for s, v in self.samples.get(name, {}).items() if want <= s}

    def histogram(self, name: str) -> Histogram | None:
        """Histogram `name` (base name, no suffix) summed over its label series."""
        buckets: dict[Labels, list[tuple[float, float]]] = {}
        for series, v in self.samples.get(f"{name}_bucket", {}).items():
            d = dict(series)
            le = float(d.pop("le"))
            buckets.setdefault(frozenset(d.items()), []).append((le, v))
        parts = [Histogram(tuple(sorted(bs)), self.samples.get(f"{name}_count", {}).get(key, 0.0),
                           self.samples.get(f"{name}_sum", {}).get(key, 0.0)) for key, bs in buckets.items()]
        return Histogram.added(parts)


def parse_metrics(text: str, at: float = 0.0, wall: float | None = None) -> Scrape:
    """Parse Prometheus' text format (prometheus_client's parser) into a Scrape. Text that is not
    that format is NotKiteMetrics."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ModuleNotFoundError:
        raise KiteError("reading /metrics needs prometheus-client: pip install 'kite[serve]'") from None

    samples: dict[str, dict[Labels, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, {})[frozenset(s.labels.items())] = float(s.value)
    except (ValueError, TypeError, IndexError) as exc:
        raise NotKiteMetrics(f"not Prometheus text ({type(exc).__name__}: {exc})") from None
    return Scrape(samples, at, time.time() if wall is None else wall)


def scrape(url: str, timeout_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> Scrape:
    """GET `url`/metrics and parse it. A server that does not answer (refused, timed out) is
    ServerUnreachable; one that answers but not with KITE's metrics is NotKiteMetrics (both exit
    1); a URL that names no server is BadInput (exit 2)."""
    check_server_url(url)
    try:
        import httpx
    except ModuleNotFoundError:
        raise KiteError("talking to a KITE server needs httpx: pip install 'kite[serve]'") from None
    where = url.rstrip("/") + "/metrics"
    try:
        r = httpx.get(where, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ServerUnreachable(f"{url} does not answer ({type(exc).__name__}: {exc or 'no reply'}); "
                                "is `kite serve` running? (--server URL)") from None
    if r.status_code != 200:
        raise NotKiteMetrics(f"{where}: HTTP {r.status_code}: is {url} a `kite serve`?")
    try:
        found = parse_metrics(r.text, clock())
    except NotKiteMetrics as exc:
        raise NotKiteMetrics(f"{where}: {exc}: is {url} a `kite serve`?") from None
    if "kite_yoco_loads_total" not in found.samples:  # a counter every KITE server exposes from its start
        raise NotKiteMetrics(f"{where} has no kite_ metrics: is {url} a `kite serve`?")
    return found
