"""Request body size limit as plain ASGI middleware: a body over the limit gets 413 before it is
read whole (a declared Content-Length is refused at once; a chunked body is refused as soon as
it passes the limit)."""

from __future__ import annotations

import json


class BodyTooLarge(Exception):
    pass


def _refusal(limit: int) -> tuple[dict, dict]:
    body = json.dumps({"error": {"message": f"request body over the limit of {limit:,} bytes "
                                            "(server.max_body_mb)", "type": "request_too_large",
                                 "code": 413}}).encode()
    start = {"type": "http.response.start", "status": 413,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]}
    return start, {"type": "http.response.body", "body": body}


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
        if declared is not None and declared > self.max_bytes:
            return await self._refuse(send)
        if declared is not None:
            return await self.app(scope, receive, send)
        # No length given (chunked): read up to the limit, refuse past it, else replay.
        messages, total = [], 0
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            total += len(msg.get("body", b""))
            if total > self.max_bytes:
                return await self._refuse(send)
            if not msg.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    async def _refuse(self, send):
        start, body = _refusal(self.max_bytes)
        await send(start)
        await send(body)
