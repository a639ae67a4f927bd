"""Bodies and headers that do not arrive in time (issue 42), against ``kvserve serve``.

A raw socket plays the slow client: a body that declares 100 bytes and sends 10, headers
that never end, a connection that sends nothing. Each is answered 408 (or, having sent
nothing, closed) after the configured timeout, and the connection is closed; a body that
arrives in pieces within the timeout is served as usual.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.cli import build_parser, settings_from
from server.settings import DEFAULT_REQUEST_BODY_TIMEOUT_S, DEFAULT_REQUEST_HEADER_TIMEOUT_S
from tests.server.conftest import KvserveProcess, kvserve_process

pytestmark = pytest.mark.slow

TIMEOUT_S = 1.0
# The answer must come after the timeout and well before a hang; generous for a loaded
# machine (the bound is on the server's side, the slack on the test's).
ANSWER_WITHIN_S = TIMEOUT_S + 15


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[KvserveProcess]:
    flags = ("--request-body-timeout", str(TIMEOUT_S), "--request-header-timeout", str(TIMEOUT_S))
    with kvserve_process(tiny_model_dir, "--kernels", "torch", *flags) as server:
        yield server


def connect(server: KvserveProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=ANSWER_WITHIN_S + 5)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def error_of(response: bytes) -> dict[str, object]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), head
    assert b"connection: close" in head.lower()
    error: dict[str, object] = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    return error


def rejections(server: KvserveProcess, reason: str) -> float:
    """``kvserve_requests_rejected_total{reason=...}`` (0 before the first)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("kvserve_requests_rejected_total{") and f'"{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_body_that_stops_short_is_408_and_the_connection_closed(served: KvserveProcess):
    before = rejections(served, "body_timeout")
    with connect(served) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: kvserve\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            b'{"prompt":'  # 10 of the 100 bytes, then nothing
        )
        start = time.monotonic()
        response = read_until_closed(sock)
        waited = time.monotonic() - start
    error = error_of(response)
    assert "--request-body-timeout" in str(error["message"])
    assert TIMEOUT_S * 0.9 <= waited < ANSWER_WITHIN_S
    assert rejections(served, "body_timeout") == before + 1


def test_headers_that_never_end_are_408_and_the_connection_closed(served: KvserveProcess):
    before = rejections(served, "header_timeout")
    with connect(served) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvserve\r\n")  # no blank line
        start = time.monotonic()
        response = read_until_closed(sock)
        waited = time.monotonic() - start
    error = error_of(response)
    assert "--request-header-timeout" in str(error["message"])
    assert TIMEOUT_S * 0.9 <= waited < ANSWER_WITHIN_S
    assert rejections(served, "header_timeout") == before + 1


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(served: KvserveProcess):
    with connect(served) as sock:
        start = time.monotonic()
        response = read_until_closed(sock)
        waited = time.monotonic() - start
    assert response == b""
    assert TIMEOUT_S * 0.9 <= waited < ANSWER_WITHIN_S


def test_a_body_sent_in_pieces_within_the_timeout_is_served(served: KvserveProcess):
    body = json.dumps({"prompt": "hello there"}).encode()
    with connect(served) as sock:
        sock.sendall(
            b"POST /tokenize HTTP/1.1\r\nHost: kvserve\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        sock.sendall(body[:5])
        time.sleep(TIMEOUT_S / 4)
        sock.sendall(body[5:])
        response = read_until_closed(sock)
    assert response.startswith(b"HTTP/1.1 200 "), response[:200]
    assert b'"count":' in response


def test_the_documented_defaults_are_the_cli_defaults():
    settings = settings_from(build_parser().parse_args(["serve"]))
    assert settings.request_header_timeout_s == DEFAULT_REQUEST_HEADER_TIMEOUT_S == 10.0
    assert settings.request_body_timeout_s == DEFAULT_REQUEST_BODY_TIMEOUT_S == 60.0
    page = Path(__file__).resolve().parents[2] / "docs" / "reference" / "configuration.md"
    assert "| `--request-header-timeout` | 10 |" in page.read_text()
    assert "| `--request-body-timeout` | 60 |" in page.read_text()
