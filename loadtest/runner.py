"""Drive conversations against the server: closed-loop concurrency or Poisson arrivals.

Every request goes to ``{target}/v1/chat/completions`` for a target of
``config.target_urls`` (``TargetPicker``) and nowhere else; the run stops by itself at its
bound (see ``LoadTestConfig``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx

from loadtest.client import ChatRequest, RequestRecord, stream_chat
from loadtest.config import LoadTestConfig
from loadtest.progress import ProgressBar
from loadtest.prompts import Conversation, shared_system_prompt
from loadtest.replicas import ReplicaScrapers, ReplicaState
from loadtest.scrape import MetricsScraper
from loadtest.targets import TargetPicker

PROGRESS_TICK_S = 0.5


@dataclass
class RunResult:
    """Everything measured in one run; statistics are derived from it afterwards."""

    config: LoadTestConfig
    model: str
    started_at: str  # UTC, ISO 8601
    duration_s: float  # from the run's start to the last request's end
    stopped_by: str  # completed | duration | max_requests
    records: list[RequestRecord] = field(default_factory=list)
    metric_samples: list[dict[str, float]] = field(default_factory=list)
    metrics_available: bool = False
    replicas: list[ReplicaState] = field(default_factory=list)  # config.scraped_replicas


class RunContext:
    """Shared state of one run: the request budget, the stop signal, the records."""

    def __init__(self, config: LoadTestConfig, client: httpx.AsyncClient, model: str) -> None:
        self.config = config
        self.client = client
        self.model = model
        self.t0 = time.perf_counter()
        self.records: list[RequestRecord] = []
        self.stop_event = asyncio.Event()
        self.stopped_by = "completed"
        self.system_prompt = shared_system_prompt(config.system_prompt_len, config.seed)
        self.targets = TargetPicker(config.target_urls, config.routing)
        self._requests_sent = 0

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def stop(self, reason: str) -> None:
        if not self.stopping:
            self.stopped_by = reason
            self.stop_event.set()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def take_request_slot(self) -> bool:
        """Claim one request of the budget; False once the run is stopping or spent."""
        if self.stopping:
            return False
        if self._requests_sent >= self.config.request_limit:
            if self.config.max_requests is not None:
                self.stop("max_requests")
            return False
        self._requests_sent += 1
        return True

    async def sleep(self, seconds: float) -> None:
        """Sleep, but wake at once when the run stops."""
        if seconds > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), timeout=seconds)

    def new_conversation(self, conversation_id: int) -> Conversation:
        return Conversation.create(
            conversation_id,
            turns=self.config.turns,
            user_len=self.config.user_len,
            seed=self.config.seed,
            system_prompt=self.system_prompt,
        )

    def model_for(self, conversation_id: int) -> str:
        """The model a conversation talks to: ``config.models`` round-robin, or the one."""
        models = self.config.models
        return models[conversation_id % len(models)] if models else self.model

    def _request_seed(self, conversation: Conversation) -> int:
        """A sampling seed per (run seed, conversation, turn): sampled runs repeat on
        servers that honour ``seed``."""
        key = (self.config.seed * 1_000_003 + conversation.conversation_id) * 1_009
        return (key + conversation.turns_done) % 2**31

    async def run_turn(self, conversation: Conversation) -> RequestRecord:
        """Send the conversation's next turn, stream the reply and append it."""
        messages = conversation.next_user_message()
        request = ChatRequest(
            model=self.model_for(conversation.conversation_id),
            messages=messages,
            max_tokens=self.config.max_tokens,
            temperature=self.config.temperature,
            ignore_eos=self.config.ignore_eos,
            seed=self._request_seed(conversation) if self.config.temperature > 0 else None,
        )
        target = self.targets.pick(conversation.conversation_id)
        record = RequestRecord(conversation.conversation_id, conversation.turns_done, 0.0)
        record.target = target
        self.records.append(record)
        record.start = self.elapsed()
        await stream_chat(self.client, f"{target}/v1/chat/completions", request, record, self.t0)
        if record.ok:
            conversation.record_reply(record.text)
        else:
            conversation.abandon_turn()
        return record


async def closed_loop(ctx: RunContext) -> None:
    """``concurrency`` workers, each running conversations back to back."""
    config = ctx.config
    next_id = iter(range(config.total_conversations))

    async def worker(index: int) -> None:
        await ctx.sleep(config.ramp_up_s * index / config.concurrency)
        for conversation_id in next_id:
            conversation = ctx.new_conversation(conversation_id)
            while not conversation.finished:
                if not ctx.take_request_slot():
                    return
                await ctx.run_turn(conversation)
                if not conversation.finished:
                    await ctx.sleep(config.think_time_s)

    await asyncio.gather(*(worker(i) for i in range(config.concurrency)))


