"""Admin auth: `Authorization: Bearer <token>` against server.admin_token (or KITE_ADMIN_TOKEN).
Without a configured token the admin endpoints refuse every request: they never run open."""

from __future__ import annotations

import hmac
import logging

from fastapi import HTTPException, Request

log = logging.getLogger("kite.serve")


def require_admin(request: Request) -> None:
    """A FastAPI dependency: 403 when no token is configured or the token is wrong, 401 when the
    request carries none. Each refusal logs a warning naming the request and its client (never
    the token it sent)."""
    expected = request.app.state.kite.settings.admin_token
    if not expected:
        raise _refused(request, 403, "admin endpoints are disabled: no admin token is configured "
                                     "(set server.admin_token or KITE_ADMIN_TOKEN)", "no token configured")
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise _refused(request, 401, "admin token required: send 'Authorization: Bearer <token>'", "no token sent",
                       headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise _refused(request, 403, "admin token refused", "wrong token")


def _refused(request: Request, status: int, message: str, why: str, headers=None) -> HTTPException:
    client = f"{request.client.host}:{request.client.port}" if request.client else "?"
    log.warning("admin request refused (%d, %s): %s %s from %s", status, why, request.method,
                request.url.path, client)
    return HTTPException(status, message, headers=headers)
