"""--unknown-fields: a body's unknown top-level keys ignored by default (named in a header,
counted, warned about once) or refused under ``reject``; nested ones refused always."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from server.settings import ServerSettings
from server.unknown_fields import MAX_FIELD_LABELS, OTHER_FIELD_LABEL
from tests.server.conftest import TINY_MODEL_NAME, LiveServer, live_server

# What vllm-router 0.1.17 adds to every chat body it forwards.
ROUTER_FIELDS = {
    "no_stop_trim": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
HEADER = "x-kvserve-ignored-fields"


def chat(**fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hi"}]
    return {"model": TINY_MODEL_NAME, "messages": messages, "max_tokens": 3, **fields}


def post(server: LiveServer, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def ignored_counts(server: LiveServer) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("kvserve_request_fields_ignored_total{"):
            field = line.split('field="', 1)[1].split('"', 1)[0]
            counts[field] = float(line.rsplit(" ", 1)[1])
    return counts


@pytest.fixture(scope="module")
def strict_server(tiny_built: Any) -> Iterator[LiveServer]:
    settings = ServerSettings(served_model_names=(TINY_MODEL_NAME,), unknown_fields="reject")
    with live_server(tiny_built, settings) as live:
        yield live


def test_router_fields_are_ignored_named_and_counted(server: LiveServer) -> None:
    before = ignored_counts(server)
    plain = post(server, "/v1/chat/completions", chat(temperature=0))
    routed = post(server, "/v1/chat/completions", chat(temperature=0, **ROUTER_FIELDS))
    assert plain.status_code == routed.status_code == 200, routed.text
    assert HEADER not in plain.headers
    assert routed.headers[HEADER].split(", ") == list(ROUTER_FIELDS)
    # Ignored means ignored: the answer is the one without them.
    assert routed.json()["choices"] == plain.json()["choices"]
    after = ignored_counts(server)
    for name in ROUTER_FIELDS:
        assert after[name] - before.get(name, 0) == 1


def test_every_body_route_ignores_and_streams_carry_the_header(server: LiveServer) -> None:
    bodies = {
        "/v1/completions": {"model": TINY_MODEL_NAME, "prompt": "a", "max_tokens": 2},
        "/tokenize": {"model": TINY_MODEL_NAME, "prompt": "a b"},
        "/v1/responses": {"model": TINY_MODEL_NAME, "input": "a", "max_output_tokens": 2},
        "/v1/messages": {
            "model": TINY_MODEL_NAME,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "a"}],
        },
    }
    for path, body in bodies.items():
        resp = post(server, path, {**body, "x_trace_id": "abc"})
        assert resp.status_code == 200, (path, resp.text)
        assert resp.headers[HEADER] == "x_trace_id", path
    body = chat(stream=True, x_trace_id="abc")
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers[HEADER] == "x_trace_id"
        assert "data: [DONE]" in resp.read().decode()


def test_nested_and_known_unsupported_fields_stay_refused(server: LiveServer) -> None:
    stray = chat(messages=[{"role": "user", "content": "hi", "no_stop_trim": True}])
    error = post(server, "/v1/chat/completions", stray).json()["error"]
    assert "no_stop_trim" in error["message"]
    refused = {"functions": [{"name": "f"}], "audio": {"voice": "x"}, "use_beam_search": True}
    for field, value in refused.items():
        resp = post(server, "/v1/chat/completions", chat(**{field: value}))
        assert resp.status_code == 400 and field in resp.json()["error"]["message"]
    resp = post(server, "/v1/completions", {"model": TINY_MODEL_NAME, "prompt": "a", "suffix": "b"})
    assert resp.status_code == 400 and "suffix" in resp.json()["error"]["message"]


def test_the_first_sighting_warns_and_later_ones_do_not(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvserve.server"):
        for _ in range(3):
            assert post(server, "/v1/chat/completions", chat(warned_once=1)).status_code == 200
    warnings = [r for r in caplog.records if "warned_once" in r.getMessage()]
    assert len(warnings) == 1
    assert "/v1/chat/completions" in warnings[0].getMessage()


def test_a_client_cannot_grow_the_metric_without_bound(server: LiveServer) -> None:
    junk = {f"junk_{index}": index for index in range(MAX_FIELD_LABELS + 10)}
    resp = post(server, "/v1/chat/completions", chat(**junk))
    assert resp.status_code == 200
    assert resp.headers[HEADER].endswith(", ...")  # the header names at most 16
    counts = ignored_counts(server)
    assert len(counts) <= MAX_FIELD_LABELS + 1
    assert counts[OTHER_FIELD_LABEL] >= 10


def test_reject_refuses_every_unknown_field_by_name(strict_server: LiveServer) -> None:
    resp = post(strict_server, "/v1/chat/completions", chat(**ROUTER_FIELDS))
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "no_stop_trim"
    for name in ROUTER_FIELDS:
        assert name in error["message"]
    assert post(strict_server, "/v1/chat/completions", chat()).status_code == 200
