"""bench/floor_report.py: each single-stream run held against the bandwidth of its minute."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import compare_servers  # noqa: E402  (bench/ is not a package: imported by path)

from bench.floor_report import report, run_rows  # noqa: E402


def write_run(out: Path, round_name: str, server: str, itl: float, bandwidth: float | None) -> None:
    directory = out / round_name
    directory.mkdir(parents=True, exist_ok=True)
    record: dict[str, object] = {"server": server, "concurrency": 1}
    if bandwidth is not None:
        record |= {"read_bandwidth_before": bandwidth, "read_bandwidth_after": bandwidth * 1.1}
    with (directory / "runs.jsonl").open("a") as runs:
        runs.write(json.dumps(record) + "\n")
    summary = {"summary": {"latency_s": {"itl": {"p50": itl}}}}
    (directory / f"{server}-c1.json").write_text(json.dumps(summary))


def test_runs_are_read_in_round_order_with_their_own_bandwidth(tmp_path: Path) -> None:
    for index in (10, 2, 1):  # round10 sorts after round2 by number, not by name
        write_run(tmp_path, f"round{index}", "kvserve-int4", 0.001 * index, 20e9 + index)
    write_run(tmp_path, "round1", "kvserve-int8", 0.007, None)  # measured without bandwidth
    write_run(tmp_path, "round1", "llama-server", 0.005, 25e9)  # not a kvserve format
    rows = run_rows(tmp_path, concurrency=1)
    assert [(r[0], r[1]) for r in rows] == [
        ("round1", "kvserve-int4"),
        ("round2", "kvserve-int4"),
        ("round10", "kvserve-int4"),
    ]
    assert rows[2][2:] == pytest.approx((0.010, 20e9 + 10, (20e9 + 10) * 1.1))


def test_the_floor_is_the_bytes_over_the_mean_of_the_two_readings() -> None:
    # 100 MB at a mean of 25 GB/s: a 4 ms floor; 5 ms and 6 ms gaps are 1.25x and 1.5x.
    rows = [
        ("round1", "kvserve-int4", 0.005, 20e9, 30e9),
        ("round2", "kvserve-int4", 0.006, 25e9, 25e9),
    ]
    text = report(rows, {"kvserve-int4": 100_000_000})
    assert "| round1 | kvserve-int4 | 5.00 ms | 20.0 / 30.0 GB/s | 4.00 ms | 1.25x |" in text
    assert "| kvserve-int4 | 100 MB | 2 | 1.38x | 1.50x |" in text


def test_bandwidth_is_measured_only_when_asked() -> None:
    args = compare_servers.parse_args(["--servers", "kvserve", "--threads", "2"])
    assert compare_servers.read_bandwidth(args) is None
    args = compare_servers.parse_args(
        ["--servers", "kvserve", "--threads", "2", "--read-bandwidth"]
    )
    assert 1e8 < compare_servers.read_bandwidth(args) < 1e13  # bytes/s, a real torch sum
