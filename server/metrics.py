"""Prometheus metrics for GET /metrics.

Two sources feed one registry per server instance (no module-level globals):

* Engine state (KV blocks, bytes, queue lengths, engine counters) is read from the
  engine's immutable ``EngineStats`` snapshot at scrape time by a custom collector, so a
  scrape only copies a few numbers and never holds the engine loop.
* Per-request latencies and lengths are histograms observed by the server through
  ``ServerMetrics.observe_request`` when a choice finishes.
* The process itself (``process_resident_memory_bytes``, ``process_cpu_seconds_total``,
  ``process_open_fds``...) comes from prometheus_client's ``ProcessCollector``, registered
  on the same registry, and measured memory (``kvserve_device_memory_measured_bytes``)
  from the runner at scrape time, beside the computed ``kvserve_device_memory_bytes``.

Names follow Prometheus conventions: prefix ``kvserve_``, units in the name, counters
ending in ``_total`` and a ``model_name`` label on every series. docs/reference/metrics.md lists
every name; dashboards and alert rules in deploy/ depend on them, so keep them stable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Histogram,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.kv import accounting
from engine.kv.accounting import KVShape
from engine.outputs import EngineStats, PoolStats
from server.tier_metrics import tier_families

PREFIX = "kvserve_"
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")
# Reasons known up front are exported as zero so rate() queries have a series to work on.
REJECT_REASONS: tuple[str, ...] = ("too_long", "no_capacity", "queue_full", "invalid")
PREEMPTION_MODES: tuple[str, ...] = ("recompute", "swap")
POOLING_ENDPOINTS: tuple[str, ...] = ("embeddings", "score", "rerank")

# Latency buckets resolve both a GPU (milliseconds) and a loaded CPU (tens of seconds:
# a 32-conversation CPU run saw a TTFT p99 of 37.7 s) with steps of at most 1.5x from
# 10 ms up to a minute, then reach past the shutdown (30 s) and any sensible queue
# timeout, as vLLM's TTFT buckets reach 2560 s.
LATENCY_BUCKETS_S = (
    *(0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08),
    *(0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.5),
    *(10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 50.0, 60.0, 80.0, 120.0, 180.0, 240.0),
    *(320.0, 480.0, 640.0, 1280.0, 2560.0),
)
# Inter-token gaps: steps of at most 1.34x from 5 ms to 1 s (GPU decode steps of a few
# ms, CPU steps of tens to hundreds of ms), then the stalls of preemption and swapping.
ITL_BUCKETS_S = (
    *(0.001, 0.0025, 0.005, 0.0065, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03),
    *(0.04, 0.05, 0.065, 0.08, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.65),
    *(0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
E2E_BUCKETS_S = (
    *(0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0),
    *(20.0, 25.0, 30.0, 40.0, 50.0, 60.0, 80.0, 120.0, 180.0, 240.0, 320.0, 480.0),
    *(640.0, 960.0, 1920.0, 3840.0, 7680.0),
)
TOKEN_BUCKETS = tuple(float(2**i) for i in range(0, 18))  # 1 .. 131072 tokens
BLOCK_BUCKETS = tuple(float(2**i) for i in range(0, 15))  # 1 .. 16384 blocks


@dataclass(frozen=True)
class RequestRecord:
    """One finished choice of a client request, as recorded by the server."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int
    queue_time_s: float | None
    ttft_s: float | None
    e2e_s: float
    itl_s: tuple[float, ...]  # inter-token latencies of this choice
    kv_blocks: int  # device blocks held at finish
    lora_name: str | None = None  # the LoRA adapter it ran with (None: the base model)


