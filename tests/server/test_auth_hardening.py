"""Let no one in: the API key is checked before anything else happens.

(The basic missing / wrong / right key suite lives in test_server_configs.py; these are
the hardening cases: no body is read, no engine work is done and no near-miss key is
accepted for a request without the right key.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from server.settings import ServerSettings
from tests.server.conftest import TINY_MODEL_NAME, LiveServer, live_server

KEY = "k-7f3a9c1e5b"
CHAT = {
    "model": TINY_MODEL_NAME,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
}


@pytest.fixture(scope="module")
def locked(tiny_built: Any) -> Iterator[LiveServer]:
    settings = ServerSettings(
        served_model_names=(TINY_MODEL_NAME,), api_key=KEY, max_request_body_bytes=10_000
    )
    with live_server(tiny_built, settings) as live:
        yield live


@pytest.mark.parametrize(
    "authorization",
    [
        f"Bearer {KEY[:-1]}",  # a prefix of the key
        f"Bearer {KEY}x",  # the key plus a character
        f"Bearer {KEY.upper()}",  # case matters in the key
        f"Token {KEY}",  # another scheme
        f"Bearer{KEY}",  # no separator
        "Bearer",  # no key at all
    ],
)
def test_near_miss_keys_are_refused(locked: LiveServer, authorization: str):
    resp = httpx.post(
        f"{locked.url}/v1/chat/completions", json=CHAT, headers={"Authorization": authorization}
    )
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "invalid_api_key"


def test_refused_requests_do_no_engine_work(locked: LiveServer):
    before = locked.ctx.engine.stats()
    for path, body in [
        ("/v1/chat/completions", {**CHAT, "stream": True}),
        ("/v1/completions", {"model": TINY_MODEL_NAME, "prompt": "x", "max_tokens": 2}),
        ("/tokenize", {"prompt": "hello"}),
    ]:
        resp = httpx.post(f"{locked.url}{path}", json=body)
        assert resp.status_code == 401
        assert resp.headers["content-type"].startswith("application/json")  # never SSE
    after = locked.ctx.engine.stats()
    assert after.prompt_tokens_total == before.prompt_tokens_total
    assert after.steps_total == before.steps_total


def test_the_key_is_checked_before_the_body_is_read(locked: LiveServer):
    # An unauthenticated client cannot make the server read (or even size-check) a body.
    huge = {**CHAT, "messages": [{"role": "user", "content": "x" * 50_000}]}
    assert httpx.post(f"{locked.url}/v1/chat/completions", json=huge).status_code == 401
    authorized = httpx.post(
        f"{locked.url}/v1/chat/completions",
        json=huge,
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert authorized.status_code == 413


def test_the_right_key_gets_through(locked: LiveServer):
    resp = httpx.post(
        f"{locked.url}/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"bearer {KEY}"},  # the scheme is case-insensitive
    )
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == 2