class _ConversationPool:
    """Poisson mode's conversations: idle ones wait in a queue for the next arrival."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.idle: asyncio.Queue[Conversation | None] = asyncio.Queue()
        self.open = 0
        self.next_id = 0

    async def acquire(self) -> Conversation | None:
        """An idle conversation, a new one, or None when every conversation is done."""
        config = self.ctx.config
        while True:
            if not self.idle.empty():
                item = self.idle.get_nowait()
                if item is not None:
                    return item
                continue
            if self.open < config.concurrency and self.next_id < config.total_conversations:
                self.open += 1
                self.next_id += 1
                return self.ctx.new_conversation(self.next_id - 1)
            if self.open == 0:
                return None
            item = await self.idle.get()  # None: a conversation closed, look again
            if item is not None:
                return item

    async def run_turn(self, conversation: Conversation) -> None:
        await self.ctx.run_turn(conversation)
        if conversation.finished:
            self.open -= 1
            self.idle.put_nowait(None)
            return
        await self.ctx.sleep(self.ctx.config.think_time_s)
        self.idle.put_nowait(conversation)


async def poisson_arrivals(ctx: RunContext) -> None:
    """Requests arrive with exponential gaps of mean ``1 / request_rate``."""
    config = ctx.config
    assert config.request_rate is not None
    rng = random.Random(config.seed)
    pool = _ConversationPool(ctx)
    tasks: set[asyncio.Task[None]] = set()
    try:
        while not ctx.stopping:
            await ctx.sleep(rng.expovariate(config.request_rate))
            conversation = await pool.acquire()
            if conversation is None or not ctx.take_request_slot():
                break
            task = asyncio.create_task(pool.run_turn(conversation))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model the server lists, or ``default`` when it lists none."""
    try:
        response = await client.get(f"{base_url}/v1/models", timeout=10.0)
        response.raise_for_status()
        models = response.json().get("data") or []
        if models and models[0].get("id"):
            return str(models[0]["id"])
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return "default"


async def _await_bounded(ctx: RunContext, driver: asyncio.Task[None]) -> None:
    """Wait for the driver; at the duration limit stop it, let in-flight requests drain
    for ``drain_timeout_s``, then cancel what is left."""
    config = ctx.config
    done, _ = await asyncio.wait({driver}, timeout=config.duration_s)
    if not done:
        ctx.stop("duration")
        done, _ = await asyncio.wait({driver}, timeout=config.drain_timeout_s)
    if not done:
        driver.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await driver


async def _tick_progress(ctx: RunContext, bar: ProgressBar) -> None:
    while True:
        bar.update(*_progress_figures(ctx))
        await asyncio.sleep(PROGRESS_TICK_S)


def _progress_figures(ctx: RunContext) -> tuple[int, int, int, float]:
    finished = [r for r in ctx.records if r.end is not None]
    errors = sum(1 for r in finished if not r.ok)
    tokens = sum(
        r.completion_tokens if r.usage_reported else len(r.chunk_times) for r in ctx.records
    )
    return len(finished), errors, tokens, ctx.elapsed()


def _client(config: LoadTestConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # The scrapers and model discovery need their own connections.
    slots = config.concurrency + 4 + len(config.scraped_replicas)
    return httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(config.request_timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=slots, max_keepalive_connections=slots),
    )


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def run_loadtest(config: LoadTestConfig, *, progress: bool = True) -> RunResult:
    """Run the whole load test and return its measurements."""
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    async with _client(config) as client:
        model = config.model or await discover_model(client, config.base_url)
        ctx = RunContext(config, client, model)
        scraper = MetricsScraper(client, config.base_url, config.scrape_interval_s, ctx.t0)
        scrape_task = asyncio.create_task(
            scraper.poll() if await scraper.start() else asyncio.sleep(0)
        )
        replicas = ReplicaScrapers(
            client, config.scraped_replicas, config.scrape_interval_s, ctx.t0
        )
        await replicas.scrape_all()  # the baseline, before the first request
        replica_task = asyncio.create_task(replicas.poll())
        bar = ProgressBar(config.request_limit, enabled=progress)
        progress_task = asyncio.create_task(_tick_progress(ctx, bar))
        drive: Awaitable[None] = (
            poisson_arrivals(ctx) if config.request_rate is not None else closed_loop(ctx)
        )
        await _await_bounded(ctx, asyncio.ensure_future(drive))
        duration = max((r.end for r in ctx.records if r.end is not None), default=0.0)
        await _cancel(progress_task)
        bar.close(*_progress_figures(ctx))
        await _cancel(scrape_task)
        await _cancel(replica_task)
        if scraper.available:
            await scraper.scrape_once()  # final counters, after the last request
        await replicas.finish()
    return RunResult(
        config=config,
        model=model,
        started_at=started_at,
        duration_s=duration,
        stopped_by=ctx.stopped_by,
        records=ctx.records,
        metric_samples=scraper.samples,
        metrics_available=bool(scraper.available),
        replicas=replicas.states,
    )
