"""Request body size limit as plain ASGI middleware: a body over the limit gets 413 before it is
read whole (a declared Content-Length is refused at once, before any of the body is read; a
chunked body as soon as it passes the limit).

The refusal is raised from `receive` when the route reads the body, so it comes after routing:
the request is counted and logged under its route like any other answer (a path no route serves
gets its 404 without its body being read)."""

from __future__ import annotations

from starlette.exceptions import HTTPException


def too_large(limit: int) -> HTTPException:
    # connection: close, so the client stops sending the rest of the body
    return HTTPException(413, f"request body over the limit of {limit:,} bytes (server.max_body_mb)",
                         headers={"connection": "close"})


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
        total = 0

        async def limited():
            nonlocal total
            if declared is not None and declared > self.max_bytes:
                raise too_large(self.max_bytes)
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.max_bytes:
                    raise too_large(self.max_bytes)
            return message

        return await self.app(scope, limited, send)
