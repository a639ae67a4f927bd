"""Graceful shutdown of the real ``kvserve serve`` process: SIGTERM stops new work, lets
in-flight streams finish within --shutdown-timeout, then ends the rest cleanly (an error
event and [DONE], their requests aborted) and exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

SHUTDOWN_TIMEOUT_S = 2.0
# The drain test waits for an event (the stream's [DONE]), not for a race against the
# clock: its drain window is only a hang guard, long enough for a loaded machine.
DRAIN_HANG_GUARD_S = 120.0


@dataclass
class ServeProcess:
    process: subprocess.Popen[bytes]
    url: str


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def serve(tiny_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[ServeProcess]:
    """``kvserve serve`` with ``--shutdown-timeout`` from the test's ``shutdown_timeout``
    marker (default SHUTDOWN_TIMEOUT_S)."""
    marker = request.node.get_closest_marker("shutdown_timeout")
    shutdown_timeout = marker.args[0] if marker else SHUTDOWN_TIMEOUT_S
    port = free_port()
    command = [
        *(sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_model_dir)),
        *("--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "512"),
        *("--max-model-len", "1024", "--port", str(port), "--log-level", "warning"),
        *("--shutdown-timeout", str(shutdown_timeout)),
    ]
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(command, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, "kvserve serve exited during start-up"
        assert time.monotonic() < deadline, "kvserve serve did not become healthy"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    try:
        yield ServeProcess(process, url)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def stream_body(max_tokens: int) -> dict[str, object]:
    return {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def read_stream(url: str, body: dict[str, object], started: threading.Event) -> str:
    """The whole SSE text, or what arrived before the connection was cut."""
    received: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                received.append(line)
                started.set()
    except httpx.HTTPError:
        received.append("<cut>")
    started.set()
    return "\n".join(received)


@pytest.mark.shutdown_timeout(DRAIN_HANG_GUARD_S)
def test_sigterm_drains_in_flight_streams(serve: ServeProcess):
    started = threading.Event()
    result: dict[str, str] = {}
    body = stream_body(max_tokens=200)
    worker = threading.Thread(
        target=lambda: result.setdefault("text", read_stream(serve.url, body, started))
    )
    worker.start()
    assert started.wait(60)
    serve.process.send_signal(signal.SIGTERM)
    worker.join(DRAIN_HANG_GUARD_S + 30)
    assert not worker.is_alive(), "the stream did not end within the hang guard"
    assert serve.process.wait(30) == 0
    text = result["text"]
    assert "<cut>" not in text and text.rstrip().endswith("data: [DONE]")
    assert '"finish_reason":"length"' in text
    # Every token arrived. Counted from the usage chunk, not from content chunks: a token
    # holding part of a UTF-8 character is sent with the next one.
    assert '"completion_tokens":200' in text


def test_sigterm_aborts_what_outlives_the_timeout_and_exits(serve: ServeProcess):
    # Far more decoding than fits in the drain window: 12 streams of 980 tokens.
    streams = 12
    events = [threading.Event() for _ in range(streams)]
    results: list[str] = [""] * streams

    def run(i: int) -> None:
        results[i] = read_stream(serve.url, stream_body(max_tokens=980), events[i])

    workers = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for worker in workers:
        worker.start()
    for event in events:
        assert event.wait(60)
    start = time.monotonic()
    serve.process.send_signal(signal.SIGTERM)
    code = serve.process.wait(SHUTDOWN_TIMEOUT_S + 30)  # bounded: no hang on shutdown
    elapsed = time.monotonic() - start
    for worker in workers:
        worker.join(30)
        assert not worker.is_alive()
    assert code == 0
    # New connections are refused once it is gone.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{serve.url}/health", timeout=2)
    # Every stream finished in the drain window or, just before it closed, was ended
    # with an error event and [DONE] -- none was cut mid-chunk.
    for text in results:
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
    ended = [text for text in results if "shutting down" in text]
    assert ended, "the load was meant to outlive the drain window"
    assert elapsed >= SHUTDOWN_TIMEOUT_S * 0.5  # the drain window was honoured
