"""Scrape the server's Prometheus ``/metrics`` during the run.

``METRICS`` is the one table of what is read: each entry names the series the report
uses and the metric names that provide it, kvserve's first, then vLLM's and llama.cpp
server's equivalents, so the same report works against those servers. Samples of one
name are summed over their labels unless ``labels`` restricts them (e.g. the device pool
only, or preemptions summed over every mode).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class MetricSpec:
    key: str  # the series name in the JSON result and the report
    names: tuple[str, ...]  # candidate sample names, first present wins
    labels: tuple[tuple[str, str], ...] = ()  # only samples with these label values


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "kv_usage_ratio",
        (
            "kvserve_kv_cache_usage_ratio",
            "vllm:kv_cache_usage_perc",
            "vllm:gpu_cache_usage_perc",
            "llamacpp:kv_cache_usage_ratio",
        ),
    ),
    MetricSpec(
        "kv_blocks_used", ("kvserve_kv_cache_blocks",), (("pool", "device"), ("state", "used"))
    ),
    MetricSpec(
        "kv_blocks_cached",
        ("kvserve_kv_cache_blocks",),
        (("pool", "device"), ("state", "cached")),
    ),
    MetricSpec("kv_blocks_capacity", ("kvserve_kv_cache_capacity_blocks",), (("pool", "device"),)),
    MetricSpec(
        "host_blocks_used", ("kvserve_kv_cache_blocks",), (("pool", "host"), ("state", "used"))
    ),
    MetricSpec("kv_payload_bytes", ("kvserve_kv_cache_payload_bytes",)),
    MetricSpec("kv_allocated_bytes", ("kvserve_kv_cache_allocated_bytes",)),
    MetricSpec(
        "num_running",
        (
            "kvserve_num_requests_running",
            "vllm:num_requests_running",
            "llamacpp:requests_processing",
        ),
    ),
    MetricSpec(
        "num_waiting",
        (
            "kvserve_num_requests_waiting",
            "vllm:num_requests_waiting",
            "llamacpp:requests_deferred",
        ),
    ),
    MetricSpec("num_swapped", ("kvserve_num_requests_swapped", "vllm:num_requests_swapped")),
    MetricSpec("preemptions_total", ("kvserve_preemptions_total", "vllm:num_preemptions_total")),
    MetricSpec("blocks_swapped_out_total", ("kvserve_kv_blocks_swapped_out_total",)),
    MetricSpec("blocks_swapped_in_total", ("kvserve_kv_blocks_swapped_in_total",)),
    MetricSpec(
        "prefix_cache_queries_total",
        ("kvserve_prefix_cache_queried_tokens_total", "vllm:prefix_cache_queries_total"),
    ),
    MetricSpec(
        "prefix_cache_hits_total",
        ("kvserve_prefix_cache_hit_tokens_total", "vllm:prefix_cache_hits_total"),
    ),
    MetricSpec(
        "generation_tokens_total",
        ("kvserve_generation_tokens_total", "vllm:generation_tokens_total"),
    ),
)

# Counters (monotonic; the report shows their increase over the run) are exactly the keys
# ending in ``_total``; every other key is a gauge (the report shows its peak).
COUNTER_KEYS: tuple[str, ...] = tuple(m.key for m in METRICS if m.key.endswith("_total"))


def _matches(labels: Mapping[str, str], wanted: tuple[tuple[str, str], ...]) -> bool:
    return all(labels.get(name) == value for name, value in wanted)


def parse_metrics(text: str, specs: tuple[MetricSpec, ...] = METRICS) -> dict[str, float]:
    """Pick the table's series out of a Prometheus text exposition.

    Series whose metric is absent are left out (not zero): a server that does not report
    swaps did not report zero swaps.
    """
    samples: dict[str, list[tuple[Mapping[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
    values: dict[str, float] = {}
    for spec in specs:
        for name in spec.names:
            if name in samples:
                picked = [v for labels, v in samples[name] if _matches(labels, spec.labels)]
                if picked:
                    values[spec.key] = sum(picked)
                break
    return values


@dataclass
class MetricsScraper:
    """Scrapes ``{base_url}/metrics``: once before the run, then every ``interval_s``.

    If the first scrape finds no Prometheus endpoint there is no polling (``available``
    False); later failures (a busy server timing out) are counted and skipped.
    """

    client: httpx.AsyncClient
    base_url: str
    interval_s: float
    t0: float
    samples: list[dict[str, float]] = field(default_factory=list)
    available: bool | None = None
    failures: int = 0

    async def scrape_once(self) -> bool:
        try:
            response = await self.client.get(
                f"{self.base_url}/metrics", timeout=max(2.0, self.interval_s * 2)
            )
            response.raise_for_status()
            values = parse_metrics(response.text)
        except (httpx.HTTPError, ValueError):
            self.failures += 1
            return False
        values["t"] = time.perf_counter() - self.t0
        self.samples.append(values)
        return True

    async def start(self) -> bool:
        """The baseline scrape, taken before the first request so counter increases
        cover the whole run. Returns whether the server has a Prometheus endpoint."""
        self.available = await self.scrape_once()
        return self.available

    async def poll(self) -> None:
        """Scrape every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape_once()
