"""AsyncEngine: drives a single-threaded EngineCore from a background thread.

The asyncio event loop never runs a model forward. All calls into the core happen on
one engine thread (a ``ComputeThread``: pass the one that built the engine, so that all
torch work shares one OpenMP pool; see engine/compute_thread.py): the event loop only
appends adds and aborts to a locked inbox, which the thread drains at the start of
every step, so an abort frees the request's blocks within one step. Deltas go back to
the loop in one ``call_soon_threadsafe`` per step and are fanned out to one
``asyncio.Queue`` per client request (group). When there is no work the thread sleeps
on a condition variable instead of spinning.

If a step raises, the engine is dead: every open stream receives an ``EngineDeadError``,
new requests are refused with it, and ``is_alive`` turns false for ``/health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from engine.compute_thread import ComputeThread
from engine.errors import EngineDeadError
from engine.outputs import EngineStats, RequestDelta
from engine.request import Request

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CoreLike(Protocol):
    """What AsyncEngine needs from engine.core.EngineCore."""

    def add_request(self, requests: list[Request]) -> None: ...
    def abort(self, group_id: str) -> None: ...
    def abort_sequence(self, request_id: str) -> None: ...
    def step(self) -> list[RequestDelta]: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> EngineStats: ...


@dataclass
class _AddCommand:
    requests: list[Request]
    admitted: asyncio.Future[None]


@dataclass
class _ProbeCommand:
    fn: Callable[[Any], Any]
    result: asyncio.Future[Any]


@dataclass
class _Inbox:
    """Work handed from the event loop to the engine thread, guarded by ``cond``."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    adds: list[_AddCommand] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    probes: list[_ProbeCommand] = field(default_factory=list)
    sequence_aborts: list[str] = field(default_factory=list)  # request ids
    stopping: bool = False

    def has_work(self) -> bool:
        return bool(self.adds or self.aborts or self.sequence_aborts or self.probes)


class GroupStream:
    """The deltas of one client request (all ``n`` choices), in engine order.

    Iterate it for deltas; it ends once every choice has finished. ``close()`` aborts the
    choices still running (a client disconnect, a stop string, shutdown).
    """

    def __init__(self, engine: AsyncEngine, group_id: str, num_choices: int) -> None:
        self._engine = engine
        self.group_id = group_id
        self._queue: asyncio.Queue[list[RequestDelta] | BaseException] = asyncio.Queue()
        self._unfinished = set(range(num_choices))  # choice indices still expected to end
        self._closed = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def end_choice(self, index: int, request_id: str) -> None:
        """The server ended choice ``index`` (a stop string): abort its sequence in the
        engine now, without waiting for its siblings; its later deltas are dropped."""
        if index not in self._unfinished or self._closed:
            return
        self._unfinished.discard(index)
        self._engine._abort_sequence(request_id)

    def _deliver(self, item: list[RequestDelta] | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestDelta]:
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            for delta in item:
                if delta.index not in self._unfinished:
                    continue  # a choice ended by end_choice(): its in-flight deltas are moot
                if delta.finished:
                    self._unfinished.discard(delta.index)
                yield delta
        self.close()

    def close(self) -> None:
        """Stop listening; abort the group in the engine unless it already finished."""
        if self._closed:
            return
        self._closed = True
        self._engine._release(self.group_id, abort=bool(self._unfinished))


