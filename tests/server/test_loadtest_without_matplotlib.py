"""A whole kvserve-loadtest run, without --png, on an install without matplotlib (the
`loadtest` extra): the JSON result is written, no PNG, and the output says how to get one."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.__main__ import MATPLOTLIB_HINT
from tests.server.test_loadtest_fake_server import FakeBehaviour, fake_server
from tests.unit.test_loadtest_cli import run_without_matplotlib

__all__ = ["fake_server"]  # the fixture, imported so pytest finds it here


def test_a_run_without_png_needs_no_matplotlib(
    fake_server: tuple[str, FakeBehaviour], tmp_path: Path
) -> None:
    url, state = fake_server
    args = ["--url", url, "-c", "2", "-t", "2", "--max-tokens", "3", "--no-progress"]
    result = run_without_matplotlib(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    document = json.loads((tmp_path / "loadtest-out" / "result.json").read_text())
    assert document["summary"]["requests"]["completed"] == 4 == state.requests_seen
    assert not list(tmp_path.rglob("*.png"))
    assert f"no PNG report: matplotlib is missing; {MATPLOTLIB_HINT}" in result.stdout
