"""A real Prometheus scrapes a real `kvserve serve` under load.

* `kvserve plan` with the server's flags reports the figures the server exports;
* KV usage seen through Prometheus rises under load and returns to idle afterwards;
* payload bytes equal 2*L*H_kv*d*t*b for the live token counts at every scrape;
* every PromQL expression of the dashboard and of the rules returns data.

Prometheus comes from Debian (`apt-get install -y prometheus`, done by .ci/run); without
the binary the Prometheus tests skip with that message.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_deploy import RULE_FILES, dashboard_expressions, rule_expressions

pytestmark = pytest.mark.slow

KVSERVE = Path(sys.executable).with_name("kvserve")
# Flags shared by `kvserve serve` and `kvserve plan`: a small pool (131 blocks of 16
# tokens for the tiny model) so a few streams move the usage ratio visibly.
SIZING = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "1024"]
SIZING += ["--block-size", "16", "--kv-cache-memory", "0.001"]
MODEL_NAME = "tiny-llama"
SCRAPE_INTERVAL_S = 1
SYSTEM_PROMPT = "You are a careful assistant who answers in short plain sentences. " * 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(check: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
        except (httpx.HTTPError, OSError):
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def kvserve_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("kvserve") / "serve.log"
    command = [str(KVSERVE), "serve", "--model", str(tiny_model_dir), *SIZING]
    command += ["--swap-space", "0.001", "--max-num-seqs", "8", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--served-model-name", MODEL_NAME, "--log-level", "warning"]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: process.poll() is None and httpx.get(f"{url}/health").status_code == 200,
            timeout_s=180,
            what=f"kvserve /health (log: {log})",
        )
        yield url
    finally:
        stop(process)


@pytest.fixture(scope="module")
def prometheus_url(kvserve_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus binary missing: apt-get install -y prometheus (CI installs it)")
    workdir = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {
            "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
            "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
        },
        "rule_files": [str(path) for path in RULE_FILES],
        "scrape_configs": [
            {
                "job_name": "kvserve",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [kvserve_url.removeprefix("http://")]}],
            }
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    command = [binary, f"--config.file={workdir / 'prometheus.yml'}"]
    command += [f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"]
    with (workdir / "prometheus.log").open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{url}/-/ready").status_code == 200, 60, "Prometheus ready")
        yield url
    finally:
        stop(process)


def scrape(kvserve_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    body = httpx.get(f"{kvserve_url}/metrics", timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return samples[(name, frozenset({"model_name": MODEL_NAME, **labels}.items()))]


def info_labels(samples: dict) -> dict[str, str]:  # type: ignore[type-arg]
    ((_, labels),) = [key for key in samples if key[0] == "kvserve_cache_config_info"]
    return dict(labels)


def tiny_bytes_per_token(model_dir: Path) -> int:
    """2 * L * H_kv * d_head * 4 bytes (float32), from the model's config.json by hand."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


def query(prometheus_url: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
    response = httpx.get(f"{prometheus_url}/api/v1/query", params=params, timeout=10)
    body = response.json()
    assert body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def values(result: list[dict[str, Any]]) -> list[float]:
    return [float(item["value"][1]) for item in result]


def test_plan_agrees_with_the_running_server(kvserve_url: str, tiny_model_dir: Path) -> None:
    command = [str(KVSERVE), "plan", "--model", str(tiny_model_dir), *SIZING, "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    samples = scrape(kvserve_url)
    info = info_labels(samples)
    assert int(info["bytes_per_token"]) == plan["bytes_per_token"]
    assert int(info["bytes_per_token"]) == tiny_bytes_per_token(tiny_model_dir)
    assert int(info["bytes_per_block"]) == plan["bytes_per_block"]
    assert int(info["num_device_blocks"]) == plan["num_blocks"]
    assert info["kv_cache_dtype"] == plan["kv_cache_dtype"]
    assert int(info["max_model_len"]) == plan["max_model_len"]
    capacity = sample(samples, "kvserve_kv_cache_capacity_blocks", pool="device")
    assert capacity == plan["num_blocks"]
    kv_pool = sample(samples, "kvserve_device_memory_bytes", component="kv_cache")
    assert kv_pool == plan["kv_pool_bytes"]
    weights = sample(samples, "kvserve_device_memory_bytes", component="weights")
    assert weights == plan["weight_bytes"]
    assert plan["max_concurrency_at_max_len"] == plan["num_blocks"] // 64  # 1024 / 16


class ChatLoad:
    """Streaming chat requests from several threads until stopped; shared system prompt so
    the prefix cache gets hits."""

    def __init__(self, url: str, streams: int) -> None:
        self._url = f"{url}/v1/chat/completions"
        self._stop = threading.Event()
        self.completed = 0
        self._lock = threading.Lock()
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._run, args=(index,), daemon=True)
            for index in range(streams)
        ]

    def __enter__(self) -> ChatLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _run(self, index: int) -> None:
        with httpx.Client(timeout=120) as client:
            turn = 0
            while not self._stop.is_set():
                turn += 1
                body = {
                    "model": MODEL_NAME,
                    "messages": [
                        {"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": f"Conversation {index}, turn {turn}: go."},
                    ],
                    "max_tokens": 48,
                    "ignore_eos": True,
                    "stream": True,
                }
                try:
                    with client.stream("POST", self._url, json=body) as response:
                        response.raise_for_status()
                        for _ in response.iter_lines():
                            pass
                    with self._lock:
                        self.completed += 1
                except httpx.HTTPError as error:
                    self.errors.append(repr(error))


