"""`/admin/rules`: reload, switch and status of the rule set; `/admin/states`: lift a state's
quarantine (admin token required).

Reload compiles the whole file, then swaps; a bad file is refused with every error (422 and the
rendered report) and the old set keeps serving. Every reload or switch past the token counts once
in `kite_rules_reloads_total{result}` and logs one line (`kite.serve`), whatever refused it."""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from kite.errors import BadInput, KiteError
from kite.serve.auth import require_admin
from kite.serve.errors import error_response, status_of
from kite.serve.workers import in_worker
from kite.serve.schemas import ReloadRequest, SwitchRequest
from kite.serve.states import StateNotFound

log = logging.getLogger("kite.serve")
router = APIRouter(prefix="/admin/rules", dependencies=[Depends(require_admin)])
states_router = APIRouter(prefix="/admin/states", dependencies=[Depends(require_admin)])


def rules_file(rules_dir: Path, spec: str) -> Path:
    """A rule file named by a client: relative to the rules folder, or absolute; either way it
    must lie inside the rules folder."""
    root = rules_dir.resolve()
    try:
        path = (root / spec).resolve()  # an absolute spec replaces root
    except (ValueError, OSError):
        raise BadInput(f"rules file {spec[:80]!r}: not a usable path") from None
    if not path.is_relative_to(root):
        raise BadInput(f"rules file {spec!r}: outside the rules folder {root}")
    if not path.is_file():
        raise StateNotFound(f"rules file {spec!r}: no such file in {root}")
    return path


async def _body(request: Request, model: type[BaseModel], optional: bool = False):
    """The request's JSON body as `model` (None for an empty optional body). A body that does not
    fit is RequestValidationError (400), as for a body FastAPI reads."""
    raw = await request.body()
    if optional and not raw.strip():
        return None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


async def _reload_target(request: Request, rules) -> Path | None:
    body = await _body(request, ReloadRequest, optional=True)
    return rules_file(rules.rules_dir, body.path) if body and body.path else None


async def _switch_target(request: Request, rules) -> Path:
    body = await _body(request, SwitchRequest)
    path = rules.path_for(body.version)  # BadInput (400) for a name that is not a version
    rules_file(rules.rules_dir, str(path))
    return path


async def _swap(request: Request, what: str, target):
    """Resolve the file (`target`), compile it and swap it in. One count and one log line per
    request: `ok` when a set was swapped in; `error` for a bad body or version (400), no such file
    (404), a body over the limit (413) and a file with errors (422), and the old set keeps serving."""
    from kite.yoco.rules import RuleSetError

    srv = request.app.state.kite
    old = srv.rules.current
    try:
        path = await target(request, srv.rules)
    except (KiteError, RequestValidationError, HTTPException) as exc:
        status = (status_of(exc) if isinstance(exc, KiteError) else
                  exc.status_code if isinstance(exc, HTTPException) else 400)
        why = exc.detail if isinstance(exc, HTTPException) else str(exc).splitlines()[0] if str(exc) else ""
        _refused(srv, what, status, why or type(exc).__name__, old)
        raise
    try:
        ruleset = await in_worker(srv.rules.reload, path)
    except RuleSetError as exc:
        n = len(exc.errors)
        _refused(srv, what, 422, f"{n} error{'s' if n != 1 else ''} in {exc.errors[0].file} "
                                 f"(first: {exc.errors[0].header})", old)
        return error_response(422, f"rule set refused ({n} error{'s' if n != 1 else ''}); the old set "
                              "keeps serving", report=exc.report(), errors=[e.to_dict() for e in exc.errors],
                              active=srv.rules.status())
    except BadInput as exc:
        _refused(srv, what, 422, str(exc), old)
        return error_response(422, f"{exc}; the old set keeps serving", report=str(exc), errors=[],
                              active=srv.rules.status())
    srv.metrics.rule_reloads.labels("ok").inc()
    log.info("rules %s: %s (%d rules, sha256 %s) from %s now decides; was %s (sha256 %s)", what,
             ruleset.version, len(ruleset.rules), ruleset.sha256[:12], ruleset.source, old.version, old.sha256[:12])
    return {"ok": True, **ruleset.info()}


def _refused(srv, what: str, status: int, why: str, old) -> None:
    srv.metrics.rule_reloads.labels("error").inc()
    log.warning("rules %s refused (%d): %s; %s (sha256 %s) keeps serving", what, status, why, old.version,
                old.sha256[:12])


@router.post("/reload")
async def reload(request: Request):
    """Body (optional): `{"path": FILE}`, a file inside the rules folder; default: the active file."""
    return await _swap(request, "reload", _reload_target)


@router.post("/switch")
async def switch(request: Request):
    """Body: `{"version": "v2"}` → `yoco_rules_v2.yaml` in the rules folder (`v1`: `yoco_rules.yaml`)."""
    return await _swap(request, "switch", _switch_target)


@router.get("/status")
async def status(request: Request):
    srv = request.app.state.kite
    return {**srv.rules.status(), "rules_dir": str(srv.rules.rules_dir)}


@states_router.delete("/{state_id}/quarantine")
async def lift_quarantine(request: Request, state_id: str, tenant: str | None = None):
    """End a state's quarantine (kite.serve.quarantine) without replacing its file: the next request
    naming it reads it again (and quarantines it again if a reader still refuses it). `?tenant=NAME`:
    the state of that tenant (each tenant's states and quarantine are its own). 404 for an unknown
    state; `lifted: false` when it was not quarantined."""
    from kite.serve.tenants import tenant_view
    from kite.tenants import check_tenant

    srv = tenant_view(request.app.state.kite, check_tenant(tenant, "tenant"))
    srv.store.existing(state_id)
    lifted = srv.store.quarantine.lift(state_id, "lifted by an admin")
    log.info("state %s: quarantine lift asked by an admin (%s)", state_id, "lifted" if lifted else "not quarantined")
    return {"id": state_id, "lifted": lifted}
