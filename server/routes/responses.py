"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, ``POST
/v1/responses/{id}/cancel``.

A thin front door: the request becomes the chat request the chat route runs
(server/responses/translate.py) through the same generation path (``launch_chat``), and
the choice's output events become Responses items and stream events
(server/responses/job.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from server.errors import APIError
from server.protocol import ChatCompletionRequest
from server.request_body import OffLoopBodyRoute
from server.responses.job import ResponseJob, new_response_id
from server.responses.protocol import ResponsesRequest
from server.responses.state import ResponsesState
from server.responses.translate import chat_request, input_messages
from server.routes.chat import launch_chat
from server.routes.context import Ctx, ServingContext
from server.routes.streaming import complete_or_abort, named_sse, stream_when_started

router = APIRouter(route_class=OffLoopBodyRoute)


@router.post("/v1/responses", response_model=None)
async def create_response(
    body: ResponsesRequest, request: HTTPRequest, ctx: Ctx
) -> JSONResponse | StreamingResponse:
    model = ctx.check_model(body.model)
    lora = ctx.lora_for(body.model)  # before any await: unloaded meanwhile is a 404, not the base
    ctx.check_generates()
    state = responses_state(ctx)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = _stored(state, body.previous_response_id, "previous_response_id").messages
    # Translating and validating the whole conversation grows with the body: off the loop.
    conversation, chat_body = await ctx.request_cpu.run(request, _translate, body, history)
    run, chat = await launch_chat(ctx, request, chat_body, new_response_id(), lora=lora)
    job = ResponseJob(state, run, chat, body, model, conversation)
    if body.background:
        return JSONResponse(job.start_background())
    if body.stream:
        return await stream_when_started(
            request, run, job.stream, done=None, error_event=_error_event
        )
    return await complete_or_abort(request, run, job.collect)


def _translate(
    body: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], ChatCompletionRequest]:
    """The conversation (stored history, then this input) and the chat request it becomes."""
    conversation = [*history, *input_messages(body)]
    return conversation, chat_request(body, conversation, stream=False)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, ctx: Ctx) -> JSONResponse:
    state = responses_state(ctx)
    running = state.running.get(response_id)
    if running is not None:
        return JSONResponse(running.response())
    return JSONResponse(_stored(state, response_id, "response_id").response)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, ctx: Ctx) -> JSONResponse:
    stored = _stored(responses_state(ctx), response_id, "response_id")
    items = [
        {"id": item.get("id") or f"in_{i}", **item} for i, item in enumerate(stored.input_items)
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": items,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
            "has_more": False,
        }
    )


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, ctx: Ctx) -> JSONResponse:
    state = responses_state(ctx)
    running = state.running.get(response_id)
    if running is not None:
        running.delete()  # its end is not stored again
    if not state.store.delete(response_id) and running is None:
        raise _not_found(response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, ctx: Ctx) -> JSONResponse:
    """Abort a response still running (background or streaming); a finished one is
    returned as it is."""
    state = responses_state(ctx)
    running = state.running.get(response_id)
    if running is None:
        return JSONResponse(_stored(state, response_id, "response_id").response)
    running.cancel()
    return JSONResponse({**running.response(), "status": "cancelled"})


def responses_state(ctx: ServingContext) -> ResponsesState:
    state: ResponsesState = ctx.responses
    return state


def _stored(state: ResponsesState, response_id: str, param: str) -> Any:
    stored = state.store.get(response_id)
    if stored is None:
        raise _not_found(response_id, param)
    return stored


def _not_found(response_id: str, param: str) -> APIError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    return APIError(
        404,
        f"{what} with id '{response_id}' not found.",
        param=param,
        code=code,
        reason="response_not_found",
    )


def _error_event(error: APIError) -> str:
    body = error.body()["error"]
    payload = {
        "type": "error",
        "code": body["code"],
        "message": body["message"],
        "param": body["param"],
    }
    return named_sse("error", payload)
