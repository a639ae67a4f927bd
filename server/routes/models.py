"""GET /v1/models and /v1/models/{id}: the base model under each served name, then every
loaded LoRA adapter as vLLM lists one (``root`` its directory, ``parent`` the base)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from engine.request import LoRARequest
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


def _adapter_card(ctx: ServingContext, lora: LoRARequest) -> dict[str, Any]:
    # vLLM leaves an adapter's max_model_len null; it is the base's context, so say so.
    return {
        **_model_card(ctx, lora.name),
        "root": lora.path,
        "parent": ctx.model_name,
    }


def _adapters(ctx: ServingContext) -> tuple[LoRARequest, ...]:
    return ctx.lora_catalog.adapters() if ctx.lora_catalog is not None else ()


@router.get("/v1/models")
async def list_models(ctx: Ctx) -> dict[str, Any]:
    cards = [_model_card(ctx, n) for n in ctx.served_model_names]
    cards += [_adapter_card(ctx, lora) for lora in _adapters(ctx)]
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, ctx: Ctx) -> dict[str, Any]:
    ctx.check_model(model_id)
    lora = ctx.lora_for(model_id)
    return _model_card(ctx, model_id) if lora is None else _adapter_card(ctx, lora)
