"""Auth. Admin: `Authorization: Bearer <token>` against server.admin_token (or KITE_ADMIN_TOKEN);
without a configured token the admin endpoints refuse every request: they never run open.
API keys: `Authorization: Bearer <key>` on the /v1/ routes against server.api_keys_file, each key
naming its tenant (kite.serve.tenants); without a key file the routes are open, of no tenant."""

from __future__ import annotations

import hmac
import logging
from pathlib import Path

import yaml
from fastapi import HTTPException, Request

from kite.errors import BadInput
from kite.tenants import check_tenant

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


MIN_KEY_CHARS = 16


def read_api_keys(path: str | Path) -> dict[str, str | None]:
    """The API key file: a YAML mapping of key -> tenant name (null: the key's requests are of no
    tenant). BadInput, one line, for a file that is missing or not such a mapping, a key shorter than
    16 characters, or a malformed tenant name. Messages name a key by its position, never its text."""
    path = Path(path).expanduser()
    where = f"server.api_keys_file {path}"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise BadInput(f"{where}: cannot read it as YAML ({type(exc).__name__})") from None
    if not isinstance(data, dict) or not data:
        raise BadInput(f"{where}: expected a mapping of API key -> tenant name (or null), one key a line")
    out: dict[str, str | None] = {}
    for i, (key, tenant) in enumerate(data.items(), 1):
        if not isinstance(key, str) or len(key.strip()) < MIN_KEY_CHARS or key != key.strip():
            raise BadInput(f"{where}: key #{i} is not a string of at least {MIN_KEY_CHARS} characters "
                           "(without spaces around it)")
        if tenant is not None and not isinstance(tenant, str):
            raise BadInput(f"{where}: key #{i}: the tenant is a name or null, not a {type(tenant).__name__}")
        out[key] = check_tenant(tenant, f"{where}: key #{i}: tenant")
    return out


def authenticate(request: Request) -> None:
    """A FastAPI dependency of every ``/v1/`` route: with API keys configured, the request's key
    names its tenant (``request.state.tenant``); 401 without a key or with an unknown one. Without
    API keys every request is of no tenant."""
    keys = request.app.state.kite.settings.api_keys
    if keys is None:
        request.state.tenant = None
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        raise _key_refused(request, "API key required: send 'Authorization: Bearer <key>'", "no key sent")
    found, tenant = False, None
    for key, who in keys.items():   # every key compared, in constant time each
        if hmac.compare_digest(given.encode(), key.encode()):
            found, tenant = True, who
    if not found:
        raise _key_refused(request, "API key refused", "unknown key")
    request.state.tenant = tenant


def _key_refused(request: Request, message: str, why: str) -> HTTPException:
    client = f"{request.client.host}:{request.client.port}" if request.client else "?"
    log.warning("request refused (401, %s): %s %s from %s", why, request.method, request.url.path, client)
    return HTTPException(401, message, headers={"WWW-Authenticate": "Bearer"})
