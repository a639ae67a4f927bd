"""uvicorn as kvserve runs it: its configuration, and an HTTP protocol that bounds the time
a client may take to send its request headers.

uvicorn bounds the idle time between two requests of a kept-alive connection
(``timeout_keep_alive``, 5 s) and, for h11, the size of an incomplete event; it does not
bound time before the headers are complete. A connection that opens and sends nothing,
or sends its headers a byte a second, is held forever.

``HeaderTimeoutProtocol`` is uvicorn's httptools protocol (its default whenever httptools
is installed, as ``uvicorn[standard]`` makes it) with one timer:

- armed when a connection opens, and when the first byte of a later request on a
  kept-alive connection arrives; stopped when the request's headers are complete;
- on expiry, a connection that sent part of a request gets a ``408`` in OpenAI's error
  shape (``code: request_timeout``) and is closed; one that sent nothing is closed
  silently (a response nobody asked for could be read as the answer to a request that
  crosses it); either is counted as ``header_timeout``.

Not covered: the h11 protocol (uvicorn's fallback without httptools: the timeout is then
off, with a warning), TLS handshakes (kvserve serves plain HTTP; TLS ends in front of it)
and WebSockets (kvserve has none). The body is bounded by server/body_reader.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable
from typing import Any

from server.errors import error_body
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

_HttpToolsProtocol: type[asyncio.Protocol] | None
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HttpToolsProtocol
except ImportError:  # httptools missing: uvicorn falls back to h11
    _HttpToolsProtocol = None
_Base: Any = _HttpToolsProtocol or asyncio.Protocol


def uvicorn_config(
    app: Any,
    settings: ServerSettings,
    on_reject: Callable[[str], None],
    **overrides: Any,
) -> Any:
    """The ``uvicorn.Config`` of ``app`` under ``settings`` (``overrides`` win)."""
    import uvicorn

    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "timeout_graceful_shutdown": math.ceil(settings.shutdown_timeout_s),
        "http": http_protocol(settings.request_header_timeout_s, on_reject),
    }
    options.update(overrides)
    return uvicorn.Config(app, **options)


def http_protocol(header_timeout_s: float, on_reject: Callable[[str], None]) -> Any:
    """The protocol class (or uvicorn's name for one) that bounds header reads."""
    if not header_timeout_s:
        return "auto"
    if _HttpToolsProtocol is None:
        logger.warning("httptools is not installed: --request-header-timeout is not enforced")
        return "auto"
    return type(
        "HeaderTimeoutProtocol",
        (HeaderTimeoutProtocol,),
        {"header_timeout_s": header_timeout_s, "on_reject": staticmethod(on_reject)},
    )


class HeaderTimeoutProtocol(_Base):
    """See the module docstring; ``http_protocol`` sets the two class attributes."""

    header_timeout_s: float = 0.0
    on_reject: Callable[[str], None] = staticmethod(lambda reason: None)

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._header_timer: asyncio.TimerHandle | None = None
        self._request_begun = False
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._request_begun = True
        if self._header_timer is None:  # a later request on a kept-alive connection
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._stop_header_timer()
        self._request_begun = False
        super().on_headers_complete()

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        self.on_reject("header_timeout")
        if self._request_begun:
            self.transport.write(self._timeout_response())
        self.transport.close()

    def _timeout_response(self) -> bytes:
        message = (
            f"The request headers did not arrive within {self.header_timeout_s:g} s "
            "(--request-header-timeout)."
        )
        body = json.dumps(error_body(408, message, code="request_timeout")).encode()
        head = (
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        return head.encode() + body
