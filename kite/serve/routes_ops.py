"""`/healthz` and Prometheus `/metrics`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter()


@router.get("/healthz")
async def healthz(request: Request):
    """200 with the model, rules and watermark; 503 with the error once the model's thread has stopped
    (kite.serve.batcher.ModelStopped: the server answers nothing more until it is restarted)."""
    srv = request.app.state.kite
    rules = srv.rules.current
    sampler = srv.sampler
    stopped = srv.runner.batcher.stopped
    body = {"ok": stopped is None, "model": srv.runner.model_name, "fusion": srv.settings.fusion,
            "rules": {"version": rules.version, "sha256": rules.sha256},
            "watermark": sampler.latest().to_dict() if sampler is not None else None}
    if stopped is not None:
        return JSONResponse({**body, "error": str(stopped)}, status_code=503)
    return body


@router.get("/metrics")
async def metrics(request: Request):
    return Response(request.app.state.kite.metrics.render(), media_type=CONTENT_TYPE_LATEST)
