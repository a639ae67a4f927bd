"""Figures of a load-test run during which one replica was killed: who failed, how fast
they learned it, and the throughput before and after.

All times are seconds since the run's start (the records' clock); ``kill_t`` is when
the replica got SIGKILL. A request "hung" if it never ended or ran into the client's
request timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

RECOVERY_WINDOW_S = 5.0  # the first seconds after the kill, reported on their own


def _tokens_between(records: Sequence[dict[str, Any]], start: float, end: float) -> int:
    return sum(1 for r in records for t in r["chunk_times"] if start <= t < end)


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def failover_figures(
    doc: dict[str, Any], kill_t: float, victim_url: str, request_timeout_s: float
) -> dict[str, Any]:
    """The failover part of a result (``doc`` is ``loadtest.report.build_result``'s)."""
    records = doc["requests"]
    failed = [r for r in records if r["status"] not in ("ok", "cancelled")]
    end = max((r["end"] for r in records if r["end"] is not None), default=kill_t)
    recovered = kill_t + RECOVERY_WINDOW_S
    hung = [r for r in records if r["end"] is None or (r["e2e"] or 0) >= request_timeout_s]
    per_replica = {r["url"]: r["requests_finished"] for r in doc["replicas"]["per_replica"]}
    return {
        "kill_at_s": round(kill_t, 3),
        "victim": victim_url,
        "failed_requests": len(failed),
        "failed_by_status": sorted({r["status"] for r in failed}),
        "failed_in_flight_at_kill": sum(1 for r in failed if r["start"] <= kill_t),
        "failed_started_after_kill": sum(1 for r in failed if r["start"] > kill_t),
        "slowest_failure_after_kill_s": max(
            (r["end"] - kill_t for r in failed if r["end"] is not None), default=None
        ),
        "max_e2e_s": max((r["e2e"] for r in records if r["e2e"] is not None), default=None),
        "hung_requests": len(hung),
        "victim_requests_finished": per_replica.get(victim_url),
        "survivor_requests_finished": sum(
            n for url, n in per_replica.items() if url != victim_url and n is not None
        ),
        "out_tok_s_before_kill": _rate(_tokens_between(records, 0.0, kill_t), kill_t),
        "out_tok_s_first_5s_after": _rate(
            _tokens_between(records, kill_t, recovered), RECOVERY_WINDOW_S
        ),
        "out_tok_s_after": _rate(_tokens_between(records, recovered, end), end - recovered),
    }
