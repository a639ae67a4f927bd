"""Aggregate statistics of a run: latency percentiles, throughput, errors, goodput, and
the time series the report plots.

The measured window runs from the run's start to the end of its last request, so ramp-up
and think time count against throughput, as a user of the server would see it.
Cancelled requests (cut off by the run's bound) are neither successes nor errors, but
the tokens they had received count towards throughput (the window includes their time)
and their first-token and inter-token latencies are measured like any other's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from loadtest.client import STATUS_CANCELLED, RequestRecord
from loadtest.config import SLO

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (the numpy default), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    stats: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    stats["mean"] = sum(values) / len(values) if values else None
    stats["max"] = max(values) if values else None
    stats["count"] = len(values)
    return stats


def is_good(record: RequestRecord, slo: SLO) -> bool:
    """Succeeded within the SLO: TTFT and mean inter-token latency under their bounds."""
    if not record.ok or record.ttft is None or record.ttft > slo.ttft_s:
        return False
    return record.tpot is None or record.tpot <= slo.itl_s


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> dict[str, Any]:
    """The aggregate figures of a run, JSON-ready."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok and r.status != STATUS_CANCELLED]
    attempted = len(ok) + len(failed)
    good = [r for r in ok if is_good(r, slo)]
    delivered = [r for r in records if r.ok or r.status == STATUS_CANCELLED]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in delivered)
    output_tokens = sum(r.completion_tokens for r in delivered)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "duration_s": duration_s,
        "requests": {
            "completed": len(ok),
            "failed": len(failed),
            "cancelled": sum(1 for r in records if r.status == STATUS_CANCELLED),
            "error_rate": _rate(len(failed), attempted),
            "errors_by_status": dict(Counter(r.status for r in failed)),
            "usage_reported": sum(1 for r in ok if r.usage_reported),
        },
        "tokens": {
            "prompt": prompt_tokens,
            "output": output_tokens,
            "cached_prompt": sum(cached) if cached else None,
            "cached_fraction": _rate(sum(cached), prompt_tokens) if cached else None,
        },
        "throughput": {
            "request_rate": _rate(len(ok), duration_s),
            "output_tokens_per_s": _rate(output_tokens, duration_s),
            "total_tokens_per_s": _rate(prompt_tokens + output_tokens, duration_s),
        },
        "latency_s": {
            # A request cut off by the bound still measured its first token and gaps.
            "ttft": distribution([r.ttft for r in delivered if r.ttft is not None]),
            "itl": distribution([gap for r in delivered for gap in r.itls]),
            "tpot": distribution([r.tpot for r in ok if r.tpot is not None]),
            "e2e": distribution([r.e2e for r in ok if r.e2e is not None]),
        },
        "longest_output_stall_s": longest_output_stall(records),
        "goodput": {
            "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
            "good_requests": len(good),
            "fraction": _rate(len(good), len(ok)),
            "request_rate": _rate(len(good), duration_s),
            "output_tokens_per_s": _rate(sum(r.completion_tokens for r in good), duration_s),
        },
    }


def longest_output_stall(records: Sequence[RequestRecord]) -> float:
    """The longest time in which no request received a token while some request was in
    flight (the union of the requests' start-to-end intervals). A server that prefills for
    seconds while every stream waits shows it here; ITL percentiles average it away."""
    events = sorted(t for r in records for t in r.chunk_times)
    longest, index = 0.0, 0
    for start, end in _union(
        (r.start, r.end) for r in records if r.end is not None and r.end > r.start
    ):
        while index < len(events) and events[index] <= start:
            index += 1
        previous = start
        while index < len(events) and events[index] < end:
            longest = max(longest, events[index] - previous)
            previous = events[index]
            index += 1
        longest = max(longest, end - previous)
    return longest


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def bin_width(duration_s: float, max_bins: int = 120) -> float:
    """One second per bin, wider for long runs so the plot keeps ~max_bins points."""
    return max(1.0, math.ceil(duration_s / max_bins))


def throughput_series(
    records: Sequence[RequestRecord], duration_s: float
) -> list[dict[str, float]]:
    """Output tokens per second over time, from each chunk's arrival time.

    A chunk is weighted by its request's tokens per chunk, so servers that pack several
    tokens into one chunk still sum to the reported completion tokens.
    """
    width = bin_width(duration_s)
    num_bins = max(1, math.ceil(duration_s / width))
    tokens = [0.0] * num_bins
    for record in records:
        if not record.chunk_times:
            continue
        per_chunk = max(record.completion_tokens, 1) / len(record.chunk_times)
        for t in record.chunk_times:
            tokens[min(num_bins - 1, int(t // width))] += per_chunk
    return [
        {"t": (i + 0.5) * width, "output_tokens_per_s": count / width}
        for i, count in enumerate(tokens)
    ]


def metric_deltas(samples: Sequence[dict[str, float]], keys: Sequence[str]) -> dict[str, float]:
    """Increase of each counter between the first and the last scrape that report it."""
    deltas: dict[str, float] = {}
    for key in keys:
        values = [s[key] for s in samples if key in s]
        if values:
            deltas[key] = values[-1] - values[0]
    return deltas


def metric_peaks(samples: Sequence[dict[str, float]], keys: Sequence[str]) -> dict[str, float]:
    peaks: dict[str, float] = {}
    for key in keys:
        values = [s[key] for s in samples if key in s]
        if values:
            peaks[key] = max(values)
    return peaks
