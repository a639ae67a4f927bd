"""Where a request's own CPU work runs: never on the event loop, and large requests one at
a time.

Parsing and validating a body, rendering the chat template, tokenizing, checking token
ids and writing /tokenize's answer all grow with the request. On the event loop a 4 MB
body froze ``/health`` and every running stream for seconds, so all of it runs in worker
threads. Threads still share the GIL and the cores: four 4 MB bodies tokenizing at once
on a 2-core machine kept the loop waiting for a core, or for a GIL some busy thread was
slow to hand over, for up to ~300 ms at a time (probe latencies, docs/reference/reliability.md).
So requests with bodies over ``LARGE_BODY_BYTES`` share one dedicated thread and run one
after another, while ordinary requests use the loop's default pool and never queue
behind them. Large bodies pay with throughput; the loop, the engine and small requests
keep theirs.

The event loop takes the GIL back after every select and every send, several times per
request, and CPython lets a thread running Python keep it for the switch interval (5 ms)
before handing it over; with request threads busy in Python (JSON hooks, the value
check) those waits added up to most of a ``/health`` answer. The engine thread pays the
same toll more often: each torch op of a step lets go of the GIL and waits a whole
interval to get it back from a busy request thread, so a ~60-op step of the torch
kernels stretched from ~1 ms to 60-150 ms under four 4 MB bodies at 1 ms (stream gaps,
docs/reference/reliability.md). ``kvserve serve`` sets the interval to ``GIL_SWITCH_INTERVAL_S``
(``favour_the_event_loop``): 0.2 ms keeps such a step within ~30 ms for the price of a
few thousand more thread switches a second while threads contend.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")

# Bodies above this (~64k tokens of text) take the one-at-a-time lane.
LARGE_BODY_BYTES = 256 * 1024
# Where the body's size is noted for the later stages of the same request.
BODY_BYTES_SCOPE_KEY = "kvserve.body_bytes"
GIL_SWITCH_INTERVAL_S = 0.0002


def favour_the_event_loop() -> None:
    """Shorten the interpreter's GIL switch interval, and freeze what start-up made out of
    the garbage collector's reach (process-wide: the server's own process only, set by
    ``kvserve serve`` once the engine is built).

    A full collection walks every tracked object while holding the GIL: with torch,
    transformers and the model's objects (~240,000) that took ~150 ms, a stall of the
    event loop whenever a large request's allocations set one off. Frozen, start-up's
    objects are never walked again (they live as long as the server anyway): ~20-40 ms.
    """
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    gc.collect()
    gc.freeze()


class RequestCpu:
    """The two lanes; ``run`` picks one by the request's body size."""

    def __init__(self, large_body_bytes: int = LARGE_BODY_BYTES) -> None:
        self.large_body_bytes = large_body_bytes
        self._large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-large-body")

    async def run(self, request: Request, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` in a worker thread of the request's lane."""
        return await self.run_for_size(body_bytes(request), work, *args)

    async def run_for_size(self, size: int, work: Callable[..., T], *args: Any) -> T:
        executor = self._large if size > self.large_body_bytes else None  # None: default pool
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, functools.partial(work, *args))

    def shutdown(self) -> None:
        self._large.shutdown(wait=False, cancel_futures=True)


def note_body_bytes(request: Request, size: int) -> None:
    request.scope[BODY_BYTES_SCOPE_KEY] = size


def body_bytes(request: Request) -> int:
    """The body's size as read (0 before it was, or for a request without one)."""
    size: int = request.scope.get(BODY_BYTES_SCOPE_KEY, 0)
    return size
