"""GET /v1/models and /v1/models/{id}."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from server.routes.context import Ctx, ServingContext

router = APIRouter()


def _model_card(ctx: ServingContext, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "kvserve",
        "root": ctx.model_name,
        "parent": None,
        "max_model_len": ctx.max_model_len,
    }


@router.get("/v1/models")
async def list_models(ctx: Ctx) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(ctx, n) for n in ctx.served_model_names]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, ctx: Ctx) -> dict[str, Any]:
    ctx.check_model(model_id)
    return _model_card(ctx, model_id)
