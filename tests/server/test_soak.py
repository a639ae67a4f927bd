"""The bounded soak (bench/soak.py) as a test: ~30 s of concurrent long conversations with
random mid-stream disconnects against a real server whose KV budget is far below the
demand. Zero 5xx, zero hung requests, zero leaked blocks, check_integrity clean."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import SoakConfig, run_soak

pytestmark = pytest.mark.slow


def test_bounded_soak_loses_nothing_and_leaks_nothing(tiny_model_dir: Path):
    config = SoakConfig(duration_s=30.0, warmup_s=5.0, users=12, seed=7)
    report = run_soak(config, tiny_model_dir)
    assert report.failures == [], report
    assert report.completed > 0 and report.disconnects > 0, report
    assert sum(report.preemptions.values()) > 0, "the KV budget never ran short"
    assert report.status_4xx == 0, report
    assert report.leaked_device_blocks == report.leaked_host_blocks == 0
    assert report.drained and report.integrity_error is None
