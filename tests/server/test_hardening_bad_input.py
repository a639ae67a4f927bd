"""Bad values in valid JSON, on every route and field (issue 42), through the real server.

- Text that cannot be encoded -- a lone UTF-16 surrogate, ``"\\ud800"``, valid JSON -- in
  any string or object key of any body is a 400 in OpenAI's shape whose ``param`` names
  the field (it was a 500 TypeError / UnicodeEncodeError).
- ``NaN``, ``Infinity``, ``-Infinity`` and ``1e999`` in any float field are a 400 that
  says so ("must be a finite number, got NaN"), not "less than or equal to 2".

The bodies below are each valid as they stand; every string in them, every object key
and every float field is replaced in turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.conftest import TINY_MODEL_NAME, LiveServer

CHAT_BODY: dict[str, Any] = {
    "model": TINY_MODEL_NAME,
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is the weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "weather"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "The weather in a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "description": "Its name."}},
                },
            },
        }
    ],
    "tool_choice": "none",
    "stop": ["END"],
    "user": "user-1",
    "metadata": {"team": "ops"},
    "chat_template_kwargs": {"greeting": "hello"},
    "max_tokens": 2,
}
SCHEMA_BODY: dict[str, Any] = {
    "model": TINY_MODEL_NAME,
    "messages": [{"role": "user", "content": "Give me JSON."}],
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "answer",
            "description": "An answer.",
            "schema": {"type": "object", "properties": {"text": {"type": "string"}}},
        },
    },
    "max_tokens": 2,
}
COMPLETION_BODIES: list[dict[str, Any]] = [
    {"model": TINY_MODEL_NAME, "prompt": "Once upon a time", "stop": "END", "max_tokens": 2},
    {"model": TINY_MODEL_NAME, "prompt": ["one", "two"], "max_tokens": 2},
    {"model": TINY_MODEL_NAME, "prompt": "Pick", "guided_choice": ["yes", "no"], "max_tokens": 2},
    {"model": TINY_MODEL_NAME, "prompt": "Digits", "guided_regex": "[0-9]+", "max_tokens": 2},
]
TOKENIZE_BODIES: list[dict[str, Any]] = [
    {"model": TINY_MODEL_NAME, "prompt": "hello"},
    {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "hello"}]},
]
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", CHAT_BODY),
    ("/v1/chat/completions", SCHEMA_BODY),
    *(("/v1/completions", body) for body in COMPLETION_BODIES),
    *(("/tokenize", body) for body in TOKENIZE_BODIES),
    ("/detokenize", {"model": TINY_MODEL_NAME, "tokens": [1, 2]}),
]
SURROGATE = "\ud800"
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def post_raw(live: LiveServer, path: str, text: str) -> httpx.Response:
    """POST ``text`` as it is: httpx's ``json=`` cannot encode a lone surrogate."""
    headers = {"content-type": "application/json"}
    return httpx.post(f"{live.url}{path}", content=text.encode(), headers=headers, timeout=60)


def error_of(resp: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return error


def string_slots(value: Any, path: str = "") -> Iterator[tuple[str, bool, Any]]:
    """(path, is_key, key-or-index) of every string value and object key in ``value``."""
    if isinstance(value, dict):
        for key, child in value.items():
            yield path, True, key
            child_path = f"{path}.{key}" if path else key
            if isinstance(child, str):
                yield child_path, False, None
            yield from string_slots(child, child_path)
    elif isinstance(value, list):
        for i, child in enumerate(value):
            child_path = f"{path}.{i}"
            if isinstance(child, str):
                yield child_path, False, None
            yield from string_slots(child, child_path)


def with_surrogate(body: Any, path: str, is_key: bool, key: Any) -> Any:
    """A deep copy of ``body`` with a surrogate in the value at ``path`` (or in ``key``,
    an object key of the object at ``path``)."""
    copy = json.loads(json.dumps(body))
    parts = path.split(".") if path else []
    holder = copy
    for part in parts[:-1] if not is_key else parts:
        holder = holder[int(part)] if isinstance(holder, list) else holder[part]
    if is_key:
        holder[key + SURROGATE] = holder.pop(key)
    else:
        last = int(parts[-1]) if isinstance(holder, list) else parts[-1]
        holder[last] = holder[last] + SURROGATE
    return copy


@pytest.mark.parametrize("path,body", ROUTES, ids=[f"{p}#{i}" for i, (p, _) in enumerate(ROUTES)])
def test_every_body_is_valid_as_it_stands(server: LiveServer, path: str, body: dict[str, Any]):
    # tools need --enable-auto-tool-choice only for "auto"; "none" is served anywhere.
    assert post_raw(server, path, json.dumps(body)).status_code == 200


@pytest.mark.parametrize("path,body", ROUTES, ids=[f"{p}#{i}" for i, (p, _) in enumerate(ROUTES)])
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(
    server: LiveServer, path: str, body: dict[str, Any]
):
    slots = list(string_slots(body))
    assert len(slots) >= 3
    for field, is_key, key in slots:
        text = json.dumps(with_surrogate(body, field, is_key, key))  # "\\ud800" escapes
        assert "\\ud800" in text
        error = error_of(post_raw(server, path, text))
        assert error["param"] == (field or None), (field, is_key, error)
        assert "U+D800" in error["message"] and "surrogate" in error["message"]
        if is_key:
            where = f"a key of '{field}'" if field else "a key of the body"
        else:
            where = f"'{field}'"
        assert error["message"].startswith(where), error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_trailing_surrogate_and_the_model_field(server: LiveServer):
    body = {"model": "tiny\udc00llama", "prompt": "hi", "max_tokens": 1}
    error = error_of(post_raw(server, "/v1/completions", json.dumps(body)))
    assert error["param"] == "model" and "U+DC00" in error["message"]
    # A valid pair (an emoji spelled as two escapes) is text, not an error.
    body = {"model": TINY_MODEL_NAME, "prompt": "hi \ud83d\ude00", "max_tokens": 1}
    assert post_raw(server, "/v1/completions", json.dumps(body)).status_code == 200


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    "literal,spelled",
    [("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity"), ("1e999", "Infinity")],
)
def test_non_finite_floats_are_named_as_such(
    server: LiveServer, route: str, literal: str, spelled: str
):
    base = CHAT_BODY if route == "/v1/chat/completions" else COMPLETION_BODIES[0]
    for field in FLOAT_FIELDS:
        text = json.dumps({**base, field: "__NUMBER__"}).replace('"__NUMBER__"', literal)
        error = error_of(post_raw(server, route, text))
        assert error["param"] == field
        assert error["message"] == f"'{field}' must be a finite number, got {spelled}"
    text = json.dumps({**base, "logit_bias": {"50": "__NUMBER__"}}).replace('"__NUMBER__"', literal)
    error = error_of(post_raw(server, route, text))
    assert error["param"] == "logit_bias.50" and f"got {spelled}" in error["message"]


