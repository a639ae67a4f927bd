"""Summarise the load-test results of bench/compare_servers.py as a Markdown table.

Reads OUT/<server>-c<C>.json and writes OUT/summary.md: per server and concurrency the
output throughput, TTFT/ITL/e2e medians, output tokens per finished request, requests
finished / cut off by the run's duration bound / failed, and the
server-side preemptions/swaps, plus each server's throughput and TTFT as a ratio to
kvserve at the same concurrency.

    python bench/compare_report.py bench/results
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

RESULT_NAME = re.compile(r"^(?P<server>.+)-c(?P<concurrency>\d+)\.json$")
BASELINE = "kvserve"


def load_results(out: Path) -> dict[tuple[str, int], dict[str, Any]]:
    results: dict[tuple[str, int], dict[str, Any]] = {}
    for path in sorted(out.glob("*-c*.json")):
        match = RESULT_NAME.match(path.name)
        if match:
            key = (match["server"], int(match["concurrency"]))
            results[key] = json.loads(path.read_text())
    return results


def load_averages(out: Path) -> dict[tuple[str, int], str]:
    """The 1-minute load average before/after each run, from runs.jsonl (latest wins)."""
    loads: dict[tuple[str, int], str] = {}
    runs = out / "runs.jsonl"
    if runs.exists():
        for line in runs.read_text().splitlines():
            run = json.loads(line)
            loads[(run["server"], run["concurrency"])] = (
                f"{run['load_before']:.1f}/{run['load_after']:.1f}"
            )
    return loads


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _ratio(value: float | None, baseline: float | None) -> str:
    if value is None or baseline is None or value == 0:
        return "-"
    return f"{baseline / value:.2f}x"


def _row(
    server: str, concurrency: int, doc: dict[str, Any], base: dict[str, Any] | None, load: str
) -> str:
    summary = doc["summary"]
    requests, latency = summary["requests"], summary["latency_s"]
    throughput = summary["throughput"]["output_tokens_per_s"]
    finished = [r["completion_tokens"] for r in doc["requests"] if r["status"] == "ok"]
    tokens_per_request = sum(finished) / max(1, len(finished))
    increase = doc["server_metrics"]["increase"]
    preempted = increase.get("preemptions_total", 0)
    swapped_out = increase.get("blocks_swapped_out_total", 0)
    kv_events = f"{preempted:g} / {swapped_out:g}" if doc["server_metrics"]["available"] else "n/a"
    base_summary = base["summary"] if base else None
    # Ratios say how many times better kvserve is: throughput kvserve/other, TTFT other/kvserve.
    tput_ratio = (
        _ratio(throughput, base_summary["throughput"]["output_tokens_per_s"])
        if base_summary
        else "-"
    )
    ttft = latency["ttft"]["p50"]
    ttft_ratio = _ratio(base_summary["latency_s"]["ttft"]["p50"], ttft) if base_summary else "-"
    return (
        f"| {server} | {concurrency} | {requests['completed']} | {requests['cancelled']} | "
        f"{requests['failed']} | "
        f"{tokens_per_request:.0f} | {throughput:.1f} | {_ms(ttft)} | "
        f"{_ms(latency['itl']['p50'])} | {_ms(latency['itl']['p99'])} | "
        f"{_ms(summary.get('longest_output_stall_s'))} | "
        f"{_ms(latency['e2e']['p50'])} | {kv_events} | "
        f"{tput_ratio} | {ttft_ratio} | {load} |"
    )


def summary_table(
    results: dict[tuple[str, int], dict[str, Any]], loads: dict[tuple[str, int], str]
) -> str:
    header = (
        "| server | conv. | ok | cut off | failed | out tok/req | out tok/s | TTFT p50 ms "
        "| ITL p50 ms | ITL p99 ms | longest stall ms | e2e p50 ms "
        "| preempt / swap-out blocks | kvserve tok/s ratio | kvserve TTFT ratio | load avg |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [
        _row(
            server,
            concurrency,
            doc,
            results.get((BASELINE, concurrency)),
            loads.get((server, concurrency), "-"),
        )
        for (server, concurrency), doc in sorted(
            results.items(), key=lambda kv: (kv[0][1], kv[0][0])
        )
    ]
    return "\n".join([header, *rows])


def write_summary(out: Path) -> str:
    text = summary_table(load_results(out), load_averages(out)) + "\n"
    (out / "summary.md").write_text(text)
    return text


if __name__ == "__main__":
    print(write_summary(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results")))
