"""GET /health, /version and /metrics: the operational endpoints."""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from server.errors import APIError
from server.routes.context import Ctx

router = APIRouter()


@router.get("/health", response_model=None)
async def health(ctx: Ctx) -> Response:
    """200 while the engine loop is alive; 503 (OpenAI error shape) once it died."""
    if ctx.engine.is_alive:
        return Response(status_code=200)
    reason = ctx.engine.dead_reason or "the engine is not running"
    return APIError(503, reason, code="engine_dead").response()


@router.get("/version")
async def version() -> JSONResponse:
    try:
        number = importlib.metadata.version("kvserve")
    except importlib.metadata.PackageNotFoundError:
        number = "unknown"
    return JSONResponse({"version": number})


@router.get("/metrics", response_model=None)
async def metrics(ctx: Ctx) -> Response:
    """Prometheus exposition; the metric set is defined in server/metrics.py."""
    if ctx.metrics is None:
        raise APIError(503, "metrics are not available on this server", code="no_metrics")
    body, content_type = ctx.metrics.render()
    return Response(content=body, media_type=content_type)
