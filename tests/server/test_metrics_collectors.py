"""ServerMetrics against hand-built EngineStats snapshots (no engine, no HTTP)."""

from __future__ import annotations

import itertools

from prometheus_client.parser import text_string_to_metric_families

from engine.kv.accounting import KVShape
from engine.outputs import EngineStats, PoolStats
from server.metrics import (
    E2E_BUCKETS_S,
    ITL_BUCKETS_S,
    LATENCY_BUCKETS_S,
    RequestRecord,
    ServerMetrics,
)
from server.settings import ServerSettings

SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, kv_dtype="float16")
# 2 (K and V) * 3 layers * 2 heads * 8 dims * 2 bytes, written out rather than computed.
BYTES_PER_TOKEN = 2 * 3 * 2 * 8 * 2
BLOCK_SIZE = 4


def make_stats(*, used: int = 5, live_tokens: int = 17, **counters: object) -> EngineStats:
    per_block = BYTES_PER_TOKEN * BLOCK_SIZE
    return EngineStats(
        device_blocks=PoolStats(total=32, used=used, free=32 - used - 3, cached=3),
        host_blocks=PoolStats(total=8, used=1, free=7, cached=0),
        block_size=BLOCK_SIZE,
        num_running=2,
        num_waiting=3,
        num_swapped=1,
        live_tokens=live_tokens,
        payload_bytes=live_tokens * BYTES_PER_TOKEN,
        allocated_bytes=used * per_block,
        shared_bytes=per_block,
        **counters,  # type: ignore[arg-type]
    )