def prometheus_expression(expr: str) -> str:
    """Grafana variables -> concrete values; comparisons -> `bool` so non-firing alert
    expressions still return their series."""
    expr = expr.replace("$__rate_interval", "15s").replace('=~"$model"', '=~".*"')
    expr = expr.replace('=~"$instance"', '=~".*"')
    return re.sub(r" (==|!=|>=|<=|>|<) (?!bool)", r" \1 bool ", expr)


def test_prometheus_sees_the_cache_fill_and_drain(
    kvserve_url: str, prometheus_url: str, tiny_model_dir: Path
) -> None:
    per_token = tiny_bytes_per_token(tiny_model_dir)
    wait_for(
        lambda: values(query(prometheus_url, 'up{job="kvserve"}')) == [1.0], 30, "first scrape"
    )
    wait_for(
        lambda: values(query(prometheus_url, "kvserve_kv_cache_usage_ratio")) == [0.0],
        30,
        "an idle server",
    )
    start = time.time()
    loaded_at = load_until_prometheus_sees_it(kvserve_url, prometheus_url, per_token)

    # Back to idle: no used block, nothing running (freed blocks may stay prefix-cached).
    idle = "kvserve_kv_cache_usage_ratio + kvserve_num_requests_running"
    wait_for(lambda: values(query(prometheus_url, idle)) == [0.0], 60, "idle after the load")
    window = f"{math.ceil(time.time() - start) + 5}s"
    peak = values(query(prometheus_url, f"max_over_time(kvserve_kv_cache_usage_ratio[{window}])"))
    assert peak and peak[0] > 0
    formula_gap = (
        f"abs(kvserve_kv_cache_payload_bytes - kvserve_kv_cache_live_tokens * {per_token})"
    )
    assert values(query(prometheus_url, f"max_over_time(({formula_gap})[{window}:1s])")) == [0.0]
    live_peak = f"max_over_time(kvserve_kv_cache_live_tokens[{window}])"
    live_peak_value = values(query(prometheus_url, live_peak))
    assert live_peak_value and live_peak_value[0] > 0

    check_every_expression(prometheus_url, loaded_at)
    rules = httpx.get(f"{prometheus_url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    for group in rules:
        for rule in group["rules"]:
            assert rule["health"] == "ok", rule


def load_until_prometheus_sees_it(kvserve_url: str, prometheus_url: str, per_token: int) -> float:
    """Run the chat load until Prometheus recorded KV usage and enough requests finished,
    checking the payload formula on every direct scrape meanwhile; return a loaded instant."""
    per_block = per_token * 16
    start = time.time()
    loaded_scrapes = 0
    with ChatLoad(kvserve_url, streams=6) as load:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            samples = scrape(kvserve_url)
            live = sample(samples, "kvserve_kv_cache_live_tokens")
            used = sample(samples, "kvserve_kv_cache_blocks", pool="device", state="used")
            # One snapshot feeds one scrape: the formula holds exactly at every instant.
            assert sample(samples, "kvserve_kv_cache_payload_bytes") == live * per_token
            assert sample(samples, "kvserve_kv_cache_allocated_bytes") == used * per_block
            loaded_scrapes += live > 0
            seen = values(query(prometheus_url, "max_over_time(kvserve_kv_cache_usage_ratio[1m])"))
            if seen and seen[0] > 0 and time.time() - start > 10 and load.completed >= 12:
                break
            time.sleep(0.3)
        loaded_at = time.time() - 1
    assert not load.errors, load.errors[:3]
    assert loaded_scrapes > 0, "no scrape saw live tokens"
    assert load.completed >= 12, f"only {load.completed} requests completed"
    return loaded_at


def check_every_expression(prometheus_url: str, at: float) -> None:
    """Each expression answers at a loaded instant with finite values, and each recorded
    series exists."""
    # This server runs without prefix-cache tiers, so the tier panels have nothing to show
    # (their series are checked against a tiered server in tests/server/test_tier_restart.py).
    expressions = [
        (source, expr)
        for source, expr in rule_expressions() + dashboard_expressions()
        if "kvserve_kv_tier_" not in expr
    ]
    recorded = [(name, name) for name, _ in rule_expressions() if ":" in name]
    empty, not_finite = [], []
    for source, expr in expressions + recorded:
        result = values(query(prometheus_url, prometheus_expression(expr), at=at))
        if not result:
            empty.append((source, expr))
        elif not all(math.isfinite(value) for value in result):
            not_finite.append((source, expr, result))
    assert not empty, empty
    assert not not_finite, not_finite


def test_a_real_scrape_has_process_metrics_and_measured_memory(kvserve_url: str) -> None:
    """Measured next to computed, from the running server's own /metrics."""
    first = scrape(kvserve_url)
    assert first[("process_resident_memory_bytes", frozenset())] > 50 * 2**20
    assert first[("process_open_fds", frozenset())] > 0
    measured = "kvserve_device_memory_measured_bytes"
    kv_measured = sample(first, measured, component="kv_cache")
    kv_computed = sample(first, "kvserve_device_memory_bytes", component="kv_cache")
    # The pools are zero-filled at start, so every page of them is resident: mincore sees
    # the computed size (capped at it), give or take pages the kernel reclaimed.
    assert 0.95 * kv_computed <= kv_measured <= kv_computed
    host_measured = sample(first, measured, component="host_kv_cache")
    host_computed = sample(first, "kvserve_host_kv_cache_memory_bytes")
    assert 0.95 * host_computed <= host_measured <= host_computed
    # The KV pool is part of the process's resident memory.
    assert first[("process_resident_memory_bytes", frozenset())] >= kv_measured + host_measured
    cpu_before = first[("process_cpu_seconds_total", frozenset())]
    with ChatLoad(kvserve_url, streams=2) as load:
        wait_for(lambda: load.completed >= 2, 120, "two completed chats")
    assert not load.errors, load.errors[:3]
    assert scrape(kvserve_url)[("process_cpu_seconds_total", frozenset())] > cpu_before


def test_prometheus_compares_measured_and_computed_memory(
    kvserve_url: str, prometheus_url: str
) -> None:
    ratio = (
        'kvserve_device_memory_measured_bytes{component="kv_cache"} / ignoring(component) '
        'kvserve_device_memory_bytes{component="kv_cache"}'
    )
    seen = wait_for(lambda: values(query(prometheus_url, ratio)), 30, "the memory ratio")
    assert 0.95 <= seen[0] <= 1.0
    resident = values(query(prometheus_url, 'process_resident_memory_bytes{job="kvserve"}'))
    assert resident and resident[0] > 50 * 2**20


def test_prometheus_reads_the_lora_gauge_of_a_server_without_lora(
    kvserve_url: str, prometheus_url: str
) -> None:
    """The series the EPP's LoRA scrape reads is there with LoRA off: one, max_lora 0 and
    no adapter (Prometheus drops the empty list labels), its value the time of the scrape
    that carried it, so it trails Prometheus's clock by at most a scrape interval."""
    (series,) = wait_for(
        lambda: query(prometheus_url, "kvserve_lora_requests_info"), 30, "the LoRA gauge"
    )
    labels = series["metric"]
    assert labels["max_lora"] == "0" and labels["model_name"] == MODEL_NAME
    assert "running_lora_adapters" not in labels and "waiting_lora_adapters" not in labels
    (age,) = values(query(prometheus_url, "time() - kvserve_lora_requests_info"))
    assert -1.0 < age < SCRAPE_INTERVAL_S + 5.0
    # A newer scrape, a larger value: what the EPP's pick of the latest sample relies on.
    rising = f"min_over_time(deriv(kvserve_lora_requests_info[5s])[{5 * SCRAPE_INTERVAL_S}s:1s])"
    wait_for(lambda: values(query(prometheus_url, rising)), 30, "five scrapes of the gauge")
    assert values(query(prometheus_url, rising))[0] > 0
