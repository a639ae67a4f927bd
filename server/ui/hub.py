"""One sampler of block maps, shared by every open page.

While at least one page watches, the hub asks the engine thread for a capture
(``AsyncEngine.probe``: a consistent copy taken between two steps), encodes it to JSON on
the event loop and hands the bytes to every watcher. Nobody watching: no sampling at all.

The engine never waits for a page: each watcher has a one-slot mailbox that always holds
the newest snapshot (a slow page skips snapshots, it never queues them), and the sampling
period stretches so that captures take at most ``max_engine_share`` of the engine
thread's time (a 100,000-block pool is sampled less often than a small one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from engine.async_engine import AsyncEngine
from engine.errors import EngineDeadError
from engine.kv.block_map import BlockMapCapture, BlockMapProbe, encode

logger = logging.getLogger(__name__)

DEFAULT_MIN_INTERVAL_S = 0.5  # at most two snapshots a second
DEFAULT_MAX_ENGINE_SHARE = 0.01  # captures take at most 1% of the engine thread


class Watcher:
    """One page's mailbox: the newest snapshot not yet sent, or None for "the end"."""

    def __init__(self) -> None:
        self._box: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=1)

    def offer(self, item: bytes | None) -> None:
        """Replace whatever the page has not read yet."""
        with contextlib.suppress(asyncio.QueueEmpty):
            self._box.get_nowait()
        self._box.put_nowait(item)

    async def next(self) -> bytes | None:
        return await self._box.get()


class BlockMapHub:
    """Samples block maps while pages watch; see the module docstring."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        min_interval_s: float = DEFAULT_MIN_INTERVAL_S,
        max_engine_share: float = DEFAULT_MAX_ENGINE_SHARE,
    ) -> None:
        self._engine = engine
        self._probe = BlockMapProbe()
        self._min_interval_s = min_interval_s
        self._max_engine_share = max_engine_share
        self._watchers: set[Watcher] = set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.snapshots_sent = 0

    @property
    def num_watchers(self) -> int:
        return len(self._watchers)

    @contextlib.asynccontextmanager
    async def watch(self) -> AsyncIterator[Watcher]:
        """Register a page for as long as the context is open."""
        watcher = Watcher()
        if self._closed:
            watcher.offer(None)
        self._watchers.add(watcher)
        self._ensure_sampling()
        try:
            yield watcher
        finally:
            self._watchers.discard(watcher)

    def close(self) -> None:
        """End every open stream (server shutdown): pages reconnect to the next server."""
        self._closed = True
        for watcher in self._watchers:
            watcher.offer(None)

    def _ensure_sampling(self) -> None:
        if self._closed or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._sample_while_watched())

    async def _sample_while_watched(self) -> None:
        while self._watchers and not self._closed:
            try:
                capture = await self._engine.probe(self._capture)
            except EngineDeadError as exc:
                self._broadcast(_event("engine", {"alive": False, "reason": str(exc)}))
                await asyncio.sleep(self._min_interval_s * 4)
                continue
            self._broadcast(_event("snapshot", encode(capture)))
            await asyncio.sleep(self.interval_for(capture.capture_s))

    def _capture(self, core: Any) -> BlockMapCapture:
        """Runs on the engine thread (AsyncEngine.probe)."""
        return self._probe.capture(core.scheduler)

    def interval_for(self, capture_s: float) -> float:
        """Seconds until the next capture: the minimum period, stretched so captures stay
        under ``max_engine_share`` of the engine thread."""
        return max(self._min_interval_s, capture_s / self._max_engine_share)

    def _broadcast(self, data: bytes) -> None:
        if not self._watchers:  # the last page left while the capture ran
            return
        self.snapshots_sent += 1
        for watcher in self._watchers:
            watcher.offer(data)


def _event(name: str, payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload, separators=(",", ":"))
    return f"event: {name}\ndata: {body}\n\n".encode()
