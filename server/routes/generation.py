"""One client request's generation: its engine groups, per-choice text and metrics.

A client request with P prompts and ``n`` choices becomes P engine groups of ``n``
Requests (the scheduler forks a group's choices from one prefill). ``GenerationRun``
submits them, merges their delta streams, turns each choice's tokens into final text
(incremental detokenisation, stop strings) and yields ``ChoiceUpdate``s that the chat and
completions routes format. Closing the run aborts whatever still runs in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request as HTTPRequest

from engine.async_engine import GroupStream
from engine.errors import EngineDeadError, RequestRejected
from engine.outputs import RequestDelta, TokenLogprob
from engine.request import LoRARequest, Request, SamplingParams
from server.choice_output import LogprobGate, OutputOptions
from server.detokenize import IncrementalDetokenizer, StopStringMatcher
from server.errors import APIError, engine_dead, from_rejection, invalid
from server.routes.context import ServingContext

T = TypeVar("T")


class _Closed(Exception):
    """Put in a run's event queue by ``close``: wakes an iteration waiting for events
    that will not come (the run was aborted from elsewhere: ``/cancel``)."""


@dataclass
class ChoiceUpdate:
    """New output of one choice: final text, the logprobs of its new tokens, and the
    finish reason once it ended."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    # Set when the choice was ended by the server (a stop string) rather than the engine.
    stopped_by_string: bool = False
    stop_string: str | None = None  # which one (Anthropic's stop_sequence)


