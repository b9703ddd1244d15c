"""`/v1/states`: upload a document (upcycled into a state), list states, delete one."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from kite.serve.workers import in_worker, on_model
from kite.serve.schemas import StateUpload
from kite.serve.auth import authenticate
from kite.serve.tenants import scoped

router = APIRouter(dependencies=[Depends(authenticate)])


@router.post("/v1/states")
async def upload(request: Request, body: StateUpload):
    """Upcycle `document` and store it; 201 with the state's id (200 when the same document was
    already stored under its content id)."""
    srv = scoped(request)
    if body.id is not None:
        srv.store.path_for(body.id)  # refuse a bad id before any work
    up = await on_model(srv, srv.runner.upcycle, body.document, body.id, body.name or "-", body.overwrite)
    srv.metrics.observe_upcycle(up)
    return JSONResponse(up.to_dict(), status_code=201 if up.created else 200)


@router.get("/v1/states")
async def list_states(request: Request):
    srv = scoped(request)
    states = await in_worker(srv.store.list)
    return {"object": "list", "data": [s.to_dict() for s in states]}


@router.get("/v1/states/{state_id}")
async def get_state(request: Request, state_id: str):
    return scoped(request).store.summary(state_id).to_dict()


@router.delete("/v1/states/{state_id}")
async def delete_state(request: Request, state_id: str):
    srv = scoped(request)
    await on_model(srv, srv.runner.delete, state_id)
    if srv.health is not None:
        srv.health.reset(state_id)
    return {"id": state_id, "deleted": True}