class AsyncEngine:
    """Owns the engine thread. Create it, ``await start()`` inside the event loop, then
    ``add()`` requests and iterate the returned streams; ``shutdown()`` at the end."""

    def __init__(
        self,
        core: CoreLike,
        *,
        thread_name: str = "kvserve-engine",
        queue_timeout_s: float = 0.0,
        compute: ComputeThread | None = None,
    ) -> None:
        self.core = core
        # > 0: requests never scheduled within this many seconds are failed by the core
        # (EngineCore.expire_queued) with error_code "queue_timeout".
        self.queue_timeout_s = queue_timeout_s
        self._thread_name = thread_name
        self._inbox = _Inbox()
        self._streams: dict[str, GroupStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._compute = compute
        self._running: Future[None] | None = None  # the step loop on the compute thread
        self._dead_error: EngineDeadError | None = None

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start the engine thread, bound to the running event loop."""
        if self._running is not None:
            return
        self._loop = asyncio.get_running_loop()
        owned = self._compute is None
        if self._compute is None:
            self._compute = ComputeThread(self._thread_name)
        self._running = self._compute.submit(self._run)
        if owned:
            self._compute.close()  # the thread ends with the step loop

    def request_shutdown(self) -> None:
        """Abort every open stream and tell the thread to stop; returns at once.

        Call it on the event loop's thread: it reads the loop-owned stream table.
        """
        with self._inbox.cond:
            self._inbox.aborts.extend(tuple(self._streams))
            self._inbox.stopping = True
            self._inbox.cond.notify()

    def end_open_streams(self, reason: str) -> None:
        """End every open stream now with ``EngineDeadError(reason)``: the last step of a
        drain that ran out of time, so clients get an error event and a proper end
        instead of a cut connection (the routes then abort the requests). Call it on the
        event loop's thread."""
        self._fail_all(EngineDeadError(reason))

    def join(self, timeout_s: float = 10.0) -> None:
        """Wait (bounded) for the engine thread to finish its last step and exit."""
        if self._running is not None:
            with contextlib.suppress(TimeoutError):
                self._running.exception(timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """``request_shutdown()`` then ``join()``: for callers on the loop's thread or
        after the loop stopped."""
        self.request_shutdown()
        self.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs and no step has failed."""
        return (
            self._dead_error is None
            and self._running is not None
            and not self._running.done()
            and not self._inbox.stopping
        )

    @property
    def dead_reason(self) -> str | None:
        return None if self._dead_error is None else str(self._dead_error)

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        """The core's latest immutable snapshot (safe from any thread)."""
        return self.core.stats()

    # ----------------------------------------------------------------- requests
    async def add(self, requests: list[Request]) -> GroupStream:
        """Submit one client request's choices; returns once the engine admitted them.

        Raises ``RequestRejected`` (from the core) or ``EngineDeadError``.
        """
        if not requests:
            raise ValueError("add() needs at least one request")
        if not self.is_alive or self._loop is None:
            raise self._dead_error or EngineDeadError("the engine is not running")
        group_id = requests[0].group_id
        if group_id in self._streams:
            raise ValueError(f"duplicate group id {group_id!r}")
        stream = GroupStream(self, group_id, len(requests))
        admitted: asyncio.Future[None] = self._loop.create_future()
        with self._inbox.cond:
            # Checked under the lock the dying thread takes to fail pending adds, so an
            # add can never slip in after that and wait forever.
            if self._dead_error is not None or self._inbox.stopping:
                raise self._dead_error or EngineDeadError("the engine is shutting down")
            self._streams[group_id] = stream
            self._inbox.adds.append(_AddCommand(requests, admitted))
            self._inbox.cond.notify()
        try:
            await admitted
        except BaseException:
            # Rejected, or the caller was cancelled while waiting: make sure nothing of
            # the group stays in the engine.
            self._release(group_id, abort=not admitted.done() or admitted.cancelled())
            raise
        return stream

    async def generate(self, requests: list[Request]) -> AsyncIterator[RequestDelta]:
        """Submit and iterate in one go; leaving the loop early aborts the request."""
        stream = await self.add(requests)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def probe(self, fn: Callable[[Any], T]) -> asyncio.Future[T]:
        """Run ``fn(core)`` on the engine thread between two steps; its result (or
        exception) arrives through the returned future. For observers that need a
        consistent read of scheduler state (the block-map page): ``fn`` must not mutate
        anything and must be quick, since the next step waits for it. Call it on the
        event loop's thread. Raises ``EngineDeadError`` when the engine is not running."""
        if self._loop is None:
            raise EngineDeadError("the engine is not running")
        result: asyncio.Future[T] = self._loop.create_future()
        with self._inbox.cond:
            if self._dead_error is not None or self._inbox.stopping:
                raise self._dead_error or EngineDeadError("the engine is shutting down")
            self._inbox.probes.append(_ProbeCommand(fn, result))
            self._inbox.cond.notify()
        return result

    def abort(self, group_id: str) -> None:
        """Abort a group (thread-safe); its blocks are freed at the next step."""
        self._release(group_id, abort=True)

    def _abort_sequence(self, request_id: str) -> None:
        with self._inbox.cond:
            self._inbox.sequence_aborts.append(request_id)
            self._inbox.cond.notify()

    def _release(self, group_id: str, *, abort: bool) -> None:
        self._streams.pop(group_id, None)
        if abort:
            with self._inbox.cond:
                self._inbox.aborts.append(group_id)
                self._inbox.cond.notify()

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while self._wait_for_work():
                self._drain_inbox()
                self._expire_queued()
                if self.core.has_unfinished():
                    deltas = self.core.step()
                    if deltas:
                        self._post(self._dispatch, deltas)
            close = getattr(self.core, "close", None)
            if close is not None:
                close()  # e.g. persist the prefix cache's disk tier
        except Exception as exc:  # a failed step kills the engine; tell everyone why
            logger.exception("engine step failed; the engine is now dead")
            self._dead_error = EngineDeadError(f"engine failed: {type(exc).__name__}: {exc}")
            with self._inbox.cond:
                adds, self._inbox.adds = self._inbox.adds, []
                probes, self._inbox.probes = self._inbox.probes, []
            for command in adds:
                self._post(_fail_future, command.admitted, self._dead_error)
            for probe in probes:
                self._post(_fail_future, probe.result, self._dead_error)
            self._post(self._fail_all, self._dead_error)

    def _expire_queued(self) -> None:
        if self.queue_timeout_s > 0:
            expire = getattr(self.core, "expire_queued", None)
            expired = expire(self.queue_timeout_s) if expire is not None else []
            if expired:
                self._post(self._dispatch, expired)

    def _wait_for_work(self) -> bool:
        """Block until there is something to do; False once shutdown is requested."""
        with self._inbox.cond:
            while not (self._inbox.stopping or self._inbox.has_work()):
                if self.core.has_unfinished():
                    return True
                self._inbox.cond.wait()
            if self._inbox.stopping:
                self._drain_locked_aborts()
                return False
            return True

    def _drain_locked_aborts(self) -> None:
        aborts, self._inbox.aborts = self._inbox.aborts, []
        adds, self._inbox.adds = self._inbox.adds, []
        probes, self._inbox.probes = self._inbox.probes, []
        for group_id in aborts:
            self.core.abort(group_id)
        for command in adds:
            self._post(_fail_future, command.admitted, EngineDeadError("the engine shut down"))
        for probe in probes:
            self._post(_fail_future, probe.result, EngineDeadError("the engine shut down"))

    def _drain_inbox(self) -> None:
        with self._inbox.cond:
            adds, self._inbox.adds = self._inbox.adds, []
            aborts, self._inbox.aborts = self._inbox.aborts, []
            probes, self._inbox.probes = self._inbox.probes, []
            sequence_aborts, self._inbox.sequence_aborts = self._inbox.sequence_aborts, []
        # Adds before aborts: a request cancelled while still queued here is admitted and
        # dropped in the same drain, before any step schedules it.
        for command in adds:
            try:
                self.core.add_request(command.requests)
            except Exception as exc:  # RequestRejected or a bug: the caller sees it
                self._post(_fail_future, command.admitted, exc)
            else:
                self._post(_resolve_future, command.admitted)
        for group_id in aborts:
            self.core.abort(group_id)
        for request_id in sequence_aborts:
            self.core.abort_sequence(request_id)
        for probe in probes:  # after the adds and aborts: they see this step's queues
            self._run_probe(probe)

    def _run_probe(self, probe: _ProbeCommand) -> None:
        try:
            value = probe.fn(self.core)
        except Exception as exc:  # an observer's bug is the observer's, not the engine's
            self._post(_fail_future, probe.result, exc)
        else:
            self._post(_resolve_value, probe.result, value)

    def _post(self, callback: Callable[..., None], *args: object) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # The loop may close between the check and the call (shutdown): nothing to tell.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(callback, *args)

    # ----------------------------------------------------------------- event-loop side
    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        by_group: dict[str, list[RequestDelta]] = {}
        for delta in deltas:
            by_group.setdefault(delta.group_id, []).append(delta)
        for group_id, group_deltas in by_group.items():
            stream = self._streams.get(group_id)
            if stream is not None:
                stream._deliver(group_deltas)

    def _fail_all(self, error: EngineDeadError) -> None:
        for stream in list(self._streams.values()):
            stream._deliver(error)


def _resolve_future(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _resolve_value(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail_future(future: asyncio.Future[None], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
