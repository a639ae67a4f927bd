"""Graceful shutdown: uvicorn's drain, finished cleanly.

On SIGTERM uvicorn stops accepting connections, waits up to ``timeout_graceful_shutdown``
(--shutdown-timeout) for in-flight requests, then cancels what is left -- which cuts
those streams mid-chunk. ``DrainingServer`` ends the streams still open shortly before
that moment with an error event and ``[DONE]`` (the routes then abort their requests in
the engine), so clients see a proper end and uvicorn finds nothing left to cancel.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import uvicorn

from engine.async_engine import AsyncEngine

# How long before the drain window closes the remaining streams are ended.
STREAM_END_MARGIN_S = 0.5
SHUTDOWN_MESSAGE = "the server is shutting down; retry the request"


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose drain ends leftover streams instead of cutting them."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncEngine,
        on_drain: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self._engine = engine
        # Called as the drain starts: ends streams that never finish on their own (the
        # block-map page's), so they do not hold the drain for its whole window.
        self._on_drain = on_drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._on_drain is not None:
            self._on_drain()
        window = float(self.config.timeout_graceful_shutdown or 0)
        handle = asyncio.get_running_loop().call_later(
            max(0.0, window - STREAM_END_MARGIN_S),
            self._engine.end_open_streams,
            SHUTDOWN_MESSAGE,
        )
        try:
            await super().shutdown(sockets=sockets)
        finally:
            handle.cancel()
