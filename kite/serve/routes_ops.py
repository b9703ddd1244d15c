"""`/healthz` and Prometheus `/metrics`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter()


@router.get("/healthz")
async def healthz(request: Request):
    srv = request.app.state.kite
    rules = srv.rules.current
    sampler = srv.sampler
    return {"ok": True, "model": srv.runner.model_name, "fusion": srv.settings.fusion,
            "rules": {"version": rules.version, "sha256": rules.sha256},
            "watermark": sampler.latest().to_dict() if sampler is not None else None}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(request.app.state.kite.metrics.render(), media_type=CONTENT_TYPE_LATEST)
