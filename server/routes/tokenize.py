"""POST /tokenize and /detokenize (vLLM's shapes).

Both answer from a worker thread, the JSON included: a 4 MB prompt is ~870,000 ids, and
rendering, tokenizing or serializing that many on the event loop stalls every other
request. The ids are written a slice at a time so no single call holds the GIL for long
(server/text_tokens.py explains why that matters).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from server.chat_template import ChatTemplateOptions
from server.protocol import DetokenizeRequest, TokenizeRequest
from server.request_body import OffLoopBodyRoute
from server.routes.context import Ctx, ServingContext
from server.routes.prompts import check_token_ids, render_chat
from server.text_tokens import IDS_PER_SLICE, encode_text

router = APIRouter(route_class=OffLoopBodyRoute)


@router.post("/tokenize", response_class=Response)
async def tokenize(body: TokenizeRequest, request: HTTPRequest, ctx: Ctx) -> Response:
    ctx.check_model(body.model)
    payload = await ctx.request_cpu.run(request, _tokenize_json, ctx, body)
    return Response(payload, media_type="application/json")


@router.post("/detokenize", response_class=Response)
async def detokenize(body: DetokenizeRequest, request: HTTPRequest, ctx: Ctx) -> Response:
    ctx.check_model(body.model)
    payload = await ctx.request_cpu.run(request, _detokenize_json, ctx, body)
    return Response(payload, media_type="application/json")


def _tokenize_json(ctx: ServingContext, body: TokenizeRequest) -> bytes:
    """``{"tokens": [...], "count": n, "max_model_len": m}`` as JSON bytes."""
    if body.messages is not None:
        options = ChatTemplateOptions(
            add_generation_prompt=body.add_generation_prompt, tools=tuple(body.tools or ())
        )
        text = render_chat(ctx, body.messages, options=options)
        tokens = encode_text(ctx.tokenizer, text, add_special_tokens=False)
    else:
        tokens = encode_text(
            ctx.tokenizer, body.prompt or "", add_special_tokens=body.add_special_tokens
        )
    return (
        f'{{"tokens":[{_ids_text(tokens)}],"count":{len(tokens)},'
        f'"max_model_len":{ctx.max_model_len}}}'
    ).encode()


def _detokenize_json(ctx: ServingContext, body: DetokenizeRequest) -> bytes:
    check_token_ids(ctx, body.tokens, "tokens")
    return _json_bytes({"prompt": ctx.tokenizer.decode(body.tokens)})


def _ids_text(ids: Sequence[int]) -> str:
    """The ids comma-separated (JSON numbers), one slice per call."""
    return ",".join(
        ",".join(map(str, ids[start : start + IDS_PER_SLICE]))
        for start in range(0, len(ids), IDS_PER_SLICE)
    )


def _json_bytes(payload: dict[str, Any]) -> bytes:
    """What FastAPI's JSONResponse would send."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