class EngineStatsCollector(Collector):
    """Turns one ``EngineStats`` snapshot per scrape into gauge and counter families."""

    def __init__(
        self,
        *,
        model_name: str,
        stats_fn: Callable[[], EngineStats],
        kv_shape: KVShape | None,
        weight_bytes: int,
        health_fn: Callable[[], bool] | None,
        memory_fn: Callable[[], dict[str, int]] | None = None,
        planned_bytes: dict[str, int] | None = None,
        max_loras: int = 0,
    ) -> None:
        self._model = model_name
        self._max_loras = max_loras
        self._planned_bytes = dict(planned_bytes or {})
        self._stats_fn = stats_fn
        self._kv_shape = kv_shape
        self._weight_bytes = weight_bytes
        self._health_fn = health_fn
        self._memory_fn = memory_fn

    def describe(self) -> Iterable[Metric]:
        # Registering must not call into the engine; names: docs/reference/metrics.md.
        return []

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._stats_fn()
        except Exception:
            # A dead engine must not break /metrics: report it unhealthy and nothing else.
            yield self._gauge("engine_healthy", "1 when the engine loop is alive.", 0)
            return
        healthy = self._health_fn() if self._health_fn is not None else True
        yield self._gauge("engine_healthy", "1 when the engine loop is alive.", int(healthy))
        yield from self._block_families(stats)
        yield from self._byte_families(stats)
        yield from self._group_families(stats)
        yield from self._measured_families()
        yield from self._request_families(stats)
        yield from self._lora_families(stats)
        yield from self._counter_families(stats)
        yield from tier_families(self._model, stats)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _block_families(self, stats: EngineStats) -> Iterator[Metric]:
        by_state = GaugeMetricFamily(
            PREFIX + "kv_cache_blocks",
            "KV blocks by pool and state; used + free + cached = capacity.",
            labels=["model_name", "pool", "state"],
        )
        capacity = GaugeMetricFamily(
            PREFIX + "kv_cache_capacity_blocks",
            "KV blocks in the pool.",
            labels=["model_name", "pool"],
        )
        pools: tuple[tuple[str, PoolStats], ...] = (
            ("device", stats.device_blocks),
            ("host", stats.host_blocks),
        )
        for pool, blocks in pools:
            capacity.add_metric([self._model, pool], blocks.total)
            for state in ("used", "free", "cached"):
                by_state.add_metric([self._model, pool, state], getattr(blocks, state))
        yield by_state
        yield capacity
        yield self._gauge(
            "kv_cache_usage_ratio", "Used / total device KV blocks.", stats.usage_ratio
        )
        yield self._gauge("kv_cache_block_size_tokens", "Tokens per KV block.", stats.block_size)

    def _byte_families(self, stats: EngineStats) -> Iterator[Metric]:
        yield self._gauge(
            "kv_cache_live_tokens",
            "Tokens with K/V in device blocks, summed over live sequences.",
            stats.live_tokens,
        )
        yield self._gauge(
            "kv_cache_payload_bytes",
            "Logical KV payload of the live tokens: 2*L*H_kv*d*t*b.",
            stats.payload_bytes,
        )
        yield self._gauge(
            "kv_cache_allocated_bytes",
            "Used device blocks x bytes per block.",
            stats.allocated_bytes,
        )
        yield self._gauge(
            "kv_cache_padding_bytes",
            "Allocated + shared - payload: unused slots in partly filled blocks.",
            stats.padding_bytes,
        )
        yield self._gauge(
            "kv_cache_shared_bytes",
            "Bytes saved by blocks shared through prefix caching or n > 1 forks.",
            stats.shared_bytes,
        )
        memory = GaugeMetricFamily(
            PREFIX + "device_memory_bytes",
            "Device memory the plan computes: model weights, the KV block pool and, from "
            "the capacity plan, the activation reserve and the block-copy staging buffer.",
            labels=["model_name", "component"],
        )
        memory.add_metric([self._model, "weights"], self._weight_bytes)
        if self._kv_shape is not None:
            pool_bytes = accounting.allocated_bytes(
                self._kv_shape, stats.device_blocks.total, stats.block_size
            )
            memory.add_metric([self._model, "kv_cache"], pool_bytes)
        for component, planned in sorted(self._planned_bytes.items()):
            memory.add_metric([self._model, component], planned)
        yield memory
        if self._kv_shape is not None:
            host_bytes = accounting.allocated_bytes(
                self._kv_shape, stats.host_blocks.total, stats.block_size
            )
            yield self._gauge(
                "host_kv_cache_memory_bytes", "Host memory of the offload pool.", host_bytes
            )

    def _group_families(self, stats: EngineStats) -> Iterator[Metric]:
        """Per KV group of a hybrid model (engine/kv/groups.py); nothing for one group."""
        if not stats.groups:
            return
        labels = ["model_name", "group", "attention", "window"]
        blocks = GaugeMetricFamily(
            PREFIX + "kv_cache_group_blocks",
            "Device KV blocks each KV group holds (used) or keeps cached for prefix hits.",
            labels=[*labels, "state"],
        )
        payload = GaugeMetricFamily(
            PREFIX + "kv_cache_group_payload_bytes",
            "Logical KV payload per group: 2*L_g*H_kv*d*t*b, t at most the window.",
            labels=labels,
        )
        allocated = GaugeMetricFamily(
            PREFIX + "kv_cache_group_allocated_bytes",
            "Used blocks of each group x bytes per block.",
            labels=labels,
        )
        layers = GaugeMetricFamily(
            PREFIX + "kv_cache_group_layers", "Model layers in each KV group.", labels=labels
        )
        for index, group in enumerate(stats.groups):
            kind = "full" if group.window is None else "sliding"
            values = [self._model, str(index), kind, str(group.window or "")]
            blocks.add_metric([*values, "used"], group.used_blocks)
            blocks.add_metric([*values, "cached"], group.cached_blocks)
            payload.add_metric(values, group.payload_bytes)
            allocated.add_metric(values, group.allocated_bytes)
            layers.add_metric(values, group.num_layers)
        yield from (blocks, payload, allocated, layers)

    def _measured_families(self) -> Iterator[Metric]:
        if self._memory_fn is None:
            return
        try:
            measured = self._memory_fn()
        except Exception:
            return  # a measurement that fails must not break /metrics
        family = GaugeMetricFamily(
            PREFIX + "device_memory_measured_bytes",
            "Measured memory beside the computed kvserve_device_memory_bytes: CUDA "
            "allocator reserved and max_allocated; on the CPU, resident pages of the KV "
            "pool (kv_cache); resident pages of the host offload pool (host_kv_cache).",
            labels=["model_name", "component"],
        )
        for component, value in sorted(measured.items()):
            family.add_metric([self._model, component], value)
        yield family

    def _request_families(self, stats: EngineStats) -> Iterator[Metric]:
        yield self._gauge(
            "num_requests_running", "Sequences in the running batch.", stats.num_running
        )
        yield self._gauge(
            "num_requests_waiting", "Sequences waiting for admission.", stats.num_waiting
        )
        yield self._gauge(
            "num_requests_swapped", "Sequences swapped out to the host pool.", stats.num_swapped
        )

    def _lora_families(self, stats: EngineStats) -> Iterator[Metric]:
        """``kvserve_lora_requests_info``: the LoRA metric of the Gateway API Inference
        Extension's model server protocol, as vLLM's ``vllm:lora_requests_info``. One
        sample: ``max_lora`` (adapters one step can run), the adapters of the running and
        of the queued requests (comma-separated names), and as its value the snapshot's
        time in seconds since the epoch -- the EPP takes the sample with the largest value
        as the latest, since vLLM keeps one stale series per label set it ever had.

        Exported with LoRA off too (``max_lora="0"``, empty lists), where vLLM exports
        nothing: then one EPP engine config with ``loraSpec`` set serves every kvserve pod.
        A missing family is an extraction error on every scrape in the Inference
        Extension's EPP v1.5 (its data-layer extractor returns it, the collector logs it
        once and stays in the error state, hiding a later real error of the same
        extractor); this sample instead reads as "no adapter loaded, no slot", which the
        lora-affinity scorer rates 0 for any adapter, as it rates a vLLM without LoRA.
        docs/reference/metrics.md cites the sources."""
        family = GaugeMetricFamily(
            PREFIX + "lora_requests_info",
            "LoRA adapters of the running and the queued requests, and the adapter slots "
            "(max_lora); the value is the time of the snapshot (unix seconds).",
            labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        labels = [
            self._model,
            str(self._max_loras),
            # No spaces: the EPP's legacy parser splits on "," without trimming.
            ",".join(stats.running_lora_adapters),
            ",".join(stats.waiting_lora_adapters),
        ]
        family.add_metric(labels, time.time())
        yield family

    def _counter_families(self, stats: EngineStats) -> Iterator[Metric]:
        yield self._counter(
            "prompt_tokens", "Prompt tokens added to the engine.", stats.prompt_tokens_total
        )
        yield self._counter("generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield self._counter(
            "prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries_total,
        )
        yield self._counter(
            "prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache.",
            stats.prefix_cache_hits_total,
        )
        yield self._counter("engine_steps", "Engine steps executed.", stats.steps_total)
        preemptions = CounterMetricFamily(
            PREFIX + "preemptions",
            "Sequences preempted, by mode (recompute or swap).",
            labels=["model_name", "mode"],
        )
        modes = dict.fromkeys(PREEMPTION_MODES, 0) | stats.preemptions_total
        for mode, count in sorted(modes.items()):
            preemptions.add_metric([self._model, mode], count)
        yield preemptions
        yield from self._swap_families(stats)
        yield from self._spec_families(stats)

    def _spec_families(self, stats: EngineStats) -> Iterator[Metric]:
        """Speculative decoding: the counters, and the two ratios dashboards want
        (lifetime; for a window, divide the counters' rates)."""
        yield self._counter(
            "spec_decode_num_drafts", "Draft verifications run.", stats.spec_drafts_total
        )
        yield self._counter(
            "spec_decode_num_draft_tokens",
            "Draft tokens proposed.",
            stats.spec_draft_tokens_total,
        )
        yield self._counter(
            "spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            stats.spec_accepted_tokens_total,
        )
        yield self._counter(
            "spec_decode_num_emitted_tokens",
            "Tokens emitted by verifications (accepted drafts plus one sampled each).",
            stats.spec_emitted_tokens_total,
        )
        drafted, verifications = stats.spec_draft_tokens_total, stats.spec_drafts_total
        yield self._gauge(
            "spec_decode_acceptance_rate",
            "Accepted / proposed draft tokens since start (0 before any draft).",
            stats.spec_accepted_tokens_total / drafted if drafted else 0.0,
        )
        yield self._gauge(
            "spec_decode_mean_accepted_length",
            "Tokens emitted per verification since start (0 before any).",
            stats.spec_emitted_tokens_total / verifications if verifications else 0.0,
        )

    def _swap_families(self, stats: EngineStats) -> Iterator[Metric]:
        swapped = (("out", stats.blocks_swapped_out_total), ("in", stats.blocks_swapped_in_total))
        for direction, blocks in swapped:
            yield self._counter(
                f"kv_blocks_swapped_{direction}",
                f"KV blocks copied {direction} between device and host pools.",
                blocks,
            )
        if self._kv_shape is None:
            return
        swap_bytes = CounterMetricFamily(
            PREFIX + "kv_swapped_bytes",
            "KV bytes copied between device and host pools, by direction.",
            labels=["model_name", "direction"],
        )
        for direction, blocks in swapped:
            moved = accounting.allocated_bytes(self._kv_shape, blocks, stats.block_size)
            swap_bytes.add_metric([self._model, direction], moved)
        yield swap_bytes


class CacheInfoCollector(Collector):
    """``kvserve_cache_config_info``: the cache configuration as labels on a constant 1."""

    def __init__(self, model_name: str, info: dict[str, str]) -> None:
        self._labels = {"model_name": model_name, **info}

    def collect(self) -> Iterable[Metric]:
        family = InfoMetricFamily(PREFIX + "cache_config", "KV cache configuration.")
        family.add_metric([], self._labels)
        yield family


class ResponseStoreCollector(Collector):
    """The Responses API's store (server/responses/store.py), read at scrape time:
    ``kvserve_responses_stored`` and ``kvserve_responses_stored_bytes`` now, and the
    responses evicted by its bounds and the lookups of ids it did not hold."""

    def __init__(self, model_name: str, store: Any) -> None:
        self._model = model_name
        self._store = store

    def collect(self) -> Iterable[Metric]:
        store = self._store
        for name, doc, value in (
            ("responses_stored", "Responses held for previous_response_id and GET.", len(store)),
            ("responses_stored_bytes", "Bytes of the stored responses (JSON).", store.nbytes),
        ):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric([self._model], value)
            yield gauge
        for name, doc, value in (
            (
                "responses_evicted",
                "Stored responses evicted by the store's bounds.",
                store.counters.evicted,
            ),
            (
                "responses_store_misses",
                "Lookups of response ids not (or no longer) stored.",
                store.counters.misses,
            ),
        ):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric([self._model], value)
            yield counter


class LoRACounters:
    """Per-adapter counters of finished choices, beside the server-wide ones: a series per
    adapter that served a request (none are made up front: the adapters are not known at
    startup, and a base-model choice counts only in the server-wide counters)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name", "lora_name"]
        self.finished = Counter(
            PREFIX + "lora_requests_finished",
            "Request choices finished on a LoRA adapter, by adapter and finish_reason.",
            [*labels, "finish_reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "lora_prompt_tokens",
            "Prompt tokens of the choices finished on a LoRA adapter, by adapter.",
            labels,
            registry=registry,
        )
        self.generation_tokens = Counter(
            PREFIX + "lora_generation_tokens",
            "Tokens generated by the choices finished on a LoRA adapter, by adapter.",
            labels,
            registry=registry,
        )

    def observe(self, model_name: str, record: RequestRecord) -> None:
        """Count one finished choice of ``record.lora_name`` (not None)."""
        adapter = str(record.lora_name)
        self.finished.labels(model_name, adapter, record.finish_reason).inc()
        self.prompt_tokens.labels(model_name, adapter).inc(record.prompt_tokens)
        self.generation_tokens.labels(model_name, adapter).inc(record.generation_tokens)


class ServerMetrics:
    """All metrics of one server, in a registry of its own; ``render()`` serves a scrape."""

    def __init__(
        self,
        *,
        model_name: str,
        stats_fn: Callable[[], EngineStats],
        cache_info: dict[str, str],
        kv_shape: KVShape | None = None,
        weight_bytes: int = 0,
        health_fn: Callable[[], bool] | None = None,
        memory_fn: Callable[[], dict[str, int]] | None = None,
        planned_bytes: dict[str, int] | None = None,
        max_loras: int = 0,
    ) -> None:
        """``max_loras``: the engine's adapter slots (``--max-loras``; 0 with LoRA off),
        the ``max_lora`` label of ``kvserve_lora_requests_info``."""
        self.registry = CollectorRegistry(auto_describe=False)
        self._model = model_name
        self.registry.register(
            EngineStatsCollector(
                model_name=model_name,
                stats_fn=stats_fn,
                kv_shape=kv_shape,
                weight_bytes=weight_bytes,
                health_fn=health_fn,
                memory_fn=memory_fn,
                planned_bytes=planned_bytes,
                max_loras=max_loras,
            )
        )
        # process_resident_memory_bytes, process_cpu_seconds_total, process_open_fds, ...
        # (reads /proc/self; exports nothing where there is no /proc).
        ProcessCollector(registry=self.registry)
        self.registry.register(CacheInfoCollector(model_name, _cache_labels(cache_info, kv_shape)))
        self._finished = self._labelled_counter(
            "requests_finished", "Request choices finished, by finish_reason.", "finish_reason"
        )
        self._rejected = self._labelled_counter(
            "requests_rejected", "Requests rejected before running, by reason.", "reason"
        )
        self._ignored_fields = self._labelled_counter(
            "request_fields_ignored",
            "Unknown top-level request fields ignored (--unknown-fields ignore), by field.",
            "field",
        )
        for reason in FINISH_REASONS:
            self._finished.labels(model_name, reason)
        for reason in REJECT_REASONS:
            self._rejected.labels(model_name, reason)
        self._lora = LoRACounters(self.registry)
        self._ttft = self._histogram(
            "time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS_S
        )
        self._itl = self._histogram(
            "inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS_S
        )
        self._e2e = self._histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS_S
        )
        self._queue = self._histogram(
            "request_queue_time_seconds", "Arrival to first schedule.", LATENCY_BUCKETS_S
        )
        self._prompt_len = self._histogram(
            "request_prompt_tokens", "Prompt length per request.", TOKEN_BUCKETS
        )
        self._generation_len = self._histogram(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self._kv_blocks = self._histogram(
            "request_kv_blocks", "Device KV blocks a request held at finish.", BLOCK_BUCKETS
        )
        # Pooling requests (embeddings, score, rerank; server/embeddings.py), by endpoint.
        self._pooling_requests = self._labelled_counter(
            "pooling_requests", "Pooling requests answered, by endpoint.", "endpoint"
        )
        self._pooling_inputs = self._labelled_counter(
            "pooling_inputs", "Prompts pooled (one engine request each), by endpoint.", "endpoint"
        )
        self._pooling_tokens = self._labelled_counter(
            "pooling_prompt_tokens", "Prompt tokens of pooling requests, by endpoint.", "endpoint"
        )
        self._pooling_seconds = Histogram(
            PREFIX + "pooling_request_latency_seconds",
            "Pooling request: first submission to the last vector, by endpoint.",
            ["model_name", "endpoint"],
            buckets=E2E_BUCKETS_S,
            registry=self.registry,
        )
        for endpoint in POOLING_ENDPOINTS:
            for counter in (self._pooling_requests, self._pooling_inputs, self._pooling_tokens):
                counter.labels(model_name, endpoint)

    def _labelled_counter(self, name: str, doc: str, label: str) -> Counter:
        return Counter(PREFIX + name, doc, ["model_name", label], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        family = Histogram(
            PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry
        )
        return family.labels(self._model)

    def observe_request(self, record: RequestRecord) -> None:
        """Record one finished choice: finish reason, latencies and lengths."""
        self._finished.labels(self._model, record.finish_reason).inc()
        if record.ttft_s is not None:
            self._ttft.observe(record.ttft_s)
        if record.queue_time_s is not None:
            self._queue.observe(record.queue_time_s)
        for gap in record.itl_s:
            self._itl.observe(gap)
        self._e2e.observe(record.e2e_s)
        self._prompt_len.observe(record.prompt_tokens)
        self._generation_len.observe(record.generation_tokens)
        self._kv_blocks.observe(record.kv_blocks)
        if record.lora_name is not None:
            self._lora.observe(self._model, record)

    def observe_pooling(
        self, endpoint: str, num_inputs: int, prompt_tokens: int, seconds: float
    ) -> None:
        """Record one answered pooling request (``endpoint``: one of POOLING_ENDPOINTS)."""
        self._pooling_requests.labels(self._model, endpoint).inc()
        self._pooling_inputs.labels(self._model, endpoint).inc(num_inputs)
        self._pooling_tokens.labels(self._model, endpoint).inc(prompt_tokens)
        self._pooling_seconds.labels(self._model, endpoint).observe(seconds)

    def watch_response_store(self, store: Any) -> None:
        """Export the Responses API store's occupancy (``ResponseStoreCollector``)."""
        self.registry.register(ResponseStoreCollector(self._model, store))

    def count_rejected(self, reason: str) -> None:
        """Count a request refused before it ran (too_long, queue_full, invalid, auth...)."""
        self._rejected.labels(self._model, reason).inc()

    def count_ignored_field(self, field: str) -> None:
        """Count one unknown field a request carried and the server ignored (its label
        bounded by server/unknown_fields.py)."""
        self._ignored_fields.labels(self._model, field).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _cache_labels(cache_info: dict[str, str], kv_shape: KVShape | None) -> dict[str, str]:
    """The server's cache description, completed with per-token and per-block bytes."""
    labels = {key: str(value) for key, value in cache_info.items()}
    if kv_shape is not None:
        labels.setdefault("bytes_per_token", str(accounting.bytes_per_token(kv_shape)))
        labels.setdefault("kv_cache_dtype", kv_shape.kv_dtype)
        block_size = labels.get("block_size")
        if block_size is not None and block_size.isdigit():
            per_block = accounting.bytes_per_block(kv_shape, int(block_size))
            labels.setdefault("bytes_per_block", str(per_block))
    return labels
