"""Errors as OpenAI-style JSON bodies: `{"error": {"message", "type", "code"}}`, one line each."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kite.errors import BadInput, FingerprintMismatch, KiteError
from kite.serve.quarantine import StateUnusable
from kite.serve.states import StateExists, StateNotFound

log = logging.getLogger("kite.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 413: "request_too_large", 422: "unprocessable_entity",
          500: "server_error", 503: "service_unavailable"}


def error_response(status: int, message: str, headers: dict | None = None, **extra) -> JSONResponse:
    body = {"message": message, "type": _TYPES.get(status, "error"), "code": status, **extra}
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def status_of(exc: KiteError) -> int:
    """The HTTP status a KITE error maps to."""
    from kite.serve.batcher import ModelStopped
    from kite.yoco.rules import RuleSetError

    for cls, status in ((StateNotFound, 404), (StateExists, 409), (FingerprintMismatch, 409),
                        (RuleSetError, 422), (StateUnusable, 422), (BadInput, 400), (ModelStopped, 503)):
        if isinstance(exc, cls):
            return status
    return 500


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(KiteError)
    async def _kite(request: Request, exc: KiteError):
        return error_response(status_of(exc), str(exc).strip().splitlines()[0] if str(exc).strip() else
                              type(exc).__name__)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(400, "; ".join(_problem(e) for e in exc.errors()) or "invalid request")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def _problem(e: dict) -> str:
    """One validation error as `field: what is wrong`; a body that is not JSON, or is missing, says
    it is the request body."""
    loc = tuple(e.get("loc", ()))
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error") or e.get("msg")
        at = f" at character {loc[1] + 1}" if len(loc) > 1 and isinstance(loc[1], int) else ""
        return f"the request body is not valid JSON{at} ({detail})"
    where = ".".join(str(p) for p in loc if p != "body")
    if not where and loc[:1] == ("body",):
        where = "request body"
    return f"{where}: {e.get('msg')}" if where else str(e.get("msg"))
