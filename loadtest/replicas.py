"""Scrape every replica's ``/metrics`` during a run, for per-replica figures.

Behind a router the client cannot tell which replica served a request; each replica's
own counters can. ``ReplicaScrapers`` takes a baseline scrape of every replica before the
first request, polls them while the run goes on (keeping only the latest good sample of
each), and scrapes once more at the end. A replica that dies mid-run (SIGKILL) keeps its
last good sample: its figures then miss at most one scrape interval of its work.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.scrape import MetricSpec, parse_metrics

REPLICA_COUNTERS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "requests_finished",
        ("kvserve_requests_finished_total", "vllm:request_success_total"),
    ),
    MetricSpec("prompt_tokens", ("kvserve_prompt_tokens_total", "vllm:prompt_tokens_total")),
    MetricSpec(
        "generation_tokens",
        ("kvserve_generation_tokens_total", "vllm:generation_tokens_total"),
    ),
    MetricSpec(
        "prefix_cache_queried_tokens",
        ("kvserve_prefix_cache_queried_tokens_total", "vllm:prefix_cache_queries_total"),
    ),
    MetricSpec(
        "prefix_cache_hit_tokens",
        ("kvserve_prefix_cache_hit_tokens_total", "vllm:prefix_cache_hits_total"),
    ),
    MetricSpec(
        "ttft_count",
        ("kvserve_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
    ),
    MetricSpec(
        "ttft_sum",
        ("kvserve_time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_sum"),
    ),
)
TTFT_HISTOGRAMS: tuple[str, ...] = (
    "kvserve_time_to_first_token_seconds",
    "vllm:time_to_first_token_seconds",
)


@dataclass(frozen=True)
class ReplicaSample:
    """One scrape of a replica: counters by ``REPLICA_COUNTERS`` key, and the TTFT
    histogram's cumulative bucket counts by upper bound (``inf`` included)."""

    t: float  # seconds since the run's start
    counters: dict[str, float]
    ttft_buckets: dict[float, float]


def parse_histogram(text: str, names: tuple[str, ...]) -> dict[float, float]:
    """Cumulative bucket counts of the first histogram of ``names`` present, summed over
    other labels; empty when none is exported."""
    for family in text_string_to_metric_families(text):
        if family.name not in names or family.type != "histogram":
            continue
        buckets: dict[float, float] = {}
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + float(sample.value)
        return buckets
    return {}


@dataclass
class ReplicaState:
    """What was scraped from one replica: the baseline and the latest good sample."""

    url: str
    first: ReplicaSample | None = None
    last: ReplicaSample | None = None
    failures: int = 0
    reachable_at_end: bool = False


@dataclass
class ReplicaScrapers:
    """Scrapes ``{url}/metrics`` of every replica; see the module docstring."""

    client: httpx.AsyncClient
    urls: tuple[str, ...]
    interval_s: float
    t0: float
    states: list[ReplicaState] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.states = [ReplicaState(url) for url in self.urls]

    async def _scrape(self, state: ReplicaState) -> bool:
        try:
            response = await self.client.get(
                f"{state.url}/metrics", timeout=max(2.0, self.interval_s * 2)
            )
            response.raise_for_status()
            text = response.text
            sample = ReplicaSample(
                t=time.perf_counter() - self.t0,
                counters=parse_metrics(text, REPLICA_COUNTERS),
                ttft_buckets=parse_histogram(text, TTFT_HISTOGRAMS),
            )
        except (httpx.HTTPError, ValueError):
            state.failures += 1
            return False
        if state.first is None:
            state.first = sample
        state.last = sample
        return True

    async def scrape_all(self) -> list[bool]:
        """Scrape every replica once, concurrently; whether each answered."""
        return list(await asyncio.gather(*(self._scrape(s) for s in self.states)))

    async def poll(self) -> None:
        """Scrape every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape_all()

    async def finish(self) -> None:
        """The closing scrape, after the last request; records who still answers."""
        for state, ok in zip(self.states, await self.scrape_all(), strict=True):
            state.reachable_at_end = ok
