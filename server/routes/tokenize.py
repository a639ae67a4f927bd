"""POST /tokenize and /detokenize (vLLM's shapes)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from server.protocol import DetokenizeRequest, TokenizeRequest
from server.routes.context import Ctx
from server.routes.prompts import check_token_ids, render_chat

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, ctx: Ctx) -> dict[str, Any]:
    ctx.check_model(body.model)
    if body.messages is not None:
        text = render_chat(ctx, body.messages, add_generation_prompt=body.add_generation_prompt)
        tokens = ctx.tokenizer.encode(text, add_special_tokens=False)
    else:
        tokens = ctx.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
    return {"tokens": list(tokens), "count": len(tokens), "max_model_len": ctx.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, ctx: Ctx) -> dict[str, Any]:
    ctx.check_model(body.model)
    check_token_ids(ctx, body.tokens, "tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}
