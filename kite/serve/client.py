"""A small HTTP client for a running `kite serve`'s admin endpoints (used by `kite yoco
reload-rules | switch-rules | rules-status`), and how commands find a server's URL and check it.
Failures are KITE errors with one clear line: server unreachable (exit 1), auth refused (exit 2),
rule set refused (exit 2, with its report)."""

from __future__ import annotations

from dataclasses import dataclass

from kite.errors import BadInput, KiteError


class ServerUnreachable(KiteError):
    pass


class AdminRefused(BadInput):
    pass


class RulesRejected(BadInput):
    """The server refused a rule set; `report` holds every error, rendered."""

    def __init__(self, message: str, report: str, errors: list[dict]):
        super().__init__(message)
        self.report, self.errors = report, errors


def default_server_url(cfg=None) -> str:
    """http://host:port from the config (a wildcard bind is reached through 127.0.0.1)."""
    if cfg is None:
        from kite.config import load_config

        cfg = load_config()
    host = cfg.server.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{cfg.server.port}"


def check_server_url(url: str) -> str:
    """`url` when it can name a server (http or https, a host, a port that is a number 1-65535);
    otherwise BadInput (exit 2): a URL that names no server is bad usage, not an unreachable server."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number, or past 65535
        ok = False
    if not ok:
        raise BadInput(f"server URL {url!r}: expected http://HOST:PORT, e.g. http://127.0.0.1:8088")
    return url


@dataclass
class AdminClient:
    url: str
    token: str | None = None
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        check_server_url(self.url)

    def _call(self, method: str, path: str, json: dict | None = None) -> dict:
        try:
            import httpx
        except ModuleNotFoundError:
            raise KiteError("talking to a KITE server needs httpx: pip install httpx") from None

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            r = httpx.request(method, self.url.rstrip("/") + path, json=json, headers=headers,
                              timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"cannot reach the KITE server at {self.url} ({type(exc).__name__}: {exc}); "
                                    "is `kite serve` running? (--server URL)") from None
        try:
            body = r.json()
        except ValueError:
            body = {}
        err = body.get("error") if isinstance(body, dict) else None
        message = (err or {}).get("message") or r.reason_phrase
        if r.status_code in (401, 403):
            hint = "" if self.token else " (give --token or set KITE_ADMIN_TOKEN)"
            raise AdminRefused(f"{self.url}: {r.status_code} {message}{hint}")
        if r.status_code == 422 and err and "report" in err:
            raise RulesRejected(f"{self.url}: {message}", err["report"], err.get("errors", []))
        if r.status_code >= 500:
            raise KiteError(f"{self.url}: {r.status_code} {message}")
        if r.status_code >= 400:
            raise BadInput(f"{self.url}: {r.status_code} {message}")
        return body

    def reload(self, path: str | None = None) -> dict:
        return self._call("POST", "/admin/rules/reload", {"path": path} if path else {})

    def switch(self, version: str) -> dict:
        return self._call("POST", "/admin/rules/switch", {"version": version})

    def status(self) -> dict:
        return self._call("GET", "/admin/rules/status")
