"""Anthropic's error envelope: ``{"type": "error", "error": {"type", "message"}}``.

Every error of the Messages routes -- validation, the chat path's 400s, a full queue, a
dead engine -- leaves in this shape (``AnthropicError``, raised by ``MessagesRoute``),
with Anthropic's error types for the status.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.errors import APIError, describe_validation_errors
from server.request_body import OffLoopBodyRoute

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicError(APIError):
    """An ``APIError`` answered in Anthropic's shape."""

    @classmethod
    def of(cls, error: APIError) -> AnthropicError:
        if isinstance(error, AnthropicError):
            return error
        return cls(
            error.status,
            error.message,
            param=error.param,
            code=error.code,
            reason=error.reason,
            headers=error.headers,
        )

    def body(self) -> dict[str, Any]:
        return anthropic_body(self.status, self.message)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> str:
        return f"event: error\ndata: {json.dumps(self.body())}\n\n"


Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class MessagesRoute(OffLoopBodyRoute):
    """The Messages routes' class: bodies off the event loop, every error Anthropic's."""

    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()

        async def anthropic_errors(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                message, param = describe_validation_errors(exc.errors())
                raise AnthropicError(400, message, param=param, reason="invalid") from None
            except APIError as exc:
                raise AnthropicError.of(exc) from None

        return anthropic_errors
