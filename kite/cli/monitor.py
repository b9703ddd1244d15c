"""`kite monitor`: a running server's figures, live, from its `/metrics`.

Thin over `kite.serve.monitor`: scrape, compute a Reading, draw it (rich Live on a terminal, one
line per reading elsewhere), and say so while the server does not answer.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Optional

import typer

from kite.cli._common import JsonOpt, console, emit_json, kept_on_interrupt, user_config
from kite.errors import KiteError

NOTHING_KEPT = "nothing to keep: kite monitor only reads /metrics"


def monitor(
    server: Annotated[Optional[str], typer.Option(
        "--server", help="The server's URL (default: http://server.host:server.port from the config).")] = None,
    interval: Annotated[float, typer.Option(
        "--interval", min=0.01, help="Seconds between scrapes; rates are over this interval.")] = 2.0,
    once: Annotated[bool, typer.Option(
        "--once", help="One reading (two scrapes --interval apart, for the rates), then exit.")] = False,
    count: Annotated[Optional[int], typer.Option(
        "--count", min=1, help="Stop after N readings (default: until Ctrl-C).")] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0.01, help="Seconds a scrape waits for the server.")] = 5.0,
    json_out: bool = JsonOpt,
) -> None:
    """A live dashboard of a running `kite serve`: API requests/s, state hit rate, regenerate rate
    (MB of .upc per 1,000 context tokens), YOCO decision latency and TTFT percentiles, the hardware
    watermark. Rates are the difference of two scrapes of /metrics over their interval. While the
    server does not answer the dashboard says so and retries every --interval; with --once that is
    one line and exit 1. --json implies --once.

    Examples:

      kite monitor

      kite monitor --server http://10.0.0.5:8088 --interval 5

      kite monitor --once --json | jq .hit_rate
    """
    from kite.serve.client import check_server_url, default_server_url

    url = check_server_url(server) if server is not None else default_server_url(user_config())
    try:
        from kite.serve.monitor import read_once, watch
    except ModuleNotFoundError as exc:
        raise KiteError(f"kite monitor needs {exc.name}: pip install 'kite[serve]'") from None

    if once or json_out:
        r = read_once(url, interval, timeout)
        if json_out:
            emit_json(r.to_dict())
        else:
            console().print(dashboard(r, interval), highlight=False)
        return
    with kept_on_interrupt(NOTHING_KEPT):
        last = show(watch(url, interval, count=count, timeout_s=timeout), interval, console())
    from kite.serve.monitor import Unanswered

    if isinstance(last, Unanswered):
        raise KiteError(f"{last.error}; {_tries(last.failures)} since {_clock(last.since)}")


def show(events, interval: float, out):
    """Draw each Reading or Unanswered of `events` on `out`: a rich Live dashboard on a terminal,
    else one line each. Returns the last event."""
    from kite.serve.monitor import Unanswered

    last = reading = None
    if not out.is_terminal:
        for last in events:
            out.print(line(last), highlight=False, soft_wrap=True)
        return last
    from rich.console import Group
    from rich.live import Live

    with Live(console=out, auto_refresh=False, transient=False) as live:
        for last in events:
            if isinstance(last, Unanswered):  # say so above the last figures it gave
                view = unanswered(last) if reading is None else Group(unanswered(last), dashboard(reading, interval))
            else:
                reading, view = last, dashboard(last, interval)
            live.update(view, refresh=True)
    return last


def _clock(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%H:%M:%S")


def _n(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(p) -> str:
    if p is None or p.count == 0:
        return "-"
    return f"{_n(p.p50, '.1f')} / {_n(p.p90, '.1f')} / {_n(p.p99, '.1f')}  (n={p.count})"


def unanswered(u):
    from rich.text import Text

    return Text.assemble((f"{u.server} does not answer", "bold red"),
                         f" since {_clock(u.since)} ({_tries(u.failures)}); retrying every "
                         f"{u.retry_in_s:g} s\n", (u.error, "red"))


def _tries(n: int) -> str:
    return "tried once" if n == 1 else f"tried {n} times"


def dashboard(r, interval: float):
    """A rich Table of one Reading: the last interval beside the figures since the server started."""
    from rich.table import Table

    window = f"last {r.interval_s:.1f} s" if r.interval_s else "last interval"
    t = Table(title=f"kite monitor · {r.server} · {_clock(r.at)} · every {interval:g} s"
              + (" · [yellow]server restarted[/]" if r.restarted else ""), box=None, title_justify="left")
    t.add_column("")
    t.add_column(window, justify="right")
    t.add_column("since start", justify="right")
    t.add_row("API requests /s", _n(r.requests_per_s), f"{r.requests_total:,.0f} requests")
    t.add_row("5xx /s", _n(r.errors_per_s), "")
    t.add_row("state loads /s", _n(r.loads_per_s), f"{r.loads:,.0f} loads, {r.hits:,.0f} hits, {r.skips:,.0f} skips")
    t.add_row("state hit rate", _n(r.hit_rate_window), _n(r.hit_rate))
    t.add_row("regenerate rate (MB / 1k tokens)", _n(r.regenerate_rate_window), _n(r.regenerate_rate))
    t.add_row("compression (fp16 KV / .upc)", "", "-" if r.compression_ratio is None else
              f"{r.compression_ratio:.2f}× over {r.states_upcycled:,.0f} states")
    t.add_row("decision p50/p90/p99 µs", _pct(r.decision_latency_us_window), _pct(r.decision_latency_us))
    t.add_row("TTFT p50/p90/p99 ms", _pct(r.ttft_ms_window), _pct(r.ttft_ms))
    w = r.watermark
    t.add_row("watermark: GPU memory (now)", f"{_n(w.get('gpu_mem'))} ({_n(w.get('gpu_mem_gb'), '.1f')} GB)", "")
    t.add_row("· PCIe / NVLink util", f"{_n(w.get('pcie_util'))} / {_n(w.get('nvlink_util'))}", "")
    t.add_row("· CPU queue / spike", f"{_n(w.get('cpu_queue'), '.1f')} / {_n(w.get('spike'), '.0f')}", "")
    return t


def line(event) -> str:
    """One plain line for a log: a Reading's headline figures, or that the server does not answer."""
    from kite.serve.monitor import Unanswered

    if isinstance(event, Unanswered):
        return (f"[{_clock(event.at)}] {event.error}; {_tries(event.failures)}, retrying every "
                f"{event.retry_in_s:g} s")
    r = event
    return (f"[{_clock(r.at)}] requests {_n(r.requests_per_s)}/s · hit rate {_n(r.hit_rate_window)} "
            f"({_n(r.hit_rate)} since start) · regenerate {_n(r.regenerate_rate)} MB/1k tokens · "
            f"decision p50/p99 {_p50_p99(r.decision_latency_us_window, r.decision_latency_us, '.1f')} µs · "
            f"TTFT p50/p99 {_p50_p99(r.ttft_ms_window, r.ttft_ms, '.0f')} ms · "
            f"gpu_mem {_n(r.watermark.get('gpu_mem'))}" + (" · server restarted" if r.restarted else ""))


def _p50_p99(window, since_start, fmt: str) -> str:
    """The last interval's p50/p99 when it had observations, else since start (marked)."""
    if window is not None and window.count:
        return f"{_n(window.p50, fmt)}/{_n(window.p99, fmt)}"
    return f"{_n(since_start.p50, fmt)}/{_n(since_start.p99, fmt)} (since start)"
