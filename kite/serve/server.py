"""Run an app under uvicorn: in the foreground (`kite serve`) or in a background thread (tests,
benchmarks), on 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import socket
import threading
import time

from kite.ports import free_port

# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). The model's
# thread lets go of it at each torch call and its device waits; with the event loop busy streaming
# to many clients, each took up to a whole interval to get it back, and a step of many rows paid
# that several times over. A foreground server runs with this instead.
SWITCH_INTERVAL_S = 0.0005


def uvicorn_config(app, host: str, port: int, log_level: str = "warning", kite_logs: bool = False):
    """uvicorn's settings for one app. `kite_logs`: also set up KITE's server logs (`log_config`),
    as the foreground `kite serve` does; in tests and benchmarks they go wherever the caller's
    logging sends them."""
    import uvicorn

    # One process, one model: no workers, no reload. h11 keeps the dependency set small. uvicorn's
    # own access log is off: KITE's (kite.serve.access) has the route's latency too.
    extra = {"log_config": log_config(log_level)} if kite_logs else {}
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          lifespan="on", http="h11", ws="none", timeout_graceful_shutdown=5, **extra)


def log_config(level: str) -> dict:
    """uvicorn's logging setup plus KITE's server loggers at `level`, in uvicorn's format on
    stderr: `kite.serve.access` (one line per request: client, request line, status, ms) at info;
    `kite.serve` (rule reloads and switches at info, their refusals and refused admin tokens at
    warning, unhandled errors)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["loggers"]["kite.serve"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return cfg


def run(app, host: str = "127.0.0.1", port: int = 8088, log_level: str = "info",
        sock: socket.socket | None = None) -> None:
    """Serve `app` in the foreground; on `sock` (from :func:`bind_socket`) when given. What start-up
    made (the model, its captured steps, the web stack) is frozen out of Python's collector first
    (kite.serve.heap): a full collection then walks only what requests made."""
    import sys

    import uvicorn

    from kite.serve.heap import freeze_startup_heap

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    freeze_startup_heap()

    uvicorn.Server(uvicorn_config(app, host, port, log_level, kite_logs=True)).run(sockets=[sock] if sock else None)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port for :func:`run` (which listens on it): `kite serve` binds
    before the model loads, so a busy port fails at once. A busy or forbidden port is KiteError
    (exit 1); a host that is not an address of this machine is BadInput (exit 2)."""
    import errno

    from kite.errors import BadInput, KiteError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BadInput(f"server.host {host}: not an address ({exc.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        where = f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise KiteError(f"cannot listen on {where}: the port is in use (another `kite serve`?); "
                            "choose another with --port or server.port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise BadInput(f"cannot listen on {where}: {host} is not an address of this machine") from None
        raise KiteError(f"cannot listen on {where}: {exc.strerror}") from None
    return sock


class BackgroundServer:
    """`with BackgroundServer(app) as url:` serves `app` on a free port in a thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None):
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn_config(app, self.host, self.port))
        self.server.install_signal_handlers = lambda: None  # not the main thread
        self.thread = threading.Thread(target=self.server.run, name="kite-serve", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
