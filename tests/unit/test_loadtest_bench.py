"""bench/compare_report.py: the side-by-side table from load-test result files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from loadtest.client import RequestRecord
from loadtest.config import LoadTestConfig
from loadtest.report import build_result, write_json
from loadtest.runner import RunResult

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from compare_report import compare_sets, write_summary  # bench/ is not a package: imported by path


def _result(ttft: float, tokens: int, duration_s: float) -> dict[str, object]:
    """One ok request with ``tokens`` chunks 10 ms apart after ``ttft``."""
    times = [ttft + 0.01 * i for i in range(tokens)]
    record = RequestRecord(
        0,
        0,
        start=0.0,
        first_token_time=times[0],
        end=times[-1],
        chunk_times=times,
        prompt_tokens=50,
        completion_tokens=tokens,
        usage_reported=True,
    )
    return build_result(
        RunResult(
            config=LoadTestConfig(concurrency=8),
            model="m",
            started_at="t",
            duration_s=duration_s,
            stopped_by="completed",
            records=[record],
        )
    )


def test_summary_has_ratios_to_kvserve(tmp_path: Path) -> None:
    write_json(_result(ttft=0.5, tokens=100, duration_s=2.0), tmp_path / "kvserve-c8.json")
    write_json(_result(ttft=2.0, tokens=100, duration_s=8.0), tmp_path / "llamacpp-c8.json")
    run = {"server": "llamacpp", "concurrency": 8, "load_before": 1.5, "load_after": 2.0}
    (tmp_path / "runs.jsonl").write_text(json.dumps(run) + "\n")
    text = write_summary(tmp_path)
    assert (tmp_path / "summary.md").read_text() == text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()[2:]}
    assert set(rows) == {"kvserve", "llamacpp"}
    kvserve = [cell.strip() for cell in rows["kvserve"].split("|")[1:-1]]
    llamacpp = [cell.strip() for cell in rows["llamacpp"].split("|")[1:-1]]
    assert kvserve[2:5] == ["1", "0", "0"]  # ok, cut off, failed
    assert kvserve[5] == "100"  # output tokens per finished request
    assert kvserve[6] == "50.0" and llamacpp[6] == "12.5"  # output tokens per second
    assert kvserve[7] == "500" and llamacpp[7] == "2000"  # TTFT p50, ms
    assert llamacpp[13:] == ["4.00x", "4.00x", "1.5/2.0"]  # kvserve is 4x better on both
    assert kvserve[13:] == ["1.00x", "1.00x", "-"]


def test_two_result_sets_compared(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    write_json(_result(ttft=0.5, tokens=100, duration_s=2.0), old / "kvserve-c8.json")
    write_json(_result(ttft=0.25, tokens=100, duration_s=1.0), new / "kvserve-c8.json")
    write_json(_result(ttft=2.0, tokens=100, duration_s=8.0), new / "llamacpp-c8.json")
    text = compare_sets(old, new)
    row = next(line for line in text.splitlines() if line.startswith("| kvserve |"))
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert cells == ["kvserve", "8", "50.0", "100.0", "2.00x", "500", "250", "0.50x", *cells[8:]]
    assert "In one set only: llamacpp-c8" in text
