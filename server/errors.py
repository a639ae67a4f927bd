"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports -- validation, auth, size limits, a full queue, a dead
engine -- goes through ``APIError`` and ``error_body`` so clients (the official ``openai``
package included) can parse it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineDeadError, RequestRejected

# HTTP status -> OpenAI error type.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client; ``reason`` labels it for the rejection counter."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        reason: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.reason = reason
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> str:
        """The error as one server-sent event, for failures after a stream started."""
        return f"data: {json.dumps(self.body())}\n\n"


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for bad input."""
    return APIError(400, message, param=param, code=code, reason="invalid")


def from_rejection(exc: RequestRejected, retry_after_s: int) -> APIError:
    """Map the engine's admission refusals onto HTTP: a full queue is retryable (503)."""
    if exc.reason == "queue_full":
        return APIError(
            503,
            str(exc),
            code="queue_full",
            reason=exc.reason,
            headers={"Retry-After": str(retry_after_s)},
        )
    return APIError(400, str(exc), code=exc.reason, reason=exc.reason)


def engine_dead(exc: EngineDeadError, *, in_flight: bool) -> APIError:
    """New requests to a dead engine get 503; requests it was running get 500."""
    status = 500 if in_flight else 503
    return APIError(status, str(exc) or "the engine is not running", code="engine_dead")


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """Turn pydantic's error list into one readable message and the first bad field."""
    parts: list[str] = []
    first_param: str | None = None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        field = ".".join(loc)
        if first_param is None and field:
            first_param = field
        message = str(err.get("msg", "invalid value"))
        if err.get("type") == "extra_forbidden":
            message = "is not a supported field"
        parts.append(f"{field}: {message}" if field else message)
    return "; ".join(parts) or "invalid request", first_param


def install_error_handlers(app: FastAPI, count_rejected: Callable[[str], None]) -> None:
    """Make every error FastAPI/Starlette raises come out in OpenAI's shape, counting
    refused requests by reason."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        if exc.reason is not None:
            count_rejected(exc.reason)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(exc.errors())
        count_rejected("invalid")
        return invalid(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(exc).__name__}").response()
