"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A thin front door: the request becomes the chat request the chat route runs
(server/anthropic/translate.py) through the same generation path (``launch_chat``), the
choice's output events become content blocks and Anthropic's stream events
(server/anthropic/output.py), and every error leaves in Anthropic's envelope
(server/anthropic/errors.py). ``x-api-key`` is accepted as the API key (server/app.py).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from server.anthropic.errors import AnthropicError, MessagesRoute
from server.anthropic.output import MessageJob, new_message_id
from server.anthropic.protocol import CountTokensRequest, MessagesRequest
from server.anthropic.translate import chat_request
from server.errors import APIError
from server.routes.chat import launch_chat, prepare_chat
from server.routes.context import Ctx, ServingContext
from server.routes.streaming import complete_or_abort, stream_when_started
from server.tools.output import choice_output

router = APIRouter(route_class=MessagesRoute)


@router.post("/v1/messages", response_model=None)
async def create_message(
    body: MessagesRequest, request: HTTPRequest, ctx: Ctx
) -> JSONResponse | StreamingResponse:
    model = ctx.check_model(body.model)
    lora = ctx.lora_for(body.model)  # before any await: unloaded meanwhile is a 404, not the base
    ctx.check_generates()
    # Translating and validating the whole conversation grows with the body: off the loop.
    chat_body = await ctx.request_cpu.run(request, chat_request, body)
    run, chat = await launch_chat(
        ctx, request, chat_body, new_message_id(), up_to_context=True, lora=lora
    )
    window_bound = chat.params.max_tokens < body.max_tokens
    job = MessageJob(run, choice_output(chat.plan, chat.reasoning), model, window_bound)
    if body.stream:
        return await stream_when_started(
            request, run, job.stream, done=None, error_event=_error_event
        )
    return await complete_or_abort(request, run, job.collect)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: HTTPRequest, ctx: Ctx) -> JSONResponse:
    ctx.check_model(body.model)
    count = await ctx.request_cpu.run(request, _count, ctx, body)
    return JSONResponse({"input_tokens": count})


def _count(ctx: ServingContext, body: CountTokensRequest) -> int:
    """The prompt a Messages request with this body would run (its tools included)."""
    chat = chat_request(body)
    chat = chat.model_copy(update={"max_tokens": None})
    return len(prepare_chat(ctx, chat).prompt_ids)


def _error_event(error: APIError) -> str:
    return AnthropicError.of(error).sse_event()
