"""Summarise the load-test results of bench/compare_servers.py as a Markdown table.

Reads OUT/<server>-c<C>.json and writes OUT/summary.md: per server and concurrency the
output throughput, TTFT/ITL/e2e medians, output tokens per finished request, requests
finished / cut off by the run's duration bound / failed, and the
server-side preemptions/swaps, plus each server's throughput and TTFT as a ratio to
kvserve at the same concurrency.

    python bench/compare_report.py bench/results

Given two result sets (two ``--out`` directories, e.g. the same command before and after
a change), it compares them instead: per server and concurrency found in both, output
tokens/s, TTFT p50 and ITL p50 of each, and NEW / OLD for each (printed, nothing written):

    python bench/compare_report.py bench/results/OLD bench/results/NEW
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


def _quotient(new: float | None, old: float | None) -> str:
    if new is None or old is None or old == 0:
        return "-"
    return f"{new / old:.2f}x"


def compare_sets(old_dir: Path, new_dir: Path) -> str:
    """Two result sets side by side: NEW / OLD per server and concurrency in both."""
    old, new = load_results(old_dir), load_results(new_dir)
    header = (
        f"OLD = {old_dir}, NEW = {new_dir}\n\n"
        "| server | conv. | out tok/s OLD | NEW | NEW/OLD | TTFT p50 ms OLD | NEW | NEW/OLD "
        "| ITL p50 ms OLD | NEW | NEW/OLD |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = []
    for key in sorted(old.keys() & new.keys(), key=lambda k: (k[1], k[0])):
        cells = [key[0], str(key[1])]
        a, b = old[key]["summary"], new[key]["summary"]
        tput_a = a["throughput"]["output_tokens_per_s"]
        tput_b = b["throughput"]["output_tokens_per_s"]
        cells += [f"{tput_a:.1f}", f"{tput_b:.1f}", _quotient(tput_b, tput_a)]
        for metric in ("ttft", "itl"):
            va, vb = a["latency_s"][metric]["p50"], b["latency_s"][metric]["p50"]
            cells += [_ms(va), _ms(vb), _quotient(vb, va)]
        rows.append("| " + " | ".join(cells) + " |")
    only = sorted(old.keys() ^ new.keys())
    tail = [f"\nIn one set only: {', '.join(f'{s}-c{c}' for s, c in only)}"] if only else []
    return "\n".join([header, *rows, *tail])


if __name__ == "__main__":
    if len(sys.argv) == 3:
        print(compare_sets(Path(sys.argv[1]), Path(sys.argv[2])))
    else:
        print(write_summary(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results")))
