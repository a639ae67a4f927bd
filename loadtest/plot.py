"""The one-page PNG report (matplotlib, Agg backend: no display needed).

Top row, over time: KV cache usage, requests running/waiting/swapped, output throughput.
Bottom row: TTFT and inter-token latency distributions (ITL on a log axis: its tail spans
orders of magnitude), and the server's preemption and swap counters (left axis) beside
prefix-cache hit tokens (right axis: tokens, not events). Panels without data say so
instead of vanishing. The title names the model and the load, not the server's address.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # the Agg backend is chosen above, before pyplot loads
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from loadtest.stats import percentile

Samples = Sequence[dict[str, float]]


def _no_data(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="gray")


def _series(ax: Axes, samples: Samples, key: str, label: str, scale: float = 1.0) -> bool:
    points = [(s["t"], s[key] * scale) for s in samples if key in s]
    if not points:
        return False
    ax.plot([t for t, _ in points], [v for _, v in points], label=label)
    return True


def _counter_series(ax: Axes, samples: Samples, key: str, label: str) -> bool:
    points = [(s["t"], s[key]) for s in samples if key in s]
    if not points:
        return False
    base = points[0][1]
    ax.plot([t for t, _ in points], [v - base for _, v in points], label=label)
    return True


def _kv_panel(ax: Axes, samples: Samples) -> None:
    ax.set_title("KV cache usage (server)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("% of device blocks")
    if not _series(ax, samples, "kv_usage_ratio", "device", 100.0):
        _no_data(ax, "no KV usage metric")
        return
    ax.set_ylim(0, 105)


def _queue_panel(ax: Axes, samples: Samples) -> None:
    ax.set_title("Requests in the server")
    ax.set_xlabel("time (s)")
    drawn = [
        _series(ax, samples, key, label)
        for key, label in (
            ("num_running", "running"),
            ("num_waiting", "waiting"),
            ("num_swapped", "swapped"),
        )
    ]
    if any(drawn):
        ax.legend(loc="upper right", fontsize="small")
    else:
        _no_data(ax, "no running/waiting metrics")


def _throughput_panel(ax: Axes, series: Sequence[dict[str, float]]) -> None:
    ax.set_title("Output throughput (client)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("tokens/s")
    if not series:
        _no_data(ax, "no tokens received")
        return
    ax.plot([p["t"] for p in series], [p["output_tokens_per_s"] for p in series])


def _histogram(ax: Axes, values_s: Sequence[float], title: str, log: bool = False) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms (log scale)" if log else "ms")
    ax.set_ylabel("count")
    if not values_s:
        _no_data(ax, "no samples")
        return
    values_ms = [v * 1000 for v in values_s]
    count = min(50, max(5, len(values_ms) // 4))
    positive = [v for v in values_ms if v > 0]
    if log and positive and max(positive) > min(positive):
        low, high = math.log10(min(positive)), math.log10(max(positive))
        bins: Any = [10 ** (low + (high - low) * i / count) for i in range(count + 1)]
        ax.hist(positive, bins=bins)
        ax.set_xscale("log")
    else:
        ax.hist(values_ms, bins=count)
    for q, style in ((50, "--"), (99, ":")):
        mark = percentile(values_ms, q) or 0.0
        ax.axvline(mark, color="black", linestyle=style, label=f"p{q} {mark:.0f} ms")
    ax.legend(fontsize="small")


def _events_panel(ax: Axes, samples: Samples) -> None:
    ax.set_title("Preemptions and swaps; prefix-cache hits (since start)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("preemptions, blocks swapped")
    drawn = [
        _counter_series(ax, samples, key, label)
        for key, label in (
            ("preemptions_total", "preemptions"),
            ("blocks_swapped_out_total", "blocks swapped out"),
            ("blocks_swapped_in_total", "blocks swapped in"),
        )
    ]
    tokens = ax.twinx()
    tokens.set_ylabel("prefix-cache hit tokens")
    hits = _counter_series(tokens, samples, "prefix_cache_hits_total", "prefix-cache hit tokens")
    for line in tokens.get_lines():
        line.set_color("tab:purple")
        line.set_linestyle("--")
    if not any(drawn) and not hits:
        _no_data(ax, "no preemption/swap/prefix metrics")
        return
    handles = ax.get_lines() + tokens.get_lines()
    labels = [str(h.get_label()) for h in handles]
    ax.legend(handles, labels, loc="upper left", fontsize="small")


def plot_report(document: dict[str, Any], path: Path) -> None:
    """Draw the report of a run's JSON document into ``path`` (PNG)."""
    fig = draw_report(document)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def draw_report(document: dict[str, Any]) -> Figure:
    """The report's figure (the caller saves and closes it)."""
    samples = document["timeseries"]["server_metrics"]
    latency_records = [r for r in document["requests"] if r["status"] in ("ok", "cancelled")]
    ttfts = [r["ttft"] for r in latency_records if r["ttft"] is not None]
    itls = [b - a for r in latency_records for a, b in itertools.pairwise(r["chunk_times"])]
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    _kv_panel(axes[0][0], samples)
    _queue_panel(axes[0][1], samples)
    _throughput_panel(axes[0][2], document["timeseries"]["throughput"])
    _histogram(axes[1][0], ttfts, "Time to first token")
    _histogram(axes[1][1], itls, "Inter-token latency", log=True)
    _events_panel(axes[1][2], samples)
    summary = document["summary"]
    fig.suptitle(
        f"{document['target']['model']}  |  "
        f"{document['config']['concurrency']} conversations x {document['config']['turns']} turns"
        f"  |  {summary['throughput']['output_tokens_per_s']:.1f} out tok/s  |  "
        f"{summary['requests']['completed']} ok, {summary['requests']['failed']} failed"
    )
    fig.tight_layout()
    return fig
