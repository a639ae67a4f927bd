"""The disk tier cleans after itself (issue 42), in a real ``kvserve serve``.

Two conversations are persisted into one directory by servers that shut down cleanly;
the second one's entries are then damaged (truncated, a payload bit flipped, emptied, a
broken header) and two crashed writes' temporary files are left beside them. A new
``kvserve serve`` on that directory must delete all of it (the flipped payload once its
checksum is checked), count every rejection by reason in /metrics, and still answer the
first conversation exactly as it was answered without any disk-tier hit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.kv.accounting import DISK_ENTRY_HEADER_BYTES
from engine.kv.disk_store import SUFFIX, TEMP_SUFFIX
from server.settings import ServerSettings
from tests.server.conftest import build_tiny, kvserve_process, live_server

pytestmark = pytest.mark.slow

DISK_GIB = "0.05"
WORDS = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "heron", "inlet"]


def user_text(seed: int, words: int = 120) -> str:
    return " ".join(WORDS[(seed * 5 + i * 4) % len(WORDS)] for i in range(words))


def ask(url: str, seed: int) -> Any:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": user_text(seed)}],
        max_tokens=8,
        temperature=0.0,
    )


@contextmanager
def persisting_server(model_dir: Path, disk: Path) -> Iterator[str]:
    """An in-process server with a disk tier; leaving it persists its prefix cache."""
    built = build_tiny(
        model_dir,
        kernels="torch",
        num_kv_blocks=256,
        kv_cache_disk_dir=str(disk),
        kv_cache_disk_gib=float(DISK_GIB),
    )
    with live_server(built, ServerSettings()) as live:
        yield live.url


def metric(text: str, name: str, *labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and all(label in line for label in labels):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} missing from /metrics")


def damage(entries: list[Path], disk: Path) -> list[Path]:
    """Truncate, flip, empty and break the header of four entries; leave two crashed
    writes behind. Returns the temporary files."""
    truncated, flipped, emptied, broken = entries[:4]
    truncated.write_bytes(truncated.read_bytes()[:-7])
    data = bytearray(flipped.read_bytes())
    data[DISK_ENTRY_HEADER_BYTES + 3] ^= 0x10
    flipped.write_bytes(bytes(data))
    emptied.write_bytes(b"")
    broken.write_bytes(b"\0" * 16 + broken.read_bytes()[16:])
    temps = [
        disk / f".{'ab' * 16}{SUFFIX}{TEMP_SUFFIX}",
        disk / f".{'cd' * 16}{SUFFIX}{TEMP_SUFFIX}",
    ]
    for temp in temps:
        temp.write_bytes(b"half a block")
    return temps


def test_a_damaged_disk_tier_is_cleaned_at_start_up_and_answers_stay_exact(
    tiny_model_dir: Path, tmp_path: Path
):
    disk = tmp_path / "kv"
    with persisting_server(tiny_model_dir, disk) as url:
        first = ask(url, seed=1)  # nothing on disk yet: no disk-tier hit
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    kept = set(disk.glob(f"*{SUFFIX}"))
    with persisting_server(tiny_model_dir, disk) as url:
        ask(url, seed=2)
    others = sorted(set(disk.glob(f"*{SUFFIX}")) - kept)
    assert len(kept) >= 4 and len(others) >= 4
    temps = damage(others, disk)

    flags = ("--kernels", "torch", "--num-kv-blocks", "256")
    flags += ("--kv-cache-disk-dir", str(disk), "--kv-cache-disk-size", DISK_GIB)
    with kvserve_process(tiny_model_dir, *flags) as server:
        # Headers and lengths are checked before the server is up.
        assert not any(path.exists() for path in [*others[:1], *others[2:4], *temps])
        again = ask(server.url, seed=1)
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        deadline = time.monotonic() + 60
        # The flipped payload goes once the writer, idle, checks its checksum; the stats
        # snapshot is published by the engine's steps, so each poll runs a short request.
        while metric(text, "kvserve_kv_disk_rejected_entries_total", '"checksum"') < 1:
            assert time.monotonic() < deadline, "the checksum pass did not finish"
            httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, timeout=10)
            ask(server.url, seed=3)
            text = httpx.get(f"{server.url}/metrics", timeout=10).text

    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.completion_tokens == first.usage.completion_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # served from disk
    assert metric(text, "kvserve_kv_tier_hits_total", 'tier="disk"') >= 4
    name = "kvserve_kv_disk_rejected_entries_total"
    for reason in ("truncated", "checksum", "empty", "header"):
        assert metric(text, name, f'reason="{reason}"') == 1, reason
    for reason in ("oversized", "fingerprint"):
        assert metric(text, name, f'reason="{reason}"') == 0, reason
    assert metric(text, "kvserve_kv_disk_removed_temp_files_total") == 2
    assert not any(path.exists() for path in [*others[:4], *temps])
    assert all(path.exists() for path in kept)
