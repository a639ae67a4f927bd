"""/v1/chat/completions/render and /v1/completions/render: the exact ids the engine runs,
vLLM's GenerateRequest shape, no generation, the generation routes' own 4xx."""

from __future__ import annotations

from typing import Any

import httpx

from tests.server.conftest import TINY_MAX_MODEL_LEN, TINY_MODEL_NAME, LiveServer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name three rivers of Europe."},
]
GENERATE_REQUEST_KEYS = {
    "request_id",
    "token_ids",
    "features",
    "sampling_params",
    "model",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "prompt",
}


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def finished_requests(server: LiveServer) -> float:
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("kvserve_requests_finished_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_chat_render_ids_are_the_ids_the_engine_runs(server: LiveServer) -> None:
    body = {"model": TINY_MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    rendered = post(server, "/v1/chat/completions/render", body)
    assert rendered.status_code == 200, rendered.text
    payload = rendered.json()
    assert set(payload) == GENERATE_REQUEST_KEYS
    ids = payload["token_ids"]
    # The engine's own view of the same request: its prompt, scored token by token.
    run = post(server, "/v1/chat/completions", {**body, "prompt_logprobs": 0}).json()
    assert run["usage"]["prompt_tokens"] == len(ids)
    scored = [int(next(iter(entry))) for entry in run["prompt_logprobs"][1:]]
    assert scored == ids[1:]
    tokenized = post(server, "/tokenize", {"model": TINY_MODEL_NAME, "messages": MESSAGES})
    assert tokenized.json()["tokens"] == ids
    assert server.ctx.tokenizer.encode(payload["prompt"], add_special_tokens=False) == ids


def test_render_resolves_sampling_params_and_generates_nothing(server: LiveServer) -> None:
    before = finished_requests(server)
    body = {
        "model": TINY_MODEL_NAME,
        "messages": MESSAGES,
        "temperature": 0.5,
        "top_k": 7,
        "stop": ["\n\n"],
        "seed": 3,
        "cache_salt": "tenant-a",
        "response_format": {"type": "json_object"},
    }
    payload = post(server, "/v1/chat/completions/render", body).json()
    params = payload["sampling_params"]
    # max_tokens omitted: what the context leaves after the prompt, as generation resolves it.
    assert params["max_tokens"] == TINY_MAX_MODEL_LEN - len(payload["token_ids"])
    assert (params["temperature"], params["top_k"], params["seed"]) == (0.5, 7, 3)
    assert params["stop"] == ["\n\n"]
    assert params["structured_outputs"] == {"json_object": True}
    assert payload["cache_salt"] == "tenant-a"
    assert payload["model"] == TINY_MODEL_NAME
    assert payload["features"] is None
    assert finished_requests(server) == before
    assert server.ctx.engine.stats().num_running == 0


def test_completions_render_answers_one_request_per_prompt(server: LiveServer) -> None:
    body = {"model": TINY_MODEL_NAME, "prompt": ["A quiet lake", "Rain"], "max_tokens": 4}
    payload = post(server, "/v1/completions/render", body).json()
    assert isinstance(payload, list) and len(payload) == 2
    assert all(set(item) == GENERATE_REQUEST_KEYS for item in payload)
    tokenized = post(server, "/tokenize", {"model": TINY_MODEL_NAME, "prompt": "A quiet lake"})
    assert payload[0]["token_ids"] == tokenized.json()["tokens"]
    assert [item["sampling_params"]["max_tokens"] for item in payload] == [4, 4]
    ids = [[5, 17, 99, 230], [8, 9]]
    by_ids = post(server, "/v1/completions/render", {"model": TINY_MODEL_NAME, "prompt": ids})
    assert [item["token_ids"] for item in by_ids.json()] == ids
    echoed = post(
        server,
        "/v1/completions",
        {"model": TINY_MODEL_NAME, "prompt": "A quiet lake", "max_tokens": 1, "echo": True},
    ).json()
    assert echoed["usage"]["prompt_tokens"] == len(payload[0]["token_ids"])


def test_render_refuses_what_generation_refuses(server: LiveServer) -> None:
    chat = {"model": TINY_MODEL_NAME, "messages": MESSAGES}
    unknown_model = post(server, "/v1/chat/completions/render", {**chat, "model": "gpt-17"})
    assert unknown_model.status_code == 404
    too_long = {"model": TINY_MODEL_NAME, "prompt": [7] * (TINY_MAX_MODEL_LEN + 1)}
    resp = post(server, "/v1/completions/render", too_long)
    assert resp.status_code == 400 and str(TINY_MAX_MODEL_LEN) in resp.json()["error"]["message"]
    bad_id = post(server, "/v1/completions/render", {"model": TINY_MODEL_NAME, "prompt": [10**9]})
    assert bad_id.status_code == 400
    empty = post(server, "/v1/chat/completions/render", {**chat, "messages": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
