"""Two ``kvserve serve`` processes on one ``--kv-cache-disk-dir`` (engine/kv/disk_store.py,
shared by processes): B starts first, on an empty directory; A answers a long prompt and
persists its prefix cache on SIGTERM while B keeps running; B then answers the same
prompt with its prefix loaded from the blocks A published after B started (cached
tokens, disk-tier hits) and the same greedy tokens A gave.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.kv.disk_store import SUFFIX
from tests.server.conftest import kvserve_process

pytestmark = pytest.mark.slow

WORDS = ["copper", "meadow", "lantern", "glacier", "willow", "ember", "canyon", "orchid"]


def prompt(words: int = 150) -> str:
    return " ".join(WORDS[(i * 5) % len(WORDS)] + str(i % 7) for i in range(words))


def chat(url: str, text: str) -> Any:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": text}],
        max_tokens=8,
        temperature=0.0,
    )


def metric(url: str, name: str, *labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(label in line for label in labels):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} missing from /metrics")


def test_a_replica_serves_from_disk_the_prefix_another_replica_computed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    flags: tuple[str, ...] = ("--kernels", "torch", "--num-kv-blocks", "128")
    flags += ("--shutdown-timeout", "5")
    flags += ("--kv-cache-disk-dir", str(disk), "--kv-cache-disk-size", "0.05")
    text = prompt()
    with kvserve_process(tiny_model_dir, *flags) as b:
        assert not list(disk.glob(f"*{SUFFIX}"))  # B starts on an empty directory
        with kvserve_process(tiny_model_dir, *flags) as a:
            first = chat(a.url, text)
            a.process.send_signal(signal.SIGTERM)  # persists A's prefix cache to disk
            assert a.process.wait(timeout=60) == 0
        assert len(list(disk.glob(f"*{SUFFIX}"))) >= 4, "A published its blocks"
        assert first.usage.prompt_tokens_details.cached_tokens == 0

        again = chat(b.url, text)
        disk_hits = metric(b.url, "kvserve_kv_tier_hits_total", 'tier="disk"')
        loaded = metric(b.url, "kvserve_kv_tier_bytes_total", 'tier="disk"', 'direction="out"')
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # B computed none of it
    assert disk_hits >= 4 and loaded > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.completion_tokens == first.usage.completion_tokens
