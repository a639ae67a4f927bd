"""POST /v1/embeddings (OpenAI's shape; server/embeddings.py does the work)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from server.embeddings import EmbeddingRequest, check_dimensions, create_embeddings, prepare_inputs
from server.request_body import OffLoopBodyRoute
from server.routes.context import Ctx
from server.routes.generation import ClientDisconnected, until_disconnect

router = APIRouter(route_class=OffLoopBodyRoute)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: HTTPRequest, ctx: Ctx) -> JSONResponse:
    ctx.check_base_model(body.model, "/v1/embeddings")
    check_dimensions(ctx, body.dimensions)
    prompts = await ctx.request_cpu.run(request, prepare_inputs, ctx, body)
    try:
        payload = await until_disconnect(request, create_embeddings(ctx, body, prompts))
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)  # nobody reads it; the requests are aborted
    return JSONResponse(payload)
