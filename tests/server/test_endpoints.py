"""Models, tokenize/detokenize, health, version and metrics endpoints."""

from __future__ import annotations

from typing import Any

import httpx

from tests.server.conftest import TINY_MAX_MODEL_LEN, TINY_MODEL_NAME, LiveServer


def test_models_list_and_retrieve(client: Any):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [TINY_MODEL_NAME, "alias"]
    model = client.models.retrieve("alias")
    assert model.id == "alias" and model.object == "model" and model.owned_by == "kvserve"


def test_models_report_max_model_len(server: LiveServer):
    data = httpx.get(f"{server.url}/v1/models").json()
    assert data["object"] == "list"
    assert data["data"][0]["max_model_len"] == TINY_MAX_MODEL_LEN


def test_tokenize_prompt_and_detokenize_round_trip(server: LiveServer):
    text = "Tokenize me, please: 東京 🎉"
    resp = httpx.post(f"{server.url}/tokenize", json={"model": TINY_MODEL_NAME, "prompt": text})
    body = resp.json()
    assert resp.status_code == 200
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == TINY_MAX_MODEL_LEN
    back = httpx.post(
        f"{server.url}/detokenize", json={"model": TINY_MODEL_NAME, "tokens": body["tokens"]}
    )
    assert back.json() == {"prompt": text}


def test_tokenize_messages_applies_the_chat_template(server: LiveServer):
    messages = [{"role": "user", "content": "hello"}]
    body = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]}).json()
    assert "hello" in text["prompt"] and len(text["prompt"]) > len("hello")


def test_tokenize_errors(server: LiveServer):
    both = {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(f"{server.url}/tokenize", json=both).status_code == 400
    assert httpx.post(f"{server.url}/tokenize", json={}).status_code == 400
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [-5]})
    assert bad.status_code == 400 and "-5" in bad.json()["error"]["message"]
    wrong_model = httpx.post(f"{server.url}/tokenize", json={"model": "x", "prompt": "y"})
    assert wrong_model.status_code == 404
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    tools_on_a_prompt = httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "tools": [tool]})
    assert tools_on_a_prompt.status_code == 400
    assert "'tools' go with 'messages'" in tools_on_a_prompt.json()["error"]["message"]


def test_tokenize_messages_with_tools_counts_the_tool_prompt(server: LiveServer):
    """The functions a chat request offers are in the prompt /tokenize counts (SmolLM2's
    template has no tools: kvserve's generic tool system prompt)."""
    messages = [{"role": "user", "content": "hello"}]
    tool = {"type": "function", "function": {"name": "lookup_city", "parameters": {}}}
    plain = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    body = {"messages": messages, "tools": [tool]}
    with_tools = httpx.post(f"{server.url}/tokenize", json=body).json()
    assert with_tools["count"] > plain["count"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": with_tools["tokens"]}).json()
    assert "lookup_city" in text["prompt"] and "<tools>" in text["prompt"]


def test_health_and_version(server: LiveServer):
    assert httpx.get(f"{server.url}/health").status_code == 200
    version = httpx.get(f"{server.url}/version").json()["version"]
    assert version and version != "unknown"


def metric_value(server: LiveServer, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_metrics_endpoint_counts_what_the_server_did(server: LiveServer, client: Any):
    finished = "kvserve_requests_finished_total"
    rejected = "kvserve_requests_rejected_total"
    length_before = metric_value(server, finished, finish_reason="length")
    e2e_before = metric_value(server, "kvserve_e2e_request_latency_seconds_count")
    invalid_before = metric_value(server, rejected, reason="invalid")
    client.completions.create(
        model=TINY_MODEL_NAME, prompt="metrics", max_tokens=2, n=2, extra_body={"ignore_eos": True}
    )
    httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": -1})
    resp = httpx.get(f"{server.url}/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    # One record per choice; the bad request is counted as a rejection.
    assert metric_value(server, finished, finish_reason="length") == length_before + 2
    assert metric_value(server, "kvserve_e2e_request_latency_seconds_count") == e2e_before + 2
    assert metric_value(server, rejected, reason="invalid") == invalid_before + 1
