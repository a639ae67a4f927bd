"""The disk tier across a real restart: ``kvserve serve`` with --kv-cache-disk-dir, two
conversations, SIGTERM, a new process on the same directory, the next turns.

The first turn after the restart must report cached prompt tokens (the device cache is
empty, so they came from disk) and give the same greedy tokens as a server without any
prefix cache.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server.settings import ServerSettings
from tests.server.conftest import build_tiny, live_server
from tests.server.test_hardening_shutdown import free_port

pytestmark = pytest.mark.slow

WORDS = [
    "alpha",
    "river",
    "stone",
    "cloud",
    "maple",
    "quiet",
    "orange",
    "signal",
    "harbor",
    "window",
]


@contextmanager
def serve(model_dir: Path, disk: Path) -> Iterator[str]:
    port = free_port()
    command = [
        *(sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir)),
        *("--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256"),
        *("--max-model-len", "1024", "--port", str(port), "--log-level", "warning"),
        *("--kv-cache-disk-dir", str(disk), "--kv-cache-disk-size", "0.05"),
        *("--shutdown-timeout", "5"),
    ]
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(command, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            assert process.poll() is None, "kvserve serve exited during start-up"
            assert time.monotonic() < deadline, "kvserve serve did not become healthy"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def user_text(seed: int, words: int = 120) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(words))


def chat(url: str, messages: list[dict[str, str]]) -> Any:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0.0,
    )


def metric(url: str, name: str, *labels: str) -> float:
    """The sample of ``name`` whose labels include every ``key="value"`` given."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(label in line for label in labels):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} missing from /metrics")


def test_restart_serves_returning_conversations_from_disk(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    conversations = [[{"role": "user", "content": user_text(seed)}] for seed in range(2)]
    with serve(tiny_model_dir, disk) as url:
        for messages in conversations:
            answer = chat(url, messages).choices[0].message.content or ""
            messages.append({"role": "assistant", "content": answer})
            messages.append({"role": "user", "content": "and then " + user_text(9, 20)})
    assert list(disk.glob("*.kvb")), "shutdown persisted the prefix cache"

    with serve(tiny_model_dir, disk) as url:
        after = [chat(url, messages) for messages in conversations]
        disk_hits = metric(url, "kvserve_kv_tier_hits_total", 'tier="disk"')
        loaded = metric(url, "kvserve_kv_tier_bytes_total", 'tier="disk"', 'direction="out"')
    for response in after:
        assert response.usage.prompt_tokens_details.cached_tokens >= 64
    assert disk_hits >= 8 and loaded > 0

    reference = build_tiny(tiny_model_dir, enable_prefix_caching=False)
    with live_server(reference, ServerSettings()) as live:
        expected = [chat(live.url, messages) for messages in conversations]
    for got, want in zip(after, expected, strict=True):
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.completion_tokens == want.usage.completion_tokens
