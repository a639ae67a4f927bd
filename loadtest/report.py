"""The run's outputs: a JSON result, a one-page PNG report and a short text summary."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from loadtest.client import STATUS_CANCELLED
from loadtest.replica_report import replicas_section
from loadtest.runner import RunResult
from loadtest.scrape import COUNTER_KEYS, METRICS
from loadtest.stats import metric_deltas, metric_peaks, summarize, throughput_series

GAUGE_KEYS: tuple[str, ...] = tuple(m.key for m in METRICS if m.key not in COUNTER_KEYS)
JSON_SCHEMA_VERSION = 1


def build_result(result: RunResult) -> dict[str, Any]:
    """The JSON document of a run: config, summary, server metrics, series, requests.

    ``server_metrics`` is the scrape of ``target.url`` (the router, or the first of several
    direct targets); ``replicas`` holds the per-replica figures of
    ``config.scraped_replicas`` (``loadtest.replica_report``), empty without replicas.
    """
    delivered = [r for r in result.records if r.ok or r.status == STATUS_CANCELLED]
    summary = summarize(result.records, result.duration_s, result.config.slo)
    config = dataclasses.asdict(result.config)
    config["user_len"] = result.config.user_len.describe()
    config.pop("api_key", None)  # never write a credential into a result file
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "started_at": result.started_at,
        "target": {
            "url": result.config.base_url,
            "model": result.model,
            "urls": list(result.config.target_urls),
            "routing": result.config.routing,
        },
        "config": config,
        "stopped_by": result.stopped_by,
        "summary": summary,
        "server_metrics": {
            "available": result.metrics_available,
            "increase": metric_deltas(result.metric_samples, COUNTER_KEYS),
            "peak": metric_peaks(result.metric_samples, GAUGE_KEYS),
        },
        "timeseries": {
            "throughput": throughput_series(delivered, result.duration_s),
            "server_metrics": result.metric_samples,
        },
        "replicas": replicas_section(result.replicas, result.records, result.config.target_urls),
        "requests": [r.to_json() for r in result.records],
    }


def write_json(document: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def format_summary(document: dict[str, Any]) -> str:
    """A few lines a person reads after the run."""
    summary = document["summary"]
    requests, tokens = summary["requests"], summary["tokens"]
    throughput, latency, goodput = summary["throughput"], summary["latency_s"], summary["goodput"]
    lines = [
        f"target {document['target']['url']}  model {document['target']['model']}  "
        f"stopped by {document['stopped_by']}  {summary['duration_s']:.1f} s",
        f"requests  {requests['completed']} ok, {requests['failed']} failed "
        f"({requests['error_rate']:.1%}), {requests['cancelled']} cancelled"
        + (f"  {requests['errors_by_status']}" if requests["errors_by_status"] else ""),
        f"tokens    prompt {tokens['prompt']}  output {tokens['output']}"
        + (f"  cached prompt {tokens['cached_prompt']}" if tokens["cached_prompt"] else ""),
        f"throughput  {throughput['output_tokens_per_s']:.1f} out tok/s  "
        f"{throughput['total_tokens_per_s']:.1f} total tok/s  "
        f"{throughput['request_rate']:.2f} req/s",
    ]
    for name in ("ttft", "itl", "e2e"):
        dist = latency[name]
        lines.append(
            f"{name:<5} p50 {_ms(dist['p50'])}  p90 {_ms(dist['p90'])}  "
            f"p99 {_ms(dist['p99'])}  (n={dist['count']})"
        )
    if "longest_output_stall_s" in summary:
        lines.append(
            f"stall    longest {_ms(summary['longest_output_stall_s'])} with no token "
            "while requests were in flight"
        )
    slo = goodput["slo"]
    lines.append(
        f"goodput  {goodput['fraction']:.1%} of requests within TTFT<={slo['ttft_s']}s, "
        f"ITL<={slo['itl_s']}s  ({goodput['output_tokens_per_s']:.1f} out tok/s)"
    )
    server = document["server_metrics"]
    if server["available"]:
        shown = {**server["increase"], **server["peak"]}
        lines.append("server   " + "  ".join(f"{k} {v:g}" for k, v in sorted(shown.items())))
    else:
        lines.append("server   no Prometheus /metrics found")
    lines.extend(_replica_lines(document.get("replicas") or {}))
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _replica_lines(replicas: dict[str, Any]) -> list[str]:
    """One line per replica and one for their sum (none without replicas)."""
    rows = [*replicas.get("per_replica", []), {"url": "all", **replicas.get("aggregate", {})}]
    if len(rows) < 2:
        return []
    lines = []
    for row in rows:
        ttft = row.get("ttft_s") or {}
        state = "" if row.get("reachable_at_end", True) else "  (unreachable at the end)"
        lines.append(
            f"replica  {row['url']}  requests {row.get('requests_finished') or 0:g}  "
            f"prefix hits {_ratio(row.get('prefix_cache_hit_rate'))}  "
            f"generated {row.get('generation_tokens') or 0:g}  "
            f"server TTFT p50 {_ms(ttft.get('p50'))} p95 {_ms(ttft.get('p95'))}{state}"
        )
    return lines
