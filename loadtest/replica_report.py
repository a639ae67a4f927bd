"""Per-replica figures of a run, from the replicas' own counters (``loadtest.replicas``)
and, when the load tester chose the replica itself, from its own records too.

Each replica's figures are counter increases from its baseline scrape to its last good
one: requests finished, prompt and generated tokens, prefix-cache hit rate (hit tokens
over queried tokens) and TTFT (mean from the histogram's sum and count, p50/p95
interpolated within its buckets as Prometheus' ``histogram_quantile`` does). The
aggregate sums the counters (so the per-replica requests add up to its total) and merges
the histograms; a replica that kept serving other clients counts their work as well.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from loadtest.client import STATUS_CANCELLED, RequestRecord
from loadtest.replicas import ReplicaState
from loadtest.stats import percentile

COUNTER_FIGURES: tuple[str, ...] = (
    "requests_finished",
    "prompt_tokens",
    "generation_tokens",
    "prefix_cache_queried_tokens",
    "prefix_cache_hit_tokens",
)


def _increase(before: float | None, after: float | None) -> float | None:
    """A counter's increase; a smaller value means the replica restarted (counted from 0)."""
    if after is None:
        return None
    if before is None or after < before:
        return after
    return after - before


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The ``q`` quantile (0..1) of cumulative bucket counts, linear within a bucket."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bound: report that bound
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _bucket_increase(state: ReplicaState) -> dict[float, float]:
    if state.last is None:
        return {}
    first = state.first.ttft_buckets if state.first is not None else {}
    return {
        bound: _increase(first.get(bound), count) or 0.0
        for bound, count in state.last.ttft_buckets.items()
    }


def _ttft(count: float | None, total: float | None, buckets: dict[float, float]) -> dict[str, Any]:
    return {
        "count": count,
        "mean": total / count if count and total is not None else None,
        "p50": histogram_quantile(0.50, buckets),
        "p95": histogram_quantile(0.95, buckets),
    }


def _hit_rate(figures: dict[str, Any]) -> float | None:
    queried = figures.get("prefix_cache_queried_tokens")
    hits = figures.get("prefix_cache_hit_tokens")
    return hits / queried if queried and hits is not None else None


def _client_figures(records: Sequence[RequestRecord], url: str) -> dict[str, Any]:
    """What the load tester itself saw of the requests it sent to ``url``."""
    mine = [r for r in records if r.target == url]
    ttfts = [r.ttft for r in mine if r.ok and r.ttft is not None]
    return {
        "sent": len(mine),
        "completed": sum(1 for r in mine if r.ok),
        "failed": sum(1 for r in mine if not r.ok and r.status != STATUS_CANCELLED),
        "ttft_s": {"p50": percentile(ttfts, 50), "p95": percentile(ttfts, 95)},
    }


def replica_figures(state: ReplicaState) -> dict[str, Any]:
    """One replica's counter increases over the run (``None`` where never scraped)."""
    before = state.first.counters if state.first is not None else {}
    after = state.last.counters if state.last is not None else {}
    figures: dict[str, Any] = {
        "url": state.url,
        "available": state.first is not None,
        "reachable_at_end": state.reachable_at_end,
        "scrape_failures": state.failures,
        "last_scrape_t": state.last.t if state.last is not None else None,
    }
    for key in COUNTER_FIGURES:
        figures[key] = _increase(before.get(key), after.get(key))
    figures["prefix_cache_hit_rate"] = _hit_rate(figures)
    figures["ttft_s"] = _ttft(
        _increase(before.get("ttft_count"), after.get("ttft_count")),
        _increase(before.get("ttft_sum"), after.get("ttft_sum")),
        _bucket_increase(state),
    )
    return figures


def _aggregate(states: Sequence[ReplicaState], per_replica: list[dict[str, Any]]) -> dict[str, Any]:
    totals: dict[str, Any] = {
        key: sum(f[key] for f in per_replica if f[key] is not None) for key in COUNTER_FIGURES
    }
    totals["prefix_cache_hit_rate"] = _hit_rate(totals)
    buckets: dict[float, float] = {}
    for state in states:
        for bound, count in _bucket_increase(state).items():
            buckets[bound] = buckets.get(bound, 0.0) + count
    counts = [f["ttft_s"]["count"] for f in per_replica if f["ttft_s"]["count"] is not None]
    sums = [f["ttft_s"]["mean"] * f["ttft_s"]["count"] for f in per_replica if f["ttft_s"]["mean"]]
    totals["ttft_s"] = _ttft(sum(counts), sum(sums), buckets)
    return totals


def replicas_section(
    states: Sequence[ReplicaState], records: Sequence[RequestRecord], targets: tuple[str, ...]
) -> dict[str, Any]:
    """The ``replicas`` part of the JSON result: per replica and aggregate.

    ``per_replica[i]["share_of_requests"]`` is its part of the summed requests; when the
    load tester sent to a replica itself (``targets`` holds its URL) ``client`` holds the
    requests it sent there and their client-side TTFT.
    """
    per_replica = [replica_figures(state) for state in states]
    aggregate = _aggregate(states, per_replica)
    for figures in per_replica:
        total, mine = aggregate["requests_finished"], figures["requests_finished"]
        figures["share_of_requests"] = mine / total if total and mine is not None else None
        if figures["url"] in targets:
            figures["client"] = _client_figures(records, figures["url"])
    return {"per_replica": per_replica, "aggregate": aggregate}
