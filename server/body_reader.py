"""Reading a request's whole body before the app sees it, bounded in size and in time.

``BodyReadMiddleware`` buffers the body, then replays it to the app:

- more than ``limit`` bytes, declared (Content-Length) or streamed: ``413``
  (``code: request_too_large``), counted as ``body_too_large``;
- not complete ``timeout_s`` seconds after the headers (a client that declares 100 bytes
  and sends 10, or drips a byte a second): ``408`` (``code: request_timeout``) with
  ``Connection: close``, counted as ``body_timeout``. The bound is on the whole body, not
  between reads, so a slow drip cannot stretch it. 0 turns it off.

Headers are bounded separately, in the HTTP protocol (server/http_server.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError

# Anthropic's Messages routes (server/routes/messages.py) answer in Anthropic's shape.
ANTHROPIC_PREFIX = "/v1/messages"


async def send_error(scope: Scope, send: Send, error: APIError) -> None:
    """Answer ``error`` from middleware, before (or instead of) the app: in Anthropic's
    shape on its Messages routes, OpenAI's elsewhere."""
    if str(scope.get("path", "")).startswith(ANTHROPIC_PREFIX):
        from server.anthropic.errors import AnthropicError

        error = AnthropicError.of(error)
    await error.response()(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class BodyReadMiddleware:
    """Buffers each HTTP request's body; 413 beyond ``limit`` bytes, 408 beyond
    ``timeout_s`` seconds (0: no time bound)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        limit: int,
        timeout_s: float,
        on_reject: Callable[[str], None],
    ) -> None:
        self.app = app
        self._limit = limit
        self._timeout_s = timeout_s
        self._on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _declared_length(scope) > self._limit:
            await self._too_large(scope, send)
            return
        try:
            buffered = await asyncio.wait_for(self._read(receive), self._timeout_s or None)
        except asyncio.TimeoutError:
            await self._too_slow(scope, send)
            return
        if buffered is None:
            await self._too_large(scope, send)
            return

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> list[Message] | None:
        """The body's messages up to the last one (or a disconnect); None past the limit."""
        buffered: list[Message] = []
        total = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                return buffered
            total += len(message.get("body", b""))
            if total > self._limit:
                return None
            if not message.get("more_body", False):
                return buffered

    async def _too_large(self, scope: Scope, send: Send) -> None:
        self._on_reject("body_too_large")
        error = APIError(
            413,
            f"Request body too large: the limit is {self._limit} bytes (--max-request-body-bytes).",
            code="request_too_large",
        )
        await send_error(scope, send, error)

    async def _too_slow(self, scope: Scope, send: Send) -> None:
        self._on_reject("body_timeout")
        error = APIError(
            408,
            f"The request body did not arrive within {self._timeout_s:g} s of the headers "
            "(--request-body-timeout).",
            code="request_timeout",
            headers={"Connection": "close"},
        )
        await send_error(scope, send, error)


def _declared_length(scope: Scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
