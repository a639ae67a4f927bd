"""Every error path answers in OpenAI's shape with the right status."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import TINY_MAX_MODEL_LEN, TINY_MODEL_NAME, LiveServer

USER = [{"role": "user", "content": "hi"}]


def post(server: LiveServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{server.url}{path}", content=body, timeout=30, **kwargs)
    return httpx.post(f"{server.url}{path}", json=body, timeout=30, **kwargs)


def assert_error(resp: httpx.Response, status: int, *needles: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in error["message"], error["message"]
    return dict(error)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "messages": USER, "max_tokens": 2, **fields}


def test_malformed_json(server: LiveServer):
    resp = post(server, "/v1/chat/completions", b'{"model": "x", "messages": [')
    assert_error(resp, 400)


def test_body_that_is_not_an_object(server: LiveServer):
    assert_error(post(server, "/v1/chat/completions", [1, 2, 3]), 400)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 10**9}, "n"),
        ({"seed": 2**70}, "seed"),
        ({"stream": "yes"}, "stream"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"logit_bias": {"1": 500}}, None),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"stop": ""}, None),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
        ({"messages": "hi"}, "messages"),
    ],
)
def test_invalid_fields_are_400(server: LiveServer, fields: dict[str, Any], param: str | None):
    error = assert_error(post(server, "/v1/chat/completions", chat(**fields)), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("field", ["functions", "function_call"])
def test_unsupported_fields_are_named(server: LiveServer, field: str):
    # The legacy function-calling API stays refused (tools/tool_choice replace it).
    value: Any = [{"name": "f"}] if field == "functions" else "auto"
    resp = post(server, "/v1/chat/completions", chat(**{field: value}))
    assert_error(resp, 400, field)


def test_response_format_of_unknown_type(server: LiveServer):
    bad = post(server, "/v1/chat/completions", chat(response_format={"type": "xml"}))
    assert assert_error(bad, 400, "xml")["param"].startswith("response_format")
    good = post(server, "/v1/chat/completions", chat(response_format={"type": "text"}))
    assert good.status_code == 200


def test_unknown_nested_field_is_named(server: LiveServer):
    # Top-level unknown fields are ignored by default (tests/server/test_unknown_fields.py);
    # inside a message a stray key changes the meaning, so it stays a 400.
    messages = [{"role": "user", "content": "hi", "frobnicate": 1}]
    resp = post(server, "/v1/chat/completions", chat(messages=messages))
    assert_error(resp, 400, "frobnicate")


def test_unknown_model_is_404(server: LiveServer):
    error = assert_error(post(server, "/v1/chat/completions", chat(model="gpt-17")), 404, "gpt-17")
    assert error["code"] == "model_not_found"
    assert_error(httpx.get(f"{server.url}/v1/models/gpt-17"), 404)


def test_prompt_longer_than_context(server: LiveServer):
    ids = [100] * (TINY_MAX_MODEL_LEN + 10)
    body = {"model": TINY_MODEL_NAME, "prompt": ids, "max_tokens": 1}
    resp = post(server, "/v1/completions", body)
    assert_error(resp, 400, str(TINY_MAX_MODEL_LEN), str(len(ids)))


def test_prompt_plus_max_tokens_beyond_context(server: LiveServer):
    body = {"model": TINY_MODEL_NAME, "prompt": [100] * 50, "max_tokens": TINY_MAX_MODEL_LEN}
    resp = post(server, "/v1/completions", body)
    error = assert_error(resp, 400, str(TINY_MAX_MODEL_LEN), "50", str(TINY_MAX_MODEL_LEN + 50))
    assert error["code"] == "context_length_exceeded"
    huge = post(server, "/v1/chat/completions", chat(max_tokens=10**12))
    assert_error(huge, 400, str(TINY_MAX_MODEL_LEN))


@pytest.mark.parametrize("prompt", ["", [], [[]], [-1], [10**9], [1, "a"], {"text": "x"}])
def test_bad_completion_prompts(server: LiveServer, prompt: Any):
    body = {"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": 1}
    assert_error(post(server, "/v1/completions", body), 400)


def test_completion_unsupported_combinations(server: LiveServer):
    base = {"model": TINY_MODEL_NAME, "prompt": "x", "max_tokens": 1}
    assert_error(post(server, "/v1/completions", {**base, "suffix": "y"}), 400, "suffix")
    assert_error(post(server, "/v1/completions", {**base, "best_of": 3}), 400, "best_of")


def test_stream_options_without_stream(server: LiveServer):
    body = chat(stream_options={"include_usage": True})
    assert_error(post(server, "/v1/chat/completions", body), 400, "stream_options")


def test_min_tokens_above_max_tokens(server: LiveServer):
    assert_error(post(server, "/v1/chat/completions", chat(min_tokens=5)), 400, "min_tokens")


def test_n_above_server_limit(server: LiveServer):
    assert_error(post(server, "/v1/chat/completions", chat(n=9)), 400, "8")


def test_logit_bias_and_stop_token_ids_outside_vocabulary(server: LiveServer):
    vocab = len(server.ctx.tokenizer)
    bias = post(server, "/v1/chat/completions", chat(logit_bias={str(vocab): 1}))
    assert_error(bias, 400, str(vocab))
    assert_error(post(server, "/v1/chat/completions", chat(logit_bias={"x": 1})), 400)
    stop = post(server, "/v1/chat/completions", chat(stop_token_ids=[-3]))
    assert_error(stop, 400, "-3")


def test_body_too_large_is_413(server: LiveServer):
    filler = "x" * (server.ctx.settings.max_request_body_bytes + 1)
    resp = post(
        server, "/v1/chat/completions", chat(messages=[{"role": "user", "content": filler}])
    )
    assert_error(resp, 413, str(server.ctx.settings.max_request_body_bytes))


def test_unknown_route_is_404_json(server: LiveServer):
    assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)


def test_errors_raise_typed_exceptions_in_the_openai_client(client: Any):
    import openai

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=TINY_MODEL_NAME, messages=[], max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER, max_tokens=1)


def test_null_fields_mean_default(server: LiveServer):
    body = chat(temperature=None, stop=None, seed=None, tools=None, max_tokens=None)
    body["max_tokens"] = 2
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    assert_error(post(server, "/v1/chat/completions", chat(messages=None)), 400, "messages")
