"""Server-sent events shared by chat and completions: framing, errors, disconnects."""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from server.errors import APIError
from server.routes.generation import ClientDisconnected, GenerationRun, until_disconnect

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_unix() -> int:
    return int(time.time())


def finite(logprob: float) -> float:
    """JSON has no -inf: masked tokens (probability 0) report a very low logprob."""
    return logprob if math.isfinite(logprob) else -9999.0


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def named_sse(kind: str, payload: dict[str, Any]) -> str:
    """A server-sent event with an ``event:`` line (the Responses and Messages streams)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


def stream_response(
    run: GenerationRun,
    events: Callable[[], AsyncIterator[str]],
    *,
    done: str | None = SSE_DONE,
    error_event: Callable[[APIError], str] = APIError.sse_event,
) -> StreamingResponse:
    """Wrap a submitted run's SSE generator. Leaving the generator early (the client
    disconnected: Starlette cancels it) aborts the run; an engine failure after the
    headers went out becomes an error event (``error_event``: in the API's own shape);
    ``done`` ends the stream (None: nothing after the last event)."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events():
                yield event
        except APIError as exc:
            yield error_event(exc)
        except Exception as exc:  # a bug or a fault after the headers: end the stream
            # properly, with an error event, instead of cutting the connection.
            logger.exception("a stream failed after it started")
            error = APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
            yield error_event(error)
        finally:
            run.close()
        if done is not None:
            yield done

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


async def stream_when_started(
    request: HTTPRequest,
    run: GenerationRun,
    events: Callable[[], AsyncIterator[str]],
    *,
    done: str | None = SSE_DONE,
    error_event: Callable[[APIError], str] = APIError.sse_event,
) -> JSONResponse | StreamingResponse:
    """Send the SSE headers only once the engine produced the run's first output, so an
    error before it (a queue timeout, a failed batch, a dead engine) keeps its HTTP
    status instead of becoming an event inside a 200 stream."""
    try:
        await until_disconnect(request, run.wait_for_start())
    except ClientDisconnected:
        run.close()
        return JSONResponse({}, status_code=499)
    except BaseException:
        run.close()
        raise
    return stream_response(run, events, done=done, error_event=error_event)


async def complete_or_abort(
    request: HTTPRequest, run: GenerationRun, collect: Callable[[], Any]
) -> JSONResponse:
    """Non-streaming: collect the whole answer, aborting if the client goes away."""
    try:
        payload = await until_disconnect(request, collect())
    except ClientDisconnected:
        # Nobody reads this; 499 is the de facto "client closed request" status.
        return JSONResponse({}, status_code=499)
    finally:
        run.close()
    return JSONResponse(payload)
