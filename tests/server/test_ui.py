"""The block-map page over real HTTP: assets, config, the snapshot stream, auth, --disable-ui.

(The page itself, in a real browser, is tests/server/test_ui_browser.py.)
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.kv import accounting
from engine.kv.block_map import expand_ranges
from server.settings import ServerSettings
from server.ui.router import ASSETS, STATIC_DIR
from tests.server.conftest import TINY_MODEL_NAME, LiveServer, live_server

KEY = "ui-key-5d1e"


def read_snapshots(url: str, count: int, headers: dict[str, str] | None = None) -> list[dict]:
    """The first ``count`` snapshot events of /ui/api/stream."""
    snapshots: list[dict] = []
    with httpx.stream("GET", f"{url}/ui/api/stream", headers=headers, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        event = ""
        for line in resp.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event == "snapshot":
                snapshots.append(json.loads(line[5:]))
                if len(snapshots) == count:
                    break
    return snapshots


def test_page_and_assets_are_served_and_reference_nothing_external(server: LiveServer) -> None:
    page = httpx.get(f"{server.url}/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    texts = [page.text]
    for name, media_type in ASSETS.items():
        resp = httpx.get(f"{server.url}/ui/static/{name}")
        assert resp.status_code == 200
        assert resp.headers["content-type"] == media_type
        texts.append(resp.text)
    for text in texts:  # works offline: no CDN, no web fonts
        assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", text), text[:200]
        assert "@import" not in text and "fonts.googleapis" not in text
    assert httpx.get(f"{server.url}/ui/static/..%2Fhub.py").status_code == 404
    assert httpx.get(f"{server.url}/ui/static/index.html").status_code == 404
    assert {p.name for p in STATIC_DIR.iterdir()} == {"index.html", *ASSETS}


def test_config_has_the_startup_totals_from_accounting(server: LiveServer) -> None:
    facts = httpx.get(f"{server.url}/ui/api/config").json()
    plan, shape = server.built.plan, server.built.kv_shape
    assert facts["kv_shape"]["bytes_per_token"] == accounting.bytes_per_token(shape)
    assert facts["kv_shape"]["bytes_per_block"] == plan.bytes_per_block
    assert facts["kv_shape"]["num_layers"] == shape.num_layers
    assert facts["kv_shape"]["num_kv_heads"] == shape.num_kv_heads
    assert facts["device_blocks"] == plan.num_blocks
    assert facts["device_kv_bytes"] == plan.kv_pool_bytes
    stats = server.ctx.engine.stats()
    assert facts["host_blocks"] == stats.host_blocks.total
    assert facts["max_seqs_at_max_len"] == plan.max_seqs_at_max_len


def test_stream_shows_a_running_request_and_its_blocks(server: LiveServer, client: Any) -> None:
    first_token = threading.Event()
    done = threading.Event()

    def generate() -> None:
        stream = client.completions.create(
            model=TINY_MODEL_NAME,
            prompt="the quick brown fox " * 8,
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for _ in stream:
            first_token.set()
            if done.is_set():
                break
        stream.close()

    worker = threading.Thread(target=generate, daemon=True)
    worker.start()
    try:
        assert first_token.wait(60)
        running: list[dict] = []
        for snapshot in read_snapshots(server.url, 10):
            running = [r for r in snapshot["requests"] if r["state"] == "running"]
            if running:
                break
        assert running, "no snapshot showed the running request"
        row = running[0]
        blocks = expand_ranges(row["ranges"])
        assert len(blocks) == row["blocks"] >= 1
        assert row["prompt_tokens"] > 0 and row["pool"] == "device"
        assert row["allocated_bytes"] == row["blocks"] * server.built.plan.bytes_per_block
        assert snapshot["totals"]["running"] >= 1
    finally:
        done.set()
        worker.join(60)
    server.wait_idle()


def test_snapshots_stop_when_nobody_watches(server: LiveServer) -> None:
    hub = server.app.state.ui_hub
    read_snapshots(server.url, 2)
    assert wait_for(lambda: hub.num_watchers == 0)
    sent = hub.snapshots_sent
    threading.Event().wait(1.5)  # three sampling periods
    assert hub.snapshots_sent == sent


def wait_for(condition: Any, timeout_s: float = 10.0) -> bool:
    stop = threading.Event()
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return True
        stop.wait(0.05)
    return bool(condition())


@pytest.fixture(scope="module")
def locked(tiny_built: Any) -> Iterator[LiveServer]:
    settings = ServerSettings(served_model_names=(TINY_MODEL_NAME,), api_key=KEY)
    with live_server(tiny_built, settings) as live:
        yield live


def test_api_key_guards_the_data_but_not_the_page(locked: LiveServer) -> None:
    assert httpx.get(f"{locked.url}/ui").status_code == 200
    assert httpx.get(f"{locked.url}/ui/static/ui.js").status_code == 200
    for path in ("/ui/api/config", "/ui/api/stream"):
        resp = httpx.get(f"{locked.url}{path}")
        assert resp.status_code == 401, path
        assert resp.json()["error"]["code"] == "invalid_api_key"
    bad = httpx.get(f"{locked.url}/ui/api/config", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{locked.url}/ui/api/config", headers=auth).status_code == 200
    assert read_snapshots(locked.url, 1, headers=auth)[0]["totals"]["device"]["total"] > 0


def test_protect_open_endpoints_still_serves_the_page_shell(tiny_built: Any) -> None:
    settings = ServerSettings(
        served_model_names=(TINY_MODEL_NAME,), api_key=KEY, protect_open_endpoints=True
    )
    with live_server(tiny_built, settings) as live:
        assert httpx.get(f"{live.url}/health").status_code == 401
        assert httpx.get(f"{live.url}/ui").status_code == 200
        assert httpx.get(f"{live.url}/ui/api/config").status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{live.url}/ui/api/config", headers=auth).status_code == 200


def test_disable_ui_removes_the_page(tiny_built: Any) -> None:
    settings = ServerSettings(served_model_names=(TINY_MODEL_NAME,), enable_ui=False)
    with live_server(tiny_built, settings) as live:
        for path in ("/ui", "/ui/static/ui.js", "/ui/api/config", "/ui/api/stream"):
            assert httpx.get(f"{live.url}{path}").status_code == 404, path


def test_cli_disable_ui_flag() -> None:
    from server.cli import build_parser, settings_from

    args = build_parser().parse_args(["serve", "--disable-ui"])
    assert settings_from(args).enable_ui is False
    args = build_parser().parse_args(["serve"])
    assert settings_from(args).enable_ui is True
