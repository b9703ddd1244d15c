"""What `kite monitor` shows: a server's figures from two scrapes of `/metrics` (rates are the
difference over their interval; percentiles come from histogram buckets), and the loop that keeps
scraping, saying so and retrying while the server does not answer."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from kite.serve.client import ServerUnreachable
from kite.serve.metrics import WATERMARK_FIELDS
from kite.serve.scrape import Histogram, NotKiteMetrics, Scrape, scrape

# The monitor's own scrapes (and health checks) are not traffic.
NOT_TRAFFIC = ("/metrics", "/healthz")
QUANTILES = (0.5, 0.9, 0.99)
# Counters that only grow while one server process lives: one that fell means it restarted.
_COUNTERS = ("kite_yoco_loads_total", "kite_yoco_hits_total", "kite_yoco_skips_total",
             "kite_upcycle_bytes_total", "kite_upcycle_context_tokens_total")


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Percentiles of a histogram in `unit`, over `count` observations (None: no observation)."""

    count: int
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, h: Histogram | None, scale: float) -> Percentiles:
        if h is None or h.count <= 0:
            return cls(0 if h is None else max(int(round(h.count)), 0))
        qs = [h.quantile(q) for q in QUANTILES]
        return cls(int(round(h.count)), *(None if v is None else round(v * scale, 3) for v in qs))


@dataclass(frozen=True, slots=True)
class Reading:
    """A server's figures at one scrape. `*_window` and `*_per_s` cover the interval since the
    scrape before (`interval_s`); they are None on a first scrape, after a restart, or, for
    ratios, when nothing happened in the interval. The others are since the server started."""

    server: str
    at: float  # Unix time of the scrape
    interval_s: float | None
    restarted: bool
    requests_total: float  # API requests (not /metrics, /healthz)
    requests_per_s: float | None
    errors_per_s: float | None  # 5xx
    loads: float
    hits: float
    skips: float
    loads_per_s: float | None
    hit_rate: float | None  # hits / loads since start
    hit_rate_window: float | None
    states_upcycled: float
    regenerate_rate: float | None  # MB of .upc per 1,000 context tokens since start
    regenerate_rate_window: float | None
    compression_ratio: float | None
    decision_latency_us: Percentiles
    decision_latency_us_window: Percentiles | None
    ttft_ms: Percentiles
    ttft_ms_window: Percentiles | None
    watermark: dict[str, float | None] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Unanswered:
    """A scrape that failed: why, how many in a row, when (`at`) and since when (`since`, the first
    of them; Unix times), and in how many seconds the next try is."""

    server: str
    error: str
    failures: int
    at: float
    since: float
    retry_in_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def _per_s(now: float, before: float, dt: float | None) -> float | None:
    return None if dt is None or dt <= 0 else round((now - before) / dt, 4)


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den > 0 else None


def _requests(s: Scrape) -> float:
    return s.total("kite_requests_total", exclude={"route": NOT_TRAFFIC})


def _errors(s: Scrape) -> float:
    return sum(v for labels, v in s.matching("kite_requests_total", {}).items()
               if dict(labels).get("status", "").startswith("5"))


def _regenerate_rate(nbytes: float, tokens: float) -> float | None:
    """MB of .upc per 1,000 context tokens."""
    return _ratio(nbytes / 1e6, tokens / 1e3)


