"""Request counts and latency per route, and one access log line per request, as plain ASGI
middleware (works for streamed bodies)."""

from __future__ import annotations

import logging
import time

access = logging.getLogger("kite.serve.access")


class RequestMetrics:
    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}
        t0 = time.perf_counter()

        async def send_and_see(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        finally:
            seconds = time.perf_counter() - t0
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.requests.labels(route, scope.get("method", ""), str(status["code"])).inc()
            self.metrics.request_latency.labels(route).observe(seconds)
            client = scope.get("client")
            access.info('%s "%s %s HTTP/%s" %d %.1f ms', f"{client[0]}:{client[1]}" if client else "-",
                        scope.get("method", ""), scope.get("path", ""), scope.get("http_version", "1.1"),
                        status["code"], seconds * 1e3)
