"""The hybrid KV cache where an operator sees it: a Gemma-2-shaped model (sliding and full
layers alternating) served for real, its KV groups in the startup log and in /metrics
while a stream runs past the window, and ``--disable-hybrid-kv-cache-manager`` giving
the all-full cache back (one group, fewer sequences)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from math import ceil
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.builder import build_engine
from engine.config import EngineArgs
from server.settings import ServerSettings
from tests.model.family_models import FAMILIES, WINDOW
from tests.model.test_family_serving import saved_model
from tests.server.conftest import live_server

MODEL = "gemma2-tiny"
BLOCK = 8
NUM_LAYERS = 4  # family_models.gemma2: sliding, full, sliding, full
# What a sliding group may hold for one sequence (issue 34): ceil((W - 1) / S) + 1.
SLIDING_BOUND = ceil((WINDOW - 1) / BLOCK) + 1


@pytest.fixture(scope="module")
def gemma2_dir(smollm_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma2")
    saved_model(FAMILIES["gemma2"][0], smollm_tokenizer, path)
    return path


def engine_args(model_dir: Path, **overrides: Any) -> EngineArgs:
    fields: dict[str, Any] = {
        "model": str(model_dir),
        "device": "cpu",
        "dtype": "float32",
        "block_size": BLOCK,
        "kv_cache_memory_gib": 4 / 1024,
        "max_model_len": 512,
        "swap_space_gib": 0,
    }
    return EngineArgs(**{**fields, **overrides})


@pytest.fixture(scope="module")
def hybrid_server(gemma2_dir: Path) -> Iterator[tuple[Any, Any]]:
    built = build_engine(engine_args(gemma2_dir))
    with live_server(built, ServerSettings(served_model_names=(MODEL,))) as live:
        yield live, built


def scrape(url: str) -> dict[str, list[Any]]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def by_group(samples: list[Any], state: str | None = None) -> dict[str, Any]:
    """group index -> (attention, window, value) of one group family's samples."""
    out = {}
    for sample in samples:
        if state is None or sample.labels.get("state") == state:
            labels = sample.labels
            out[labels["group"]] = (labels["attention"], labels["window"], sample.value)
    return out


def test_the_startup_log_names_each_group_and_the_saving(
    gemma2_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        built = build_engine(engine_args(gemma2_dir))
    lines = [record.getMessage() for record in caplog.records]
    groups = [line for line in lines if line.startswith("KV group ")]
    assert len(groups) == len(built.plan.groups) >= 2
    assert any("sliding" in line for line in groups) and any("full" in line for line in groups)
    (saving,) = [line for line in lines if line.startswith("hybrid KV cache:")]
    assert f"{built.plan.max_seqs_at_max_len} sequences" in saving
    assert f"vs {built.plan.all_full_max_seqs_at_max_len} with every layer" in saving


def test_metrics_show_each_group_and_the_window_bound_while_a_stream_runs(
    hybrid_server: tuple[Any, Any],
) -> None:
    live, built = hybrid_server
    words = " ".join(f"river{i}" for i in range(60))  # several windows of prompt
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": words}],
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(12):  # well past the window: the prompt alone spans several
            next(lines)
        families = scrape(live.url)
    layers = by_group(families["kvserve_kv_cache_group_layers"])
    used = by_group(families["kvserve_kv_cache_group_blocks"], "used")
    payload = by_group(families["kvserve_kv_cache_group_payload_bytes"])
    assert sum(value for _, _, value in layers.values()) == NUM_LAYERS
    kinds = {attention: window for attention, window, _ in layers.values()}
    assert kinds == {"sliding": str(WINDOW), "full": ""}
    # The pool's own series stay beside the groups'.
    assert any(s.labels.get("pool") == "device" for s in families["kvserve_kv_cache_blocks"])
    for group, (attention, _, blocks) in used.items():
        if attention == "sliding":
            assert 1 <= blocks <= SLIDING_BOUND, (group, blocks)
        else:
            assert blocks > SLIDING_BOUND, (group, blocks)  # every block of the history
    # Each group's payload: its layers' bytes per token times the tokens it still reads.
    full_payload = [value for attention, _, value in payload.values() if attention == "full"]
    sliding_payload = [value for attention, _, value in payload.values() if attention == "sliding"]
    assert min(full_payload) > max(sliding_payload) > 0
    assert built.kv_shape.is_hybrid


def test_disable_hybrid_gives_one_full_group_and_fewer_sequences(gemma2_dir: Path) -> None:
    hybrid = build_engine(engine_args(gemma2_dir))
    all_full = build_engine(engine_args(gemma2_dir, disable_hybrid_kv_cache_manager=True))
    assert hybrid.kv_shape.is_hybrid and not all_full.kv_shape.is_hybrid
    assert not all_full.plan.groups
    # The same memory holds more sequences when sliding layers keep only their window,
    # and the all-full engine's capacity is what the hybrid plan predicted for it.
    assert hybrid.plan.max_seqs_at_max_len > all_full.plan.max_seqs_at_max_len
    assert all_full.plan.max_seqs_at_max_len == hybrid.plan.all_full_max_seqs_at_max_len
    with live_server(all_full, ServerSettings(served_model_names=(MODEL,))) as live:
        families = scrape(live.url)
    assert "kvserve_kv_cache_group_blocks" not in families