def scrape(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": "tiny", **labels}.items())))
    return samples[key]


def make_metrics(stats_fn=lambda: make_stats(), **kwargs) -> ServerMetrics:  # type: ignore[no-untyped-def]
    return ServerMetrics(
        model_name="tiny",
        stats_fn=stats_fn,
        cache_info={"block_size": str(BLOCK_SIZE), "num_device_blocks": "32"},
        kv_shape=SHAPE,
        weight_bytes=1234,
        **kwargs,
    )


def test_gauges_mirror_the_snapshot() -> None:
    samples = scrape(make_metrics())
    assert value(samples, "kvserve_kv_cache_blocks", pool="device", state="used") == 5
    assert value(samples, "kvserve_kv_cache_blocks", pool="device", state="cached") == 3
    assert value(samples, "kvserve_kv_cache_blocks", pool="device", state="free") == 24
    assert value(samples, "kvserve_kv_cache_capacity_blocks", pool="host") == 8
    assert value(samples, "kvserve_kv_cache_blocks", pool="host", state="used") == 1
    assert value(samples, "kvserve_kv_cache_usage_ratio") == 5 / 32
    assert value(samples, "kvserve_num_requests_running") == 2
    assert value(samples, "kvserve_num_requests_waiting") == 3
    assert value(samples, "kvserve_num_requests_swapped") == 1
    assert value(samples, "kvserve_engine_healthy") == 1


def test_byte_gauges_follow_the_payload_formula() -> None:
    samples = scrape(make_metrics())
    per_block = BYTES_PER_TOKEN * BLOCK_SIZE
    assert value(samples, "kvserve_kv_cache_live_tokens") == 17
    assert value(samples, "kvserve_kv_cache_payload_bytes") == 17 * BYTES_PER_TOKEN
    assert value(samples, "kvserve_kv_cache_allocated_bytes") == 5 * per_block
    assert value(samples, "kvserve_kv_cache_shared_bytes") == per_block
    # allocated + shared - payload: 6 blocks of 4 slots hold 17 tokens -> 7 padding slots.
    assert value(samples, "kvserve_kv_cache_padding_bytes") == 7 * BYTES_PER_TOKEN
    assert value(samples, "kvserve_device_memory_bytes", component="weights") == 1234
    assert value(samples, "kvserve_device_memory_bytes", component="kv_cache") == 32 * per_block
    assert value(samples, "kvserve_host_kv_cache_memory_bytes") == 8 * per_block


def test_counters_come_from_the_snapshot() -> None:
    stats = make_stats(
        preemptions_total={"swap": 2},
        blocks_swapped_out_total=6,
        blocks_swapped_in_total=4,
        prefix_cache_queries_total=100,
        prefix_cache_hits_total=64,
        prompt_tokens_total=100,
        generation_tokens_total=40,
        steps_total=9,
    )
    samples = scrape(make_metrics(stats_fn=lambda: stats))
    assert value(samples, "kvserve_preemptions_total", mode="swap") == 2
    assert value(samples, "kvserve_preemptions_total", mode="recompute") == 0
    assert value(samples, "kvserve_kv_blocks_swapped_out_total") == 6
    assert value(samples, "kvserve_kv_blocks_swapped_in_total") == 4
    per_block = BYTES_PER_TOKEN * BLOCK_SIZE
    assert value(samples, "kvserve_kv_swapped_bytes_total", direction="out") == 6 * per_block
    assert value(samples, "kvserve_prefix_cache_queried_tokens_total") == 100
    assert value(samples, "kvserve_prefix_cache_hit_tokens_total") == 64
    assert value(samples, "kvserve_prompt_tokens_total") == 100
    assert value(samples, "kvserve_generation_tokens_total") == 40
    assert value(samples, "kvserve_engine_steps_total") == 9


def test_each_scrape_reads_a_fresh_snapshot() -> None:
    snapshots = iter([make_stats(used=1, live_tokens=3), make_stats(used=9, live_tokens=33)])
    metrics = make_metrics(stats_fn=lambda: next(snapshots))
    assert value(scrape(metrics), "kvserve_kv_cache_blocks", pool="device", state="used") == 1
    assert value(scrape(metrics), "kvserve_kv_cache_blocks", pool="device", state="used") == 9


def test_naming_conventions_hold_for_every_series() -> None:
    metrics = make_metrics()
    metrics.observe_request(RequestRecord("stop", 10, 3, 0, 0.01, 0.1, 0.3, (0.1, 0.1), 1))
    # A counter labelled by an open set (field names, adapter names) has no series until
    # it counts one.
    metrics.count_ignored_field("no_stop_trim")
    metrics.observe_request(RequestRecord("length", 4, 2, 0, 0.0, 0.1, 0.2, (0.1,), 1, "ft"))
    body, _ = metrics.render()
    for family in text_string_to_metric_families(body.decode()):
        if family.name.startswith("process_"):
            continue  # the standard process exporter's names (checked below)
        assert family.name.startswith("kvserve_"), family.name
        for sample in family.samples:
            assert sample.labels.get("model_name") == "tiny", sample
        if family.type == "counter":
            assert any(s.name.endswith("_total") for s in family.samples), family.name


def test_observe_request_fills_histograms_and_finish_counter() -> None:
    metrics = make_metrics()
    metrics.observe_request(RequestRecord("stop", 12, 4, 8, 0.02, 0.2, 0.9, (0.1, 0.3, 0.3), 2))
    metrics.observe_request(RequestRecord("abort", 5, 0, 0, None, None, 0.05, (), 1))
    samples = scrape(metrics)
    assert value(samples, "kvserve_requests_finished_total", finish_reason="stop") == 1
    assert value(samples, "kvserve_requests_finished_total", finish_reason="abort") == 1
    assert value(samples, "kvserve_requests_finished_total", finish_reason="length") == 0
    # The aborted choice never produced a token: no TTFT and no queue time for it.
    assert value(samples, "kvserve_time_to_first_token_seconds_count") == 1
    assert value(samples, "kvserve_time_to_first_token_seconds_sum") == 0.2
    assert value(samples, "kvserve_request_queue_time_seconds_count") == 1
    assert value(samples, "kvserve_inter_token_latency_seconds_count") == 3
    assert value(samples, "kvserve_inter_token_latency_seconds_bucket", le="0.25") == 1
    assert value(samples, "kvserve_e2e_request_latency_seconds_count") == 2
    assert value(samples, "kvserve_request_prompt_tokens_sum") == 17
    assert value(samples, "kvserve_request_generation_tokens_sum") == 4
    assert value(samples, "kvserve_request_kv_blocks_bucket", le="1.0") == 1
    assert value(samples, "kvserve_request_kv_blocks_bucket", le="2.0") == 2


def test_rejections_are_counted_by_reason() -> None:
    metrics = make_metrics()
    metrics.count_rejected("queue_full")
    metrics.count_rejected("queue_full")
    metrics.count_rejected("auth")
    samples = scrape(metrics)
    assert value(samples, "kvserve_requests_rejected_total", reason="queue_full") == 2
    assert value(samples, "kvserve_requests_rejected_total", reason="auth") == 1
    assert value(samples, "kvserve_requests_rejected_total", reason="too_long") == 0


def test_cache_info_carries_configuration_and_bytes_per_token() -> None:
    samples = scrape(make_metrics())
    infos = [labels for (name, labels) in samples if name == "kvserve_cache_config_info"]
    assert len(infos) == 1
    info = dict(infos[0])
    assert info["block_size"] == str(BLOCK_SIZE)
    assert info["num_device_blocks"] == "32"
    assert info["kv_cache_dtype"] == "float16"
    assert info["bytes_per_token"] == str(BYTES_PER_TOKEN)
    assert info["bytes_per_block"] == str(BYTES_PER_TOKEN * BLOCK_SIZE)


def test_a_dead_engine_still_renders_and_reports_unhealthy() -> None:
    def broken_stats() -> EngineStats:
        raise RuntimeError("engine loop died")

    samples = scrape(make_metrics(stats_fn=broken_stats))
    assert value(samples, "kvserve_engine_healthy") == 0
    assert not any(name == "kvserve_kv_cache_usage_ratio" for name, _ in samples)


def test_health_fn_drives_the_health_gauge() -> None:
    samples = scrape(make_metrics(health_fn=lambda: False))
    assert value(samples, "kvserve_engine_healthy") == 0


def test_instances_do_not_share_a_registry() -> None:
    first, second = make_metrics(), make_metrics()
    first.count_rejected("queue_full")
    assert value(scrape(second), "kvserve_requests_rejected_total", reason="queue_full") == 0


def test_process_metrics_come_from_the_same_registry() -> None:
    samples = scrape(make_metrics())
    assert samples[("process_resident_memory_bytes", ())] > 10 * 2**20
    assert samples[("process_open_fds", ())] > 0
    assert samples[("process_cpu_seconds_total", ())] > 0


def test_measured_memory_sits_beside_the_computed_figures() -> None:
    measured = {"kv_cache": 4096, "host_kv_cache": 512}
    samples = scrape(make_metrics(memory_fn=lambda: measured))
    gauge = "kvserve_device_memory_measured_bytes"
    assert value(samples, gauge, component="kv_cache") == 4096
    assert value(samples, gauge, component="host_kv_cache") == 512
    assert value(samples, "kvserve_device_memory_bytes", component="kv_cache") > 0


def test_a_failing_measurement_leaves_the_rest_of_the_scrape() -> None:
    def broken() -> dict[str, int]:
        raise OSError("mincore failed")

    samples = scrape(make_metrics(memory_fn=broken))
    assert value(samples, "kvserve_kv_cache_usage_ratio") == 5 / 32
    assert not any(name == "kvserve_device_memory_measured_bytes" for name, _ in samples)


def widest_step(buckets: tuple[float, ...], low: float, high: float) -> float:
    """The largest ratio between neighbouring bucket bounds inside [low, high]."""
    inside = [b for b in buckets if low <= b <= high]
    return max(b / a for a, b in itertools.pairwise(inside))


def test_latency_buckets_resolve_cpu_and_gpu_ranges_past_the_timeouts() -> None:
    settings = ServerSettings()
    for buckets in (LATENCY_BUCKETS_S, ITL_BUCKETS_S, E2E_BUCKETS_S):
        assert list(buckets) == sorted(set(buckets))
    # TTFT and queue time: 10 ms (a GPU prefill) to a minute (a loaded CPU) in <= 1.5x
    # steps; the committed 32-conversation CPU run's TTFT p99 of 37.7 s falls in (30, 40].
    assert widest_step(LATENCY_BUCKETS_S, 0.01, 60) <= 1.5
    assert 30.0 in LATENCY_BUCKETS_S and 40.0 in LATENCY_BUCKETS_S
    # Inter-token gaps: 5 ms (GPU decode) to 1 s (a CPU step under load) in <= 1.34x steps.
    assert widest_step(ITL_BUCKETS_S, 0.005, 1.0) <= 1.34
    # Past the drain on shutdown and far past any queue timeout a client would wait for.
    assert LATENCY_BUCKETS_S[-1] >= max(settings.shutdown_timeout_s, settings.queue_timeout_s)
    assert LATENCY_BUCKETS_S[-1] >= 2560
    assert E2E_BUCKETS_S[-1] >= LATENCY_BUCKETS_S[-1]


def test_planned_components_complete_the_computed_device_memory() -> None:
    planned = {"activation_reserve": 2048, "copy_staging": 64}
    samples = scrape(make_metrics(planned_bytes=planned))
    gauge = "kvserve_device_memory_bytes"
    assert value(samples, gauge, component="activation_reserve") == 2048
    assert value(samples, gauge, component="copy_staging") == 64
    assert value(samples, gauge, component="weights") == 1234
