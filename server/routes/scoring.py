"""POST /v1/score and /v1/rerank (vLLM's shapes; server/scoring.py does the work, with a
cross-encoder's head or a causal reranker's prompt, whichever the server has)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from server.errors import invalid
from server.request_body import OffLoopBodyRoute
from server.routes.context import Ctx
from server.routes.generation import ClientDisconnected, until_disconnect
from server.scoring import (
    RerankRequest,
    ScoreRequest,
    pairs_of,
    rerank_body,
    score_body,
    score_prompts,
    scorer,
)

router = APIRouter(route_class=OffLoopBodyRoute)


@router.post("/v1/score")
async def score(body: ScoreRequest, request: HTTPRequest, ctx: Ctx) -> JSONResponse:
    ctx.check_base_model(body.model, "/v1/score")
    scoring = scorer(ctx, body.instruction)
    pairs = pairs_of(body)
    prompts = await ctx.request_cpu.run(
        request, scoring.prepare, ctx, pairs, body.truncate_prompt_tokens, "text_2"
    )

    async def answer() -> dict[str, Any]:
        scores = await score_prompts(ctx, scoring, prompts, "score")
        return score_body(ctx, scores, sum(len(p) for p in prompts))

    return await _respond(request, answer())


@router.post("/v1/rerank")
async def rerank(body: RerankRequest, request: HTTPRequest, ctx: Ctx) -> JSONResponse:
    ctx.check_base_model(body.model, "/v1/rerank")
    scoring = scorer(ctx, body.instruction)
    if not body.documents:
        raise invalid("'documents' must not be empty", "documents")
    pairs = [(body.query, document) for document in body.documents]
    prompts = await ctx.request_cpu.run(
        request, scoring.prepare, ctx, pairs, body.truncate_prompt_tokens, "documents"
    )

    async def answer() -> dict[str, Any]:
        scores = await score_prompts(ctx, scoring, prompts, "rerank")
        return rerank_body(ctx, body, scores, sum(len(p) for p in prompts))

    return await _respond(request, answer())


async def _respond(request: HTTPRequest, work: Awaitable[dict[str, Any]]) -> JSONResponse:
    try:
        payload = await until_disconnect(request, work)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)  # nobody reads it; the requests are aborted
    return JSONResponse(payload)
