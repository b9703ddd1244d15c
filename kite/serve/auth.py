"""Admin auth: `Authorization: Bearer <token>` against server.admin_token (or KITE_ADMIN_TOKEN).
Without a configured token the admin endpoints refuse every request: they never run open."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request


def require_admin(request: Request) -> None:
    """A FastAPI dependency: 403 when no token is configured or the token is wrong, 401 when the
    request carries none."""
    expected = request.app.state.kite.settings.admin_token
    if not expected:
        raise HTTPException(403, "admin endpoints are disabled: no admin token is configured "
                                 "(set server.admin_token or KITE_ADMIN_TOKEN)")
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise HTTPException(401, "admin token required: send 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise HTTPException(403, "admin token refused")
