"""Overload and bad input through the real HTTP server (issue 7).

- per-request limits: each breach is a 4xx in OpenAI's shape that names the limit;
- backpressure: a queue bounded by queued tokens answers 503 + Retry-After, and a request
  that waits longer than --queue-timeout gets a 503 (streaming or not) -- no leaked blocks;
- a failing batch ends only its own requests with a 500; the server stays healthy.
"""

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

CHAT = {
    "model": TINY_MODEL_NAME,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
}
LONG = {**CHAT, "max_tokens": 900, "ignore_eos": True}


def chat_url(live: LiveServer) -> str:
    return f"{live.url}/v1/chat/completions"


def error_of(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def wait_until(predicate: Any, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# -- per-request limits ------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(tiny_built: Any) -> Iterator[LiveServer]:
    settings = ServerSettings(
        served_model_names=(TINY_MODEL_NAME,),
        max_request_body_bytes=20_000,
        max_messages=4,
        max_n=2,
    )
    with live_server(tiny_built, settings) as live:
        yield live


def test_too_many_messages_is_400_naming_the_limit(limited: LiveServer):
    messages = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    error = error_of(httpx.post(chat_url(limited), json={**CHAT, "messages": messages}), 400)
    assert error["param"] == "messages" and error["code"] == "too_many_messages"
    assert "at most 4" in error["message"] and "--max-messages" in error["message"]
    ok = httpx.post(chat_url(limited), json={**CHAT, "messages": messages[:4]})
    assert ok.status_code == 200


def test_n_above_the_limit_is_400(limited: LiveServer):
    error = error_of(httpx.post(chat_url(limited), json={**CHAT, "n": 3}), 400)
    assert error["param"] == "n" and "at most 2" in error["message"]


def test_stop_list_too_long_is_400(limited: LiveServer):
    body = {**CHAT, "stop": [f"s{i}" for i in range(17)]}
    error = error_of(httpx.post(chat_url(limited), json=body), 400)
    assert "'stop' accepts at most 16" in error["message"]


def test_max_tokens_beyond_the_context_is_400(limited: LiveServer):
    body = {**CHAT, "max_tokens": 10_000}
    error = error_of(httpx.post(chat_url(limited), json=body), 400)
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert "maximum context length is 1024" in error["message"]


def test_body_over_the_limit_names_the_limit(limited: LiveServer):
    body = {**CHAT, "messages": [{"role": "user", "content": "x" * 30_000}]}
    # 413 Content Too Large: the HTTP status made for this limit, still OpenAI-shaped.
    error = error_of(httpx.post(chat_url(limited), json=body), 413)
    assert "20000 bytes" in error["message"] and "--max-request-body-bytes" in error["message"]


def test_limits_leave_no_blocks_behind(limited: LiveServer):
    assert limited.wait_idle().device_blocks.used == 0


# -- backpressure ----------------------------------------------------------------------------


class SlowRunner:
    """The real runner, slowed to at least ``step_s`` per step: a long request then
    surely outlives the test's other requests."""

    def __init__(self, runner: Any, step_s: float = 0.01) -> None:
        self.runner = runner
        self.step_s = step_s

    def execute(self, out: Any) -> Any:
        time.sleep(self.step_s)
        return self.runner.execute(out)


@pytest.fixture(scope="module")
def token_bounded(tiny_model_dir: Path) -> Iterator[LiveServer]:
    built = build_tiny(tiny_model_dir, max_num_seqs=1, max_queued_tokens=100)
    built.core.runner = SlowRunner(built.core.runner)
    with live_server(built, ServerSettings(served_model_names=(TINY_MODEL_NAME,))) as live:
        yield live


def prompt_of_tokens(live: LiveServer, words: int) -> dict[str, Any]:
    return {**CHAT, "messages": [{"role": "user", "content": " ".join(["word"] * words)}]}


def test_queue_bounded_by_tokens_is_503_with_retry_after(token_bounded: LiveServer):
    live = token_bounded
    with httpx.stream("POST", chat_url(live), json={**LONG, "stream": True}, timeout=60) as run:
        # Keep the iterator referenced: dropping it closes the connection (a disconnect).
        lines = run.iter_lines()
        next(lines)  # running: the only sequence slot is taken
        queued = threading.Thread(
            target=httpx.post,
            args=(chat_url(live),),
            kwargs={"json": prompt_of_tokens(live, 25), "timeout": 60},
        )
        queued.start()
        wait_until(lambda: live.ctx.engine.stats().num_waiting == 1)
        rejected = httpx.post(chat_url(live), json=prompt_of_tokens(live, 25))
        error = error_of(rejected, 503)
        assert rejected.headers["retry-after"] == "1"
        assert error["code"] == "queue_full" and "limit 100" in error["message"]
    queued.join(60)
    assert live.wait_idle().device_blocks.used == 0


@pytest.fixture(scope="module")
def timeout_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    built = build_tiny(tiny_model_dir, max_num_seqs=1)
    built.core.runner = SlowRunner(built.core.runner)
    settings = ServerSettings(served_model_names=(TINY_MODEL_NAME,), queue_timeout_s=0.3)
    with live_server(built, settings) as live:
        yield live


@pytest.mark.parametrize("stream", [False, True])
def test_queue_timeout_is_503(timeout_server: LiveServer, stream: bool):
    live = timeout_server
    with httpx.stream("POST", chat_url(live), json={**LONG, "stream": True}, timeout=60) as run:
        lines = run.iter_lines()
        next(lines)
        start = time.monotonic()
        late = httpx.post(chat_url(live), json={**CHAT, "stream": stream}, timeout=30)
        waited = time.monotonic() - start
        assert live.ctx.engine.stats().num_running == 1  # the long request still runs
        error = error_of(late, 503)
        assert error["code"] == "queue_timeout"
        assert late.headers["retry-after"] == "1"
        assert waited < 20  # answered promptly, not after the long request
    stats = live.wait_idle()
    assert stats.device_blocks.used == 0 and stats.num_waiting == 0


def test_queue_timeout_spares_requests_that_start_in_time(timeout_server: LiveServer):
    resp = httpx.post(chat_url(timeout_server), json={**CHAT, "stream": True}, timeout=30)
    assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")


# -- a failing batch -------------------------------------------------------------------------


class FailRequestsMentioning:
    """Raises (a contained, non-fatal error) on any forward whose batch holds the token
    ids of ``poison``; everything else runs on the real runner."""

    def __init__(self, runner: Any, poison: list[int]) -> None:
        self.runner = runner
        self.poison = poison

    def execute(self, out: Any) -> Any:
        for request in out.scheduled:
            ids = request.prompt_token_ids
            if any(ids[i : i + len(self.poison)] == self.poison for i in range(len(ids))):
                raise ValueError("injected kernel failure")
        return self.runner.execute(out)


@pytest.fixture(scope="module")
def faulty(tiny_model_dir: Path) -> Iterator[LiveServer]:
    built = build_tiny(tiny_model_dir, max_num_seqs=4)
    poison = built.tokenizer.encode(" zebra-poison-marker", add_special_tokens=False)
    built.core.runner = FailRequestsMentioning(SlowRunner(built.core.runner), poison)
    with live_server(built, ServerSettings(served_model_names=(TINY_MODEL_NAME,))) as live:
        yield live


def test_failed_batch_is_500_and_the_server_lives_on(faulty: LiveServer):
    live = faulty
    poisoned = {**CHAT, "messages": [{"role": "user", "content": "a zebra-poison-marker"}]}
    error = error_of(httpx.post(chat_url(live), json=poisoned, timeout=30), 500)
    assert error["code"] == "engine_fault" and "injected kernel failure" in error["message"]
    streamed = httpx.post(chat_url(live), json={**poisoned, "stream": True}, timeout=30)
    assert error_of(streamed, 500)["code"] == "engine_fault"
    assert httpx.get(f"{live.url}/health").status_code == 200
    ok = httpx.post(chat_url(live), json={**CHAT, "max_tokens": 5, "ignore_eos": True})
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 5
    assert live.wait_idle().device_blocks.used == 0


def test_a_stream_in_a_failed_batch_ends_with_an_error_event(faulty: LiveServer):
    live = faulty
    # A healthy stream is decoding when the poisoned request joins its batch (continuous
    # batching: one forward for both); that batch fails, so both requests end -- the
    # stream with an error event and [DONE], never a hang. Later requests are fine.
    body = {**LONG, "max_tokens": 300, "stream": True}
    with httpx.stream("POST", chat_url(live), json=body, timeout=60) as run:
        lines = run.iter_lines()
        next(lines)
        poisoned = {**CHAT, "messages": [{"role": "user", "content": "a zebra-poison-marker"}]}
        bad = httpx.post(chat_url(live), json=poisoned, timeout=30)
        rest = "\n".join(lines)
    assert bad.status_code == 500
    assert '"engine_fault"' in rest and "injected kernel failure" in rest
    assert rest.rstrip().endswith("data: [DONE]")
    assert httpx.get(f"{live.url}/health").status_code == 200
    assert httpx.post(chat_url(live), json=CHAT, timeout=30).status_code == 200
    assert live.wait_idle().device_blocks.used == 0