class ChoiceTracker:
    """Text, token count and latency bookkeeping for one choice."""

    def __init__(
        self,
        ctx: ServingContext,
        index: int,
        stop: Sequence[str],
        start: float,
        prompt_ids: Sequence[int] = (),
        options: OutputOptions | None = None,
    ) -> None:
        self.index = index
        self.options = options = options or OutputOptions()
        self._detok = IncrementalDetokenizer(
            ctx.tokenizer,
            prompt_ids=prompt_ids,
            skip_special_tokens=options.skip_special_tokens,
            spaces_between_special_tokens=options.spaces_between_special_tokens,
        )
        self._stops = StopStringMatcher(stop, include_stop=options.include_stop_str_in_output)
        self._logprobs = LogprobGate()
        self._decoded_chars = 0  # detokenized text so far (before stop strings)
        self._emitted_chars = 0  # text released to the client
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.start = start
        self.token_times: list[float] = []
        self.queue_time: float | None = None
        self.num_blocks = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def on_delta(self, delta: RequestDelta, now: float) -> ChoiceUpdate:
        """Consume one engine delta; after the choice finished, deltas are ignored."""
        if self.finished:
            return ChoiceUpdate(self.index, "")
        if delta.new_token_ids:
            self.token_times.append(now)
        self.num_tokens += len(delta.new_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        ids, logprobs = self._visible(delta)
        start = self._decoded_chars
        text = self._detok.push(ids)
        if delta.finished:
            text += self._detok.flush()
        self._decoded_chars += len(text)
        self._logprobs.add(start, logprobs)
        match = self._stops.feed(text)
        text = match.text
        if match.stopped:
            self.finish_reason = "stop"
        elif delta.finished:
            text += self._stops.flush()
            self.finish_reason = delta.finish_reason.value if delta.finish_reason else "stop"
            self.queue_time = delta.queue_time
            self.num_blocks = delta.num_blocks
        self._emitted_chars += len(text)
        if match.stopped:
            released = self._logprobs.release(self._emitted_chars)
            self._logprobs.drop_rest()  # tokens of the cut stop string
        elif delta.finished:
            released = self._logprobs.release_all()
        else:
            released = self._logprobs.release(self._emitted_chars)
        return ChoiceUpdate(
            self.index, text, released, self.finish_reason, match.stopped, match.stop
        )

    def _visible(self, delta: RequestDelta) -> tuple[list[int], list[TokenLogprob]]:
        """The delta's tokens (and logprobs) that belong to the text: as in vLLM, the
        EOS or stop token that ended the sequence is left out unless
        include_stop_str_in_output."""
        ids = list(delta.new_token_ids)
        logprobs = list(delta.logprobs or ())
        if delta.ended_on_stop_token and ids and not self.options.include_stop_str_in_output:
            ids.pop()
            logprobs = logprobs[: len(ids)]
        return ids, logprobs

    def abandon(self, reason: str) -> None:
        """The choice ends without the engine finishing it (disconnect, engine failure)."""
        if not self.finished:
            self.finish_reason = reason

    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    def itl(self) -> tuple[float, ...]:
        times = self.token_times
        return tuple(b - a for a, b in itertools.pairwise(times))


@dataclass
class _Group:
    prompt_ids: list[int]
    choices: list[ChoiceTracker]
    stream: GroupStream | None = None
    pump: asyncio.Task[None] | None = None
    # Prompt tokens 1.. with their logprobs, once the engine sent them (prompt_logprobs).
    prompt_logprobs: list[TokenLogprob] | None = None


class GenerationRun:
    """Submit, iterate, close. Use as ``async with run: async for update in run: ...``.

    ``lora`` is the adapter every Request of the run carries (None: the base model); the
    run holds it in ``ctx.lora_use`` from submission until it ends, so it is not
    unloaded under it.
    """

    def __init__(
        self,
        ctx: ServingContext,
        request_id: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        stop: Sequence[str] = (),
        priority: int = 0,
        cache_salt: str | None = None,
        options: OutputOptions | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        if priority and ctx.scheduling_policy != "priority":
            raise invalid(
                f"'priority' must be 0 under --scheduling-policy {ctx.scheduling_policy} "
                "(the server was not started with --scheduling-policy priority)",
                param="priority",
            )
        self.ctx = ctx
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora = lora
        self._held_sequences = 0  # this run's sequences counted in ctx.lora_use
        self.start = time.monotonic()
        self._events: asyncio.Queue[tuple[int, list[RequestDelta]] | BaseException] = (
            asyncio.Queue()
        )
        self._closed = False
        n = params.n
        self.groups = [
            _Group(
                list(ids),
                [ChoiceTracker(ctx, p * n + i, stop, self.start, ids, options) for i in range(n)],
            )
            for p, ids in enumerate(prompts)
        ]
        self._recorded = False
        # The first event, when wait_for_start() took it before iteration began.
        self._first: tuple[int, list[RequestDelta]] | BaseException | None = None

    # ------------------------------------------------------------------ submission
    async def submit(self) -> None:
        """Add every group to the engine; on any refusal abort the ones already added."""
        try:
            self._hold_adapter()
            for p, group in enumerate(self.groups):
                group_id = self.request_id if len(self.groups) == 1 else f"{self.request_id}-{p}"
                group.stream = await self.ctx.engine.add(self._requests(group_id, group))
                group.pump = asyncio.create_task(self._pump(p, group.stream))
        except RequestRejected as exc:
            self.close()
            raise from_rejection(exc, self.ctx.settings.retry_after_s) from exc
        except EngineDeadError as exc:
            self.close()
            raise engine_dead(exc, in_flight=False) from exc
        except BaseException:
            self.close()
            raise

    def _requests(self, group_id: str, group: _Group) -> list[Request]:
        return [
            Request(
                request_id=f"{group_id}-{i}",
                prompt_token_ids=list(group.prompt_ids),
                sampling_params=self.params,
                eos_token_ids=self.ctx.eos_token_ids,
                group_id=group_id,
                index=i,
                priority=self.priority,
                cache_salt=self.cache_salt,
                lora=self.lora,
            )
            for i in range(len(group.choices))
        ]

    def _hold_adapter(self) -> None:
        """Count the run's sequences as users of its adapter, or 404 when the adapter was
        unloaded since the route resolved it (the request was being prepared). Called
        right before the first add, with no await between: an unload either saw the
        count or ran before this check."""
        lora = self.lora
        if lora is None:
            return
        catalog = self.ctx.lora_catalog
        current = catalog.get(lora.name) if catalog is not None else None
        if current is None or current.id != lora.id:
            raise self.ctx.model_not_found(lora.name)
        self._held_sequences = sum(len(g.choices) for g in self.groups)
        self.ctx.lora_use.acquire(lora.id, self._held_sequences)

    def _release_adapter(self) -> None:
        if self.lora is not None and self._held_sequences:
            self.ctx.lora_use.release(self.lora.id, self._held_sequences)
            self._held_sequences = 0

    async def _pump(self, p: int, stream: GroupStream) -> None:
        try:
            async for delta in stream:
                self._events.put_nowait((p, [delta]))
        except EngineDeadError as exc:
            self._events.put_nowait(exc)

    # ------------------------------------------------------------------ iteration
    async def __aenter__(self) -> GenerationRun:
        await self.submit()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __aiter__(self) -> AsyncIterator[ChoiceUpdate]:
        return self._updates()

    async def wait_for_start(self) -> None:
        """Wait for the engine's first output, and raise its error if that is one: a
        stream's HTTP status then tells a queue timeout (503) or a failure (500) from a
        start. The event is kept for the iteration."""
        if self._first is None and not self.all_finished:
            self._first = await self._events.get()
        item = self._first
        if isinstance(item, EngineDeadError):
            raise engine_dead(item, in_flight=True)
        if isinstance(item, tuple):
            failed = next((d for d in item[1] if d.error), None)
            if failed is not None:
                raise self._delta_error(failed)

    async def _next_event(self) -> tuple[int, list[RequestDelta]] | BaseException:
        if self._first is not None:
            item, self._first = self._first, None
            return item
        return await self._events.get()

    def _delta_error(self, delta: RequestDelta) -> APIError:
        if delta.error_code == "queue_timeout":
            return APIError(
                503,
                f"the request was not scheduled in time: {delta.error}",
                code="queue_timeout",
                reason="queue_timeout",
                headers={"Retry-After": str(self.ctx.settings.retry_after_s)},
            )
        return APIError(500, f"the engine failed this request: {delta.error}", code="engine_fault")

    async def _updates(self) -> AsyncIterator[ChoiceUpdate]:
        while not self.all_finished:
            item = await self._next_event()
            if isinstance(item, _Closed):
                break
            if isinstance(item, EngineDeadError):
                self._abandon_all("error")
                raise engine_dead(item, in_flight=True)
            if isinstance(item, BaseException):
                raise item
            p, deltas = item
            group = self.groups[p]
            now = time.monotonic()
            for delta in deltas:
                if delta.error:
                    # Checked first: a failed choice reports the error, not a finish.
                    self._abandon_all("error")
                    raise self._delta_error(delta)
                if delta.prompt_logprobs is not None and group.prompt_logprobs is None:
                    group.prompt_logprobs = delta.prompt_logprobs
                if 0 <= delta.index < len(group.choices):
                    update = group.choices[delta.index].on_delta(delta, now)
                    if update.stopped_by_string and group.stream is not None:
                        # Free this choice's blocks now; its siblings go on decoding.
                        group.stream.end_choice(delta.index, delta.request_id)
                    if update.text or update.logprobs or update.finish_reason:
                        yield update
            if all(c.finished for c in group.choices):
                # Every choice ended (some perhaps by a stop string the engine does not
                # know about): stop the group in the engine now.
                self._close_group(group)
        self._release_adapter()
        self._record_all()

    def prompt_logprobs(self, index: int) -> list[TokenLogprob] | None:
        """The prompt logprobs of choice ``index``'s prompt, once known."""
        return self.groups[index // self.params.n].prompt_logprobs

    def prompt_ids(self, index: int) -> list[int]:
        return self.groups[index // self.params.n].prompt_ids

    @property
    def all_finished(self) -> bool:
        return all(c.finished for g in self.groups for c in g.choices)

    @property
    def choices(self) -> list[ChoiceTracker]:
        return [c for g in self.groups for c in g.choices]

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Abort what still runs (client gone, error, shutdown, ``/cancel``) and record
        metrics; an iteration still waiting ends."""
        self._abandon_all("abort")
        for group in self.groups:
            self._close_group(group)
        self._release_adapter()
        self._record_all()
        if not self._closed:
            self._closed = True
            self._events.put_nowait(_Closed())

    def _close_group(self, group: _Group) -> None:
        if group.pump is not None and not group.pump.done():
            group.pump.cancel()
        if group.stream is not None:
            group.stream.close()

    def _abandon_all(self, reason: str) -> None:
        for choice in self.choices:
            choice.abandon(reason)

    def _record_all(self) -> None:
        if self._recorded or self.ctx.metrics is None:
            return
        self._recorded = True
        from server.metrics import RequestRecord

        end = time.monotonic()
        for group in self.groups:
            for choice in group.choices:
                self.ctx.record(
                    RequestRecord(
                        finish_reason=choice.finish_reason or "abort",
                        prompt_tokens=len(group.prompt_ids),
                        generation_tokens=choice.num_tokens,
                        cached_tokens=choice.num_cached_tokens,
                        queue_time_s=choice.queue_time,
                        ttft_s=choice.ttft(),
                        e2e_s=end - self.start,
                        itl_s=choice.itl(),
                        kv_blocks=choice.num_blocks,
                        lora_name=self.lora.name if self.lora is not None else None,
                    )
                )

    # ------------------------------------------------------------------ usage
    def usage(self) -> dict[str, Any]:
        """OpenAI usage: prompts count once per prompt, completions per choice."""
        prompt_tokens = sum(len(g.prompt_ids) for g in self.groups)
        completion_tokens = sum(c.num_tokens for c in self.choices)
        cached = sum(max((c.num_cached_tokens for c in g.choices), default=0) for g in self.groups)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


async def until_disconnect(request: HTTPRequest, work: Awaitable[T]) -> T:
    """Run ``work`` but cancel it as soon as the client disconnects (non-streaming)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled ourselves (shutdown): take the work along
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    # Whatever the cancelled work raises on its way out is moot: nobody is listening.
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected()


async def _wait_disconnect(request: HTTPRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