def reading(cur: Scrape, prev: Scrape | None, server: str = "") -> Reading:
    """The figures of `cur`, with rates and window figures against `prev` (a scrape of the same
    server before it; ignored when the server restarted in between)."""
    restarted = prev is not None and any((cur.value(n) or 0.0) < (prev.value(n) or 0.0) for n in _COUNTERS)
    if restarted:
        prev = None
    now = {n: cur.total(n) for n in _COUNTERS}
    if prev is None:
        dt, before = None, None
    else:
        dt, before = cur.at - prev.at, {n: prev.total(n) for n in _COUNTERS}

    def window(name: str, scale: float) -> Percentiles | None:
        h = cur.histogram(name)
        return None if prev is None or h is None else Percentiles.of(h.minus(prev.histogram(name)), scale)

    def since(name: str) -> float:
        return now[name] - before[name]

    loads, hits = now["kite_yoco_loads_total"], now["kite_yoco_hits_total"]
    up_bytes, up_tokens = now["kite_upcycle_bytes_total"], now["kite_upcycle_context_tokens_total"]
    return Reading(
        server=server, at=cur.wall, interval_s=None if dt is None else round(dt, 3), restarted=restarted,
        requests_total=_requests(cur),
        requests_per_s=None if prev is None else _per_s(_requests(cur), _requests(prev), dt),
        errors_per_s=None if prev is None else _per_s(_errors(cur), _errors(prev), dt),
        loads=loads, hits=hits, skips=now["kite_yoco_skips_total"],
        loads_per_s=None if prev is None else _per_s(loads, before["kite_yoco_loads_total"], dt),
        hit_rate=_ratio(hits, loads),
        hit_rate_window=None if prev is None else _ratio(since("kite_yoco_hits_total"),
                                                         since("kite_yoco_loads_total")),
        states_upcycled=cur.total("kite_upcycle_states_total"),
        regenerate_rate=_regenerate_rate(up_bytes, up_tokens),
        regenerate_rate_window=None if prev is None else _regenerate_rate(
            since("kite_upcycle_bytes_total"), since("kite_upcycle_context_tokens_total")),
        compression_ratio=cur.value("kite_upcycle_compression_ratio") if up_bytes else None,
        decision_latency_us=Percentiles.of(cur.histogram("kite_yoco_decision_latency_seconds"), 1e6),
        decision_latency_us_window=window("kite_yoco_decision_latency_seconds", 1e6),
        ttft_ms=Percentiles.of(cur.histogram("kite_ttft_seconds"), 1e3),
        ttft_ms_window=window("kite_ttft_seconds", 1e3),
        watermark={f: cur.value(f"kite_watermark_{f}") for f in WATERMARK_FIELDS},
    )


Fetch = Callable[[str, float, Callable[[], float]], Scrape]


def watch(url: str, interval_s: float = 2.0, *, count: int | None = None, timeout_s: float = 5.0,
          clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
          fetch: Fetch = scrape) -> Iterator[Reading | Unanswered]:
    """Scrape `url` every `interval_s` seconds and yield a Reading (rates against the scrape
    before), or an Unanswered while the server does not answer, retrying at the same interval;
    `count` readings or failures in all (None: until the caller stops). `clock`, `sleep` and
    `fetch` are injectable (tests run the loop on a fake clock)."""
    prev: Scrape | None = None
    failures, since = 0, 0.0
    n = 0
    next_at = clock()
    while count is None or n < count:
        try:
            cur = fetch(url, timeout_s, clock)
        except (ServerUnreachable, NotKiteMetrics) as exc:
            now = time.time()
            if failures == 0:
                since = now
            failures += 1
            yield Unanswered(url, str(exc), failures, now, since, interval_s)
        else:
            failures = 0
            yield reading(cur, prev, url)
            prev = cur
        n += 1
        if count is not None and n >= count:
            return
        next_at += interval_s
        now = clock()
        next_at = max(next_at, now)  # late (a slow scrape or render): the next one now, no catching up
        sleep(next_at - now)


def read_once(url: str, interval_s: float = 1.0, timeout_s: float = 5.0,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
              fetch: Fetch = scrape) -> Reading:
    """One Reading with rates: two scrapes `interval_s` apart. A server that does not answer
    either time raises (ServerUnreachable or NotKiteMetrics, exit 1)."""
    first = fetch(url, timeout_s, clock)
    sleep(interval_s)
    return reading(fetch(url, timeout_s, clock), first, url)
