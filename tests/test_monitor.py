"""`kite monitor`: /metrics parsed, rates from two scrapes, percentiles from buckets, a real server
read with --once --json, and a server that does not answer said to be so (once: exit 1; live: the
loop retries on a fake clock)."""

from __future__ import annotations

import io
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from kite.cli.main import app as cli
from kite.serve.metrics import ServerMetrics
from kite.serve.monitor import Reading, Unanswered, read_once, reading, watch
from kite.serve.scrape import Histogram, parse_metrics, scrape
from tests.conftest import parse_json
from tests.test_serve import _ask, _settings, _start, _upload
from tests.tiny_models import load_tiny_llama

CAPTURED = Path(__file__).parent / "data" / "kite_metrics.prom"  # a tiny-model server's /metrics
runner = CliRunner()


class FakeClock:
    """time.monotonic and time.sleep for the live loop: sleeping moves the clock, nothing waits."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(round(s, 6))
        self.now += s


@pytest.fixture(scope="module")
def lm(tiny_models):
    return load_tiny_llama(tiny_models)


@pytest.fixture(scope="module")
def served(lm, tmp_path_factory):
    """A real server (tiny Llama, fusion on) that has upcycled one document and answered from it."""
    root = tmp_path_factory.mktemp("monitor")
    server, _, _ = _start(lm, _settings(root, admin_token=None, fusion=True), root)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        sid = _upload(c)
        for _ in range(2):
            assert _ask(c, sid).status_code == 200
    yield server.url
    server.stop()


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed when the block ends


# -- the parser and the figures -----------------------------------------------------------------

def test_a_captured_metrics_text_parses_into_samples_and_histograms():
    s = parse_metrics(CAPTURED.read_text(), at=1.0)
    assert s.value("kite_yoco_loads_total") == 3.0 and s.value("kite_yoco_hits_total") == 3.0
    assert s.value("kite_requests_total", route="/v1/completions", status="200") == 4.0
    assert s.total("kite_requests_total") == 6.0
    assert s.total("kite_requests_total", exclude={"route": ("/healthz",)}) == 5.0
    d = s.histogram("kite_yoco_decision_latency_seconds")
    assert d.count == 3 and d.buckets[-1] == (float("inf"), 3.0)
    # all three in (25, 50] µs: linear within the bucket, as Prometheus' histogram_quantile
    assert d.quantile(0.5) == pytest.approx(37.5e-6) and d.quantile(0.99) == pytest.approx(49.75e-6)
    t = s.histogram("kite_ttft_seconds")  # 1 in (0, 5] ms, 1 in (5, 10], 2 in (10, 25]
    assert [round(t.quantile(q) * 1e3, 3) for q in (0.5, 0.9, 0.99)] == [10.0, 22.0, 24.7]
    lat = s.histogram("kite_request_latency_seconds")  # summed over its route series
    assert lat.count == 6


def test_a_captured_text_reads_as_the_figures_the_dashboard_shows():
    r = reading(parse_metrics(CAPTURED.read_text(), at=1.0), None, "http://x:1")
    assert r.requests_total == 5.0  # /healthz is not traffic
    assert r.requests_per_s is None and r.interval_s is None  # one scrape: no rates yet
    assert r.hit_rate == 1.0 and r.loads == 3
    assert r.regenerate_rate == pytest.approx(249762 / 1e6 / (434 / 1e3), abs=1e-4)
    assert (r.decision_latency_us.p50, r.decision_latency_us.count) == (37.5, 3)
    assert (r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99) == (10.0, 22.0, 24.7)
    assert r.watermark["cpu_queue"] == 2.0 and set(r.watermark) >= {"gpu_mem", "spike"}


def test_quantiles_follow_prometheus_at_the_edges():
    h = Histogram(((1.0, 0.0), (2.0, 4.0), (float("inf"), 5.0)), 5.0, 9.0)
    assert h.quantile(0.4) == pytest.approx(1.5)
    assert h.quantile(0.99) == 2.0  # in the +Inf bucket: the highest finite bound
    assert Histogram(((1.0, 0.0), (float("inf"), 0.0)), 0.0, 0.0).quantile(0.5) is None
    assert Histogram(((-0.5, 2.0), (0.0, 2.0), (float("inf"), 2.0)), 2.0, -1.0).quantile(0.5) == -0.5


def _scrape(m: ServerMetrics, at: float):
    return parse_metrics(m.render().decode(), at=at)


def test_rates_are_the_difference_of_two_scrapes_over_their_interval():
    m = ServerMetrics()
    m.requests.labels("/v1/completions", "POST", "200").inc(10)
    m.requests.labels("/metrics", "GET", "200").inc(50)
    m.loads.inc(4)
    m.hits.inc(1)
    m.decision_latency.observe(1e-3)
    first = _scrape(m, at=10.0)
    m.requests.labels("/v1/completions", "POST", "200").inc(6)
    m.requests.labels("/v1/completions", "POST", "500").inc(2)
    m.requests.labels("/metrics", "GET", "200").inc(40)  # the monitor's own scrapes: not traffic
    m.loads.inc(4)
    m.hits.inc(3)
    for _ in range(4):
        m.decision_latency.observe(20e-6)
    m.upcycle_bytes.inc(3_000_000)
    m.upcycle_tokens.inc(2_000)
    r = reading(_scrape(m, at=14.0), first)
    assert r.interval_s == 4.0
    assert r.requests_per_s == 2.0 and r.errors_per_s == 0.5
    assert r.loads_per_s == 1.0
    assert r.hit_rate_window == 0.75 and r.hit_rate == 0.5  # 3 of the last 4 loads; 4 of 8 since start
    assert r.regenerate_rate_window == 1.5  # 3 MB over 2,000 tokens
    assert r.decision_latency_us_window.count == 4 and r.decision_latency_us_window.p99 < 25
    assert r.decision_latency_us.count == 5


def test_a_restarted_server_gives_no_window_instead_of_negative_rates():
    m = ServerMetrics()
    m.loads.inc(5)
    before = _scrape(m, at=1.0)
    r = reading(_scrape(ServerMetrics(), at=3.0), before)
    assert r.restarted and r.requests_per_s is None and r.hit_rate_window is None


# -- a real server ------------------------------------------------------------------------------

def test_once_json_reads_a_running_server(served):
    res = runner.invoke(cli, ["monitor", "--server", served, "--once", "--json", "--interval", "0.2"])
    assert res.exit_code == 0, res.output
    r = parse_json(res.output)
    assert r["server"] == served and r["interval_s"] >= 0.2
    assert r["requests_total"] >= 3 and r["requests_per_s"] == 0.0  # nothing but the monitor in between
    assert r["loads"] >= 2 and 0 <= r["hit_rate"] <= 1
    assert r["regenerate_rate"] > 0 and r["states_upcycled"] >= 1
    assert r["decision_latency_us"]["count"] >= 2 and r["decision_latency_us"]["p50"] > 0
    assert r["ttft_ms"]["count"] >= 2 and r["ttft_ms"]["p99"] >= r["ttft_ms"]["p50"] > 0
    assert set(r["watermark"]) == {"gpu_mem", "gpu_mem_gb", "pcie_util", "nvlink_util", "cpu_queue", "spike"}


def test_the_live_loop_sees_requests_made_between_its_scrapes(served):
    clock = FakeClock()
    seen = []

    def fetch(url, timeout_s, clk):
        if seen:  # traffic between the first and the second scrape
            with httpx.Client(base_url=served, timeout=60) as c:
                c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        seen.append(url)
        return scrape(url, timeout_s, clk)

    readings = list(watch(served, 5.0, count=2, clock=clock, sleep=clock.sleep, fetch=fetch))
    assert all(isinstance(r, Reading) for r in readings)
    assert readings[1].interval_s == 5.0 and readings[1].requests_per_s == pytest.approx(1 / 5)
    assert readings[1].ttft_ms_window.count == 1
    assert clock.slept == [5.0]


def test_the_live_dashboard_draws_a_running_server(served):
    from rich.console import Console

    from kite.cli.monitor import show

    out = Console(file=io.StringIO(), force_terminal=True, width=160)
    clock = FakeClock()
    last = show(watch(served, 1.0, count=2, clock=clock, sleep=clock.sleep), 1.0, out)
    text = out.file.getvalue()
    assert isinstance(last, Reading)
    for row in ("API requests /s", "state hit rate", "regenerate rate", "decision p50/p90/p99 µs",
                "TTFT p50/p90/p99 ms", "watermark"):
        assert row in text, row


# -- a server that does not answer --------------------------------------------------------------

def test_once_against_a_closed_port_is_one_line_and_exit_1():
    url = closed_port()
    res = runner.invoke(cli, ["monitor", "--server", url, "--once"])
    assert res.exit_code == 1
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "does not answer" in lines[0] and url in lines[0]
    res = runner.invoke(cli, ["monitor", "--server", url, "--json"])  # --json implies --once
    assert res.exit_code == 1 and "does not answer" in res.output


def test_a_server_that_accepts_but_never_replies_times_out():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)  # connects, never answers
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        res = runner.invoke(cli, ["monitor", "--server", url, "--once", "--timeout", "0.2"])
    assert res.exit_code == 1 and "does not answer" in res.output and "Timeout" in res.output


def test_the_live_loop_says_so_and_retries_until_the_server_answers(served):
    url = closed_port()
    clock = FakeClock()
    calls = []

    def fetch(u, timeout_s, clk):  # the server comes up before the fourth try
        calls.append(u)
        return scrape(url if len(calls) <= 3 else served, timeout_s, clk)

    events = list(watch(url, 2.0, count=5, clock=clock, sleep=clock.sleep, fetch=fetch))
    assert [type(e).__name__ for e in events] == ["Unanswered"] * 3 + ["Reading"] * 2
    assert [e.failures for e in events[:3]] == [1, 2, 3]
    assert all("does not answer" in e.error and e.since == events[0].since for e in events[:3])
    assert clock.slept == [2.0] * 4  # retried at the interval, on the fake clock
    assert events[3].interval_s is None and events[4].interval_s == 2.0


def test_the_live_command_says_so_on_each_try_and_exits_1_when_it_never_answered():
    url = closed_port()
    res = runner.invoke(cli, ["monitor", "--server", url, "--interval", "0.01", "--count", "3"])
    assert res.exit_code == 1
    tries = [ln for ln in res.output.splitlines() if "retrying every" in ln]
    assert len(tries) == 3 and "tried 3 times" in tries[-1]
    assert "error:" in res.output and "tried 3 times since" in res.output


def test_the_live_dashboard_keeps_the_last_figures_under_the_warning(served):
    from rich.console import Console

    from kite.cli.monitor import show

    clock = FakeClock()
    down = closed_port()
    calls = []

    def fetch(u, timeout_s, clk):  # answers once, then goes away
        calls.append(u)
        return scrape(served if len(calls) == 1 else down, timeout_s, clk)

    out = Console(file=io.StringIO(), force_terminal=True, width=160)
    last = show(watch(served, 1.0, count=2, clock=clock, sleep=clock.sleep, fetch=fetch), 1.0, out)
    text = out.file.getvalue()
    assert isinstance(last, Unanswered)
    assert "does not answer" in text and "retrying every 1 s" in text
    assert text.rindex("does not answer") < text.rindex("state hit rate")  # the figures stay, below


def test_read_once_raises_when_the_second_scrape_fails(served):
    clock = FakeClock()
    urls = iter([served, closed_port()])
    from kite.serve.client import ServerUnreachable

    with pytest.raises(ServerUnreachable, match="does not answer"):
        read_once(served, 1.0, clock=clock, sleep=clock.sleep, fetch=lambda u, t, c: scrape(next(urls), t, c))


class _NotKite(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = b"<html>hello</html>" if self.path == "/" else b"not here"
        self.send_response(200 if self.path == "/" else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_url_that_is_not_a_kite_server_says_so():
    httpd = HTTPServer(("127.0.0.1", 0), _NotKite)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        res = runner.invoke(cli, ["monitor", "--server", url, "--once"])
    finally:
        httpd.shutdown()
    assert res.exit_code == 1 and "HTTP 404" in res.output and "kite serve" in res.output


@pytest.mark.parametrize("url", ["notaurl", "ftp://host:1", "http://:8088", "http://h:99999"])
def test_a_server_url_that_names_no_server_is_bad_usage(url):
    res = runner.invoke(cli, ["monitor", "--server", url, "--once"])
    assert res.exit_code == 2 and "expected http://HOST:PORT" in res.output


def test_without_server_the_url_comes_from_the_config(monkeypatch):
    url = closed_port()
    monkeypatch.setenv("KITE_SERVER__PORT", url.rsplit(":", 1)[1])
    res = runner.invoke(cli, ["monitor", "--once"])
    assert res.exit_code == 1 and url in res.output
