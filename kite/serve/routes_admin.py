"""`/admin/rules`: reload, switch and status of the rule set (admin token required).

Reload compiles the whole file, then swaps; a bad file is refused with every error (422 and the
rendered report) and the old set keeps serving."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends, Request

from kite.errors import BadInput
from kite.serve.auth import require_admin
from kite.serve.errors import error_response
from kite.serve.workers import in_worker
from kite.serve.schemas import ReloadRequest, SwitchRequest
from kite.serve.states import StateNotFound

router = APIRouter(prefix="/admin/rules", dependencies=[Depends(require_admin)])


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


async def _swap(request: Request, fn, *args):
    from kite.yoco.rules import RuleSetError

    srv = request.app.state.kite
    try:
        ruleset = await in_worker(fn, *args)
    except RuleSetError as exc:
        srv.metrics.rule_reloads.labels("error").inc()
        return error_response(422, f"rule set refused ({len(exc.errors)} error"
                              f"{'s' if len(exc.errors) != 1 else ''}); the old set keeps serving",
                              report=exc.report(), errors=[e.to_dict() for e in exc.errors],
                              active=srv.rules.status())
    except BadInput as exc:
        srv.metrics.rule_reloads.labels("error").inc()
        return error_response(422, f"{exc}; the old set keeps serving", report=str(exc), errors=[],
                              active=srv.rules.status())
    srv.metrics.rule_reloads.labels("ok").inc()
    return {"ok": True, **ruleset.info()}


@router.post("/reload")
async def reload(request: Request, body: ReloadRequest | None = None):
    srv = request.app.state.kite
    path = rules_file(srv.rules.rules_dir, body.path) if body and body.path else None
    return await _swap(request, srv.rules.reload, path)


@router.post("/switch")
async def switch(request: Request, body: SwitchRequest):
    srv = request.app.state.kite
    path = srv.rules.path_for(body.version)  # BadInput (400) for a name that is not a version
    rules_file(srv.rules.rules_dir, str(path))
    return await _swap(request, srv.rules.reload, path)


@router.get("/status")
async def status(request: Request):
    srv = request.app.state.kite
    return {**srv.rules.status(), "rules_dir": str(srv.rules.rules_dir)}
