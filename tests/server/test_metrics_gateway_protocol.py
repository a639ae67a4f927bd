"""kvserve satisfies the Gateway API Inference Extension's model server protocol: a live
server's /metrics carries every metric of the protocol's table with the required type, and
the values mean what the protocol says (queued, running, KV utilisation, block size and
block count) while requests are held in the engine. The LoRA gauge is read as the EPP reads
it (``epp_lora_view``); with LoRA off it says "no slot, no adapter" without an error.
(tests/server/test_metrics_lora.py reads it from an engine serving adapters.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.gateway_protocol import PROTOCOL_METRICS, PROTOCOL_TYPE, epp_engine_config
from server.settings import ServerSettings
from tests.server.conftest import TINY_MODEL_NAME, LiveServer, build_tiny, live_server

LONG = 900  # tokens: far more than the test waits for


@pytest.fixture(scope="module")
def one_seq_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    """A server that runs one sequence at a time, so a second request has to queue."""
    built = build_tiny(tiny_model_dir, max_num_seqs=1)
    with live_server(built, ServerSettings(served_model_names=(TINY_MODEL_NAME,))) as live:
        yield live


def families(url: str) -> dict[str, Any]:
    body = httpx.get(f"{url}/metrics", timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(body)}


def protocol_values(url: str) -> dict[str, float]:
    """Each numeric protocol metric's value as the EPP reads it: the sample value, or the
    label (the LoRA gauge's adapter lists: ``epp_lora_view``)."""
    found = families(url)
    values = {}
    for row in PROTOCOL_METRICS:
        if row.timestamped:
            continue
        family = found[row.metric]
        (sample,) = family.samples
        values[row.protocol_name] = (
            float(sample.labels[row.label]) if row.label else float(sample.value)
        )
    return values


@dataclass(frozen=True)
class LoRAView:
    """What the EPP stores from the LoRA gauge: MaxActiveModels, ActiveModels and
    WaitingModels of its endpoint metrics."""

    max_active: int
    active: frozenset[str]
    waiting: frozenset[str]


def epp_lora_view(found: Mapping[str, Any]) -> LoRAView:
    """The LoRA gauge read as the Inference Extension's EPP v1.5.0 reads it (data layer,
    pkg/epp/framework/plugins/datalayer/extractor/metrics/): of the family's samples the
    one with the largest value (``LoRASpec.getLatestMetric``); each list split on "," with
    spaces trimmed and empty names dropped (``addAdapters``); ``max_lora`` an integer
    (``populateLoRAMetrics``)."""
    rows = [row for row in PROTOCOL_METRICS if row.timestamped]
    (metric,) = {row.metric for row in rows}
    latest = max(found[metric].samples, key=lambda sample: sample.value)
    labels = {row.protocol_name: latest.labels[str(row.label)] for row in rows}

    def names(csv: str) -> frozenset[str]:
        return frozenset(name.strip() for name in csv.split(",") if name.strip())

    return LoRAView(
        max_active=int(labels["MaxActiveModels"]),
        active=names(labels["ActiveModels"]),
        waiting=names(labels["WaitingModels"]),
    )


def wait_until(check: Callable[[], Any], what: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class HeldStream:
    """A streaming chat request read up to its first event and held open until closed."""

    def __init__(self, url: str) -> None:
        self._url = f"{url}/v1/chat/completions"
        self._release = threading.Event()
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {
            "model": TINY_MODEL_NAME,
            "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": LONG,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", self._url, json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.started.set()
                if self._release.is_set():
                    return

    def close(self) -> None:
        self._release.set()
        self._thread.join(60)


def test_every_protocol_metric_is_exported_with_the_required_type(server: LiveServer) -> None:
    before = time.time()
    found = families(server.url)
    after = time.time()
    for row in PROTOCOL_METRICS:
        assert row.metric in found, row
        # The EPP parses the text format, where an info metric is a gauge of value 1.
        assert found[row.metric].type == PROTOCOL_TYPE, (row, found[row.metric].type)
        (sample,) = found[row.metric].samples
        assert sample.name == row.metric
        if row.timestamped:  # the LoRA gauge: the scrape's time, by which the EPP picks
            assert before <= sample.value <= after, (row, sample.value)
            assert row.label in sample.labels, (row, sample.labels)
        elif row.label is not None:
            assert sample.value == 1
            assert sample.labels[row.label].isdigit(), (row, sample.labels)
    required = {row.protocol_name for row in PROTOCOL_METRICS if row.required}
    assert required == {"TotalQueuedRequests", "TotalRunningRequests", "KVCacheUtilization"}


def test_without_lora_the_gauge_says_no_slot_and_no_adapter(server: LiveServer) -> None:
    """LoRA off: the gauge is there all the same (so one EPP config with loraSpec set
    serves every kvserve pod), and reads as no adapter slot and no adapter."""
    found = families(server.url)
    (sample,) = found["kvserve_lora_requests_info"].samples
    assert sample.labels == {
        "model_name": TINY_MODEL_NAME,
        "max_lora": "0",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    assert epp_lora_view(found) == LoRAView(0, frozenset(), frozenset())
    # A later scrape is a later snapshot: its value grows, as the EPP's pick assumes.
    time.sleep(0.01)
    (again,) = families(server.url)["kvserve_lora_requests_info"].samples
    assert again.value > sample.value


def test_the_text_format_types_them_as_gauges(server: LiveServer) -> None:
    """What the EPP's text parser sees: `# TYPE <name> gauge` for every protocol metric."""
    body = httpx.get(f"{server.url}/metrics", timeout=10).text
    for row in PROTOCOL_METRICS:
        assert f"# TYPE {row.metric} {PROTOCOL_TYPE}\n" in body, row


def test_block_size_and_block_count_match_the_pool(server: LiveServer) -> None:
    values = protocol_values(server.url)
    stats = server.ctx.engine.stats()
    assert values["BlockSize"] == stats.block_size == 16
    assert values["NumGPUBlocks"] == stats.device_blocks.total
    found = families(server.url)
    capacity = {
        s.labels["pool"]: s.value for s in found["kvserve_kv_cache_capacity_blocks"].samples
    }
    assert values["NumGPUBlocks"] == capacity["device"]


def test_values_follow_queued_and_running_requests(one_seq_server: LiveServer) -> None:
    url = one_seq_server.url
    one_seq_server.wait_idle()
    idle = protocol_values(url)
    assert idle["TotalQueuedRequests"] == 0
    assert idle["TotalRunningRequests"] == 0
    assert idle["KVCacheUtilization"] == 0
    first = HeldStream(url)
    second = None
    try:
        assert first.started.wait(60), "first stream produced no event"
        second = HeldStream(url)
        # max_num_seqs=1: the second request waits while the first one runs.
        busy = wait_until(
            lambda: (v := protocol_values(url))["TotalQueuedRequests"] == 1 and v,
            "the second request to queue",
        )
        assert busy["TotalRunningRequests"] == 1
        stats = one_seq_server.ctx.engine.stats()
        assert 0 < busy["KVCacheUtilization"] <= 1
        assert busy["KVCacheUtilization"] == pytest.approx(
            stats.device_blocks.used / stats.device_blocks.total, abs=2 / stats.device_blocks.total
        )
    finally:
        first.close()
        if second is not None:
            second.close()
    one_seq_server.wait_idle(timeout_s=60)
    after = protocol_values(url)
    assert after["TotalQueuedRequests"] == after["TotalRunningRequests"] == 0
    assert after["KVCacheUtilization"] == 0


def test_the_epp_engine_config_names_only_exported_metrics(server: LiveServer) -> None:
    exported = {sample.name for f in families(server.url).values() for sample in f.samples}
    config = epp_engine_config()
    assert config.pop("name") == "kvserve"
    assert set(config) == {
        "queuedRequestsSpec",
        "runningRequestsSpec",
        "kvUsageSpec",
        "cacheInfoSpec",
        "loraSpec",  # on: kvserve exports the LoRA gauge with LoRA off too
    }
    assert config["loraSpec"] == "kvserve_lora_requests_info"
    for key, metric in config.items():
        assert metric in exported, (key, metric)
