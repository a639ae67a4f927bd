"""Prometheus families of the tiered prefix cache (engine/kv/tiers.py), one label ``tier``.

kvserve_kv_tier_capacity_blocks{tier}      gauge    blocks the tier can hold
kvserve_kv_tier_used_blocks{tier}          gauge    blocks it holds now
kvserve_kv_tier_used_bytes{tier}           gauge    bytes it holds now
kvserve_kv_tier_capacity_bytes{tier}       gauge    its size bound
kvserve_kv_tier_hits_total{tier}           counter  blocks found there at admission
kvserve_kv_tier_misses_total{tier}         counter  blocks asked of it and missing
kvserve_kv_tier_bytes_total{tier,direction} counter bytes stored (in) / loaded (out)
kvserve_kv_tier_load_seconds_total{tier}   counter  time spent loading blocks back
kvserve_kv_tier_dropped_writes_total{tier} counter  stores dropped (writer busy or stopped)
kvserve_kv_tier_failed_loads_total{tier}   counter  loads rejected (missing, corrupt)
kvserve_kv_tier_in_step_stores_total{tier} counter  blocks stored inside a step (evictions
                                                    outran the write-ahead beside the forward)
kvserve_num_requests_loading               gauge    requests loading a prefix back

The disk tier's own (engine/kv/disk_store.py), only with --kv-cache-disk-dir:

kvserve_kv_disk_rejected_entries_total{reason} counter entries refused (empty, truncated,
                                                    oversized, header, checksum: deleted;
                                                    fingerprint: another configuration's)
kvserve_kv_disk_removed_temp_files_total   counter  crashed writes' temporary files removed
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.outputs import EngineStats, TierStats

PREFIX = "kvserve_"

_GAUGES = (
    ("capacity_blocks", "Blocks the prefix-cache tier can hold.", "capacity_blocks"),
    ("used_blocks", "Blocks the prefix-cache tier holds.", "used_blocks"),
    ("used_bytes", "Bytes the prefix-cache tier holds.", "used_bytes"),
    ("capacity_bytes", "Size bound of the prefix-cache tier.", "capacity_bytes"),
)
_COUNTERS = (
    ("hits", "Prefix blocks found in the tier at admission.", "hits_total"),
    ("misses", "Prefix blocks asked of the tier and not found.", "misses_total"),
    ("load_seconds", "Seconds spent loading blocks back from the tier.", "load_seconds_total"),
    ("dropped_writes", "Block stores dropped (writer busy or stopped).", "dropped_writes_total"),
    ("failed_loads", "Block loads rejected (missing, corrupt).", "failed_loads_total"),
    (
        "in_step_stores",
        "Blocks stored into the tier inside a step instead of written ahead beside it.",
        "in_step_stores_total",
    ),
)


def tier_families(model: str, stats: EngineStats) -> Iterator[Metric]:
    """The families above; the tier gauges and counters only list the enabled tiers."""
    loading = GaugeMetricFamily(
        PREFIX + "num_requests_loading",
        "Sequences loading a prefix back from a cache tier.",
        labels=["model_name"],
    )
    loading.add_metric([model], stats.num_loading)
    yield loading
    if not stats.tiers:  # no tier configured: no family to list (nor empty counters)
        return
    for name, doc, field in _GAUGES:
        gauge = GaugeMetricFamily(PREFIX + f"kv_tier_{name}", doc, labels=["model_name", "tier"])
        for tier in stats.tiers:
            gauge.add_metric([model, tier.name], getattr(tier, field))
        yield gauge
    for name, doc, field in _COUNTERS:
        counter = CounterMetricFamily(
            PREFIX + f"kv_tier_{name}", doc, labels=["model_name", "tier"]
        )
        for tier in stats.tiers:
            counter.add_metric([model, tier.name], getattr(tier, field))
        yield counter
    moved = CounterMetricFamily(
        PREFIX + "kv_tier_bytes",
        "Bytes moved into (direction=in: stored) and out of (out: loaded) the tier.",
        labels=["model_name", "tier", "direction"],
    )
    for tier in stats.tiers:
        moved.add_metric([model, tier.name, "in"], tier.stored_bytes_total)
        moved.add_metric([model, tier.name, "out"], tier.loaded_bytes_total)
    yield moved
    yield from _disk_families(model, stats.tiers)


def _disk_families(model: str, tiers: Sequence[TierStats]) -> Iterator[Metric]:
    disk = next((tier for tier in tiers if tier.name == "disk"), None)
    if disk is None:
        return
    rejected = CounterMetricFamily(
        PREFIX + "kv_disk_rejected_entries",
        "Disk-tier entries refused, by reason (all but fingerprint are deleted).",
        labels=["model_name", "reason"],
    )
    for reason, count in disk.rejected_entries_total:
        rejected.add_metric([model, reason], count)
    yield rejected
    removed = CounterMetricFamily(
        PREFIX + "kv_disk_removed_temp_files",
        "Temporary files of disk-tier writes a crash cut short, removed at start-up.",
        labels=["model_name"],
    )
    removed.add_metric([model], disk.removed_temp_files_total)
    yield removed
