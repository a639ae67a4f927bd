"""Servers in other configurations: API key, bounded queue, an engine that fails."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.settings import ServerSettings
from tests.server.conftest import TINY_MODEL_NAME, LiveServer, build_tiny, live_server

KEY = "s3cret-key"
CHAT = {
    "model": TINY_MODEL_NAME,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
}


@pytest.fixture(scope="module")
def auth_server(tiny_built: Any) -> Iterator[LiveServer]:
    settings = ServerSettings(served_model_names=(TINY_MODEL_NAME,), api_key=KEY)
    with live_server(tiny_built, settings) as live:
        yield live


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/detokenize"])
def test_missing_or_wrong_key_is_401(auth_server: LiveServer, headers: dict[str, str], path: str):
    resp = httpx.post(f"{auth_server.url}{path}", json=CHAT, headers=headers)
    assert resp.status_code == 401
    assert resp.json()["error"]["type"] == "authentication_error"
    assert resp.headers["www-authenticate"] == "Bearer"


def test_get_models_needs_the_key_too(auth_server: LiveServer):
    assert httpx.get(f"{auth_server.url}/v1/models").status_code == 401
    ok = httpx.get(f"{auth_server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200


def test_right_key_works_with_the_openai_client(auth_server: LiveServer):
    import openai

    client = openai.OpenAI(base_url=auth_server.v1, api_key=KEY, max_retries=0)
    resp = client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=CHAT["messages"], max_tokens=2
    )
    assert resp.choices[0].message.content is not None
    wrong = openai.OpenAI(base_url=auth_server.v1, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_health_and_metrics_stay_open(auth_server: LiveServer):
    assert httpx.get(f"{auth_server.url}/health").status_code == 200
    assert httpx.get(f"{auth_server.url}/metrics").status_code == 200


def test_protect_open_endpoints_puts_health_and_metrics_behind_the_key(tiny_built: Any):
    settings = ServerSettings(api_key=KEY, protect_open_endpoints=True)
    with live_server(tiny_built, settings) as live:
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(f"{live.url}{path}").status_code == 401
            auth = {"Authorization": f"Bearer {KEY}"}
            assert httpx.get(f"{live.url}{path}", headers=auth).status_code == 200


@pytest.fixture(scope="module")
def queue_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    """One sequence at a time, at most two waiting; priorities honoured."""
    built = build_tiny(
        tiny_model_dir, max_num_seqs=1, max_queued_requests=2, scheduling_policy="priority"
    )
    with live_server(built, ServerSettings(served_model_names=(TINY_MODEL_NAME,))) as live:
        yield live


def test_full_queue_is_503_with_retry_after(queue_server: LiveServer):
    long = {**CHAT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    url = f"{queue_server.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=long, timeout=60) as running:
        lines = running.iter_lines()  # keep the iterator: dropping it closes the connection
        next(lines)
        short = {**CHAT, "ignore_eos": True}
        waiting = [
            threading.Thread(target=httpx.post, args=(url,), kwargs={"json": short})
            for _ in range(2)
        ]
        for thread in waiting:
            thread.start()
        wait_for_waiting(queue_server, 2)
        rejected = httpx.post(url, json=CHAT)
    assert rejected.status_code == 503
    assert rejected.headers["retry-after"] == "1"
    assert rejected.json()["error"]["code"] == "queue_full"
    assert "queued" in rejected.json()["error"]["message"]
    for thread in waiting:
        thread.join(60)


def wait_for_waiting(live: LiveServer, count: int) -> None:
    deadline = time.monotonic() + 10
    while live.ctx.engine.stats().num_waiting < count:
        assert time.monotonic() < deadline, f"{count} requests never queued"
        time.sleep(0.01)


def test_priority_orders_the_waiting_queue(queue_server: LiveServer):
    url = f"{queue_server.url}/v1/chat/completions"
    finished: list[str] = []

    def send(name: str, priority: int) -> None:
        body = {**CHAT, "max_tokens": 4, "ignore_eos": True, "priority": priority}
        assert httpx.post(url, json=body, timeout=60).status_code == 200
        finished.append(name)

    long = {**CHAT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url, json=long, timeout=60) as running:
        lines = running.iter_lines()
        next(lines)
        low = threading.Thread(target=send, args=("low", 5))
        low.start()
        wait_for_waiting(queue_server, 1)
        high = threading.Thread(target=send, args=("high", -5))
        high.start()
        wait_for_waiting(queue_server, 2)
    # Closing the running stream aborts it; with one sequence at a time, the more
    # important request (lower value) runs first although it arrived second.
    low.join(60)
    high.join(60)
    assert finished == ["high", "low"]


class FailingRunner:
    """Wraps the real runner; raises once ``armed`` is set (fault injection)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.armed = threading.Event()

    def execute(self, scheduler_output: Any) -> Any:
        if self.armed.is_set():
            # Device-fatal (a contained batch failure would leave the engine alive).
            raise RuntimeError("CUDA error: injected device failure")
        return self.runner.execute(scheduler_output)


def test_engine_failure_gives_500_then_503(tiny_model_dir: Path):
    built = build_tiny(tiny_model_dir)
    failing = FailingRunner(built.core.runner)
    built.core.runner = failing
    with live_server(built, ServerSettings(served_model_names=(TINY_MODEL_NAME,))) as live:
        url = f"{live.url}/v1/chat/completions"
        assert httpx.post(url, json=CHAT).status_code == 200
        long = {**CHAT, "max_tokens": 900, "ignore_eos": True}
        with httpx.stream("POST", url, json={**long, "stream": True}, timeout=30) as stream:
            lines = stream.iter_lines()
            next(lines)
            failing.armed.set()
            rest = "\n".join(lines)
        assert '"error"' in rest and "injected device failure" in rest
        assert rest.rstrip().endswith("data: [DONE]")
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503
        assert "injected device failure" in health.json()["error"]["message"]
        new = httpx.post(url, json=CHAT)
        assert new.status_code == 503
        assert new.json()["error"]["code"] == "engine_dead"


def test_in_flight_non_streaming_request_gets_500(tiny_model_dir: Path):
    built = build_tiny(tiny_model_dir)
    failing = FailingRunner(built.core.runner)
    built.core.runner = failing
    with live_server(built, ServerSettings(served_model_names=(TINY_MODEL_NAME,))) as live:
        url = f"{live.url}/v1/chat/completions"
        result: dict[str, httpx.Response] = {}
        long = {**CHAT, "max_tokens": 900, "ignore_eos": True}
        worker = threading.Thread(
            target=lambda: result.setdefault("r", httpx.post(url, json=long, timeout=30))
        )
        worker.start()
        deadline = time.monotonic() + 10
        while live.ctx.engine.stats().num_running < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        failing.armed.set()
        worker.join(30)
        resp = result["r"]
        assert resp.status_code == 500
        assert resp.json()["error"]["type"] == "internal_server_error"