def test_bodies_that_are_not_json_or_not_utf8_are_400(server: LiveServer):
    headers = {"content-type": "application/json"}
    for raw in (b'{"prompt": "\xff\xfe"}', b'{"prompt": 1' + b"0" * 5000 + b"}", b"[" * 100_000):
        resp = httpx.post(f"{server.url}/v1/completions", content=raw, headers=headers)
        error_of(resp)
    assert httpx.get(f"{server.url}/health").status_code == 200


RESPONSES_BODY: dict[str, Any] = {
    "model": TINY_MODEL_NAME,
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is the weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ],
    "tools": [
        {
            "type": "function",
            "name": "weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
    "tool_choice": "none",
    "metadata": {"team": "ops"},
    "max_output_tokens": 2,
    "store": False,
}
MESSAGES_BODY: dict[str, Any] = {
    "model": TINY_MODEL_NAME,
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is the weather?"}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "weather", "input": {"c": "x"}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}],
        },
    ],
    "tools": [
        {
            "name": "weather",
            "description": "The weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
    "tool_choice": {"type": "none"},
    "stop_sequences": ["END"],
    "metadata": {"user_id": "u1"},
    "max_tokens": 2,
}
COUNT_BODY = {key: value for key, value in MESSAGES_BODY.items() if key != "max_tokens"}
RENDER_CHAT_BODY = {key: value for key, value in CHAT_BODY.items() if key != "max_tokens"}
# The agent APIs and the render endpoints (added after the first sweep), with each API's
# own error shape: OpenAI's for Responses and render, Anthropic's for Messages.
AGENT_ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/responses", RESPONSES_BODY),
    ("/v1/messages", MESSAGES_BODY),
    ("/v1/messages/count_tokens", COUNT_BODY),
    ("/v1/chat/completions/render", RENDER_CHAT_BODY),
    ("/v1/completions/render", {"model": TINY_MODEL_NAME, "prompt": ["one", "two"]}),
]


def error_message(path: str, resp: httpx.Response) -> str:
    """The 400's message, checked against the envelope its API uses."""
    assert resp.status_code == 400, resp.text
    body = resp.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        return str(body["error"]["message"])
    assert body["error"]["type"] == "invalid_request_error"
    return str(body["error"]["message"])


@pytest.mark.parametrize("path,body", AGENT_ROUTES, ids=[p for p, _ in AGENT_ROUTES])
def test_agent_and_render_routes_refuse_a_lone_surrogate_anywhere(
    server: LiveServer, path: str, body: dict[str, Any]
):
    assert post_raw(server, path, json.dumps(body)).status_code == 200
    slots = list(string_slots(body))
    assert len(slots) >= 3
    for field, is_key, key in slots:
        text = json.dumps(with_surrogate(body, field, is_key, key))
        message = error_message(path, post_raw(server, path, text))
        assert "U+D800" in message and "surrogate" in message, (field, message)
        where = (f"a key of '{field}'" if field else "a key of the body") if is_key else field
        assert where in message, (field, is_key, message)
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize(
    "path,field",
    [
        ("/v1/chat/completions", "messages"),
        ("/v1/responses", "input"),
        ("/v1/messages", "messages"),
        ("/v1/messages/count_tokens", "messages"),
        ("/tokenize", "messages"),
    ],
)
def test_a_conversation_past_max_messages_is_refused_before_validation(
    server: LiveServer, path: str, field: str
):
    """Each turn counts against --max-messages (512 here), checked on the parsed JSON:
    100,000 turns never become objects to validate (docs/reference/reliability.md, "Event loop")."""
    turns = [{"role": "user", "content": "hi"}] * 513
    body = {"model": TINY_MODEL_NAME, field: turns, "max_tokens": 1}
    resp = post_raw(server, path, json.dumps(body))
    message = error_message(path, resp)
    assert f"'{field}' has 513 entries" in message and "--max-messages" in message
    if not path.startswith("/v1/messages"):
        assert resp.json()["error"]["code"] == "too_many_messages"
    body[field] = turns[:512]  # at the limit: past this check (the route answers as usual)
    assert "entries" not in post_raw(server, path, json.dumps(body)).text
