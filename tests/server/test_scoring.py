"""/v1/score and /v1/rerank through httpx against real uvicorn: with --reranker qwen3 the
scores are P("yes") over the ("yes", "no") logits transformers computes at the last
position of Qwen3-Reranker's prompt (on the tiny random Llama with SmolLM2's
tokenizer); rerank orders them; bad input and a server without a reranker are 4xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from server.scoring import QWEN3
from server.settings import ServerSettings
from tests.server.conftest import TINY_MODEL_NAME, LiveServer, live_server

ATOL = 1e-4
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital of France.",
    "Bananas are yellow.",
    "France borders Spain, Italy and Germany.",
]


@pytest.fixture(scope="module")
def reranker_server(tiny_built: Any) -> Iterator[LiveServer]:
    settings = ServerSettings(served_model_names=(TINY_MODEL_NAME,), reranker="qwen3")
    with live_server(tiny_built, settings) as live:
        yield live


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def expected_score(reference: Any, tokenizer: Any, query: str, document: str) -> float:
    """Qwen3-Reranker's model card: prefix, body and suffix tokenized apart, then
    softmax([no, yes]) at the last position."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    body = QWEN3.body.format(instruction=QWEN3.instruction, query=query, document=document)
    ids = encode(QWEN3.prefix) + encode(body) + encode(QWEN3.suffix)
    yes, no = tokenizer.convert_tokens_to_ids(["yes", "no"])
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0, -1].float()
    return float(torch.softmax(logits[[no, yes]], dim=0)[1])


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_rerank_orders_by_the_yes_probability(reranker_server, reference):
    tokenizer = reranker_server.ctx.tokenizer
    expected = [expected_score(reference, tokenizer, QUERY, d) for d in DOCUMENTS]
    response = post(reranker_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    body = response.json()
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -expected[i])
    for result in results:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=ATOL)
        assert result["document"]["text"] == DOCUMENTS[result["index"]]
    assert body["usage"]["total_tokens"] > 0
    top = post(reranker_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 1})
    assert [r["index"] for r in top.json()["results"]] == [results[0]["index"]]
    assert reranker_server.wait_idle().device_blocks.used == 0


def test_score_one_to_many_and_many_to_many(reranker_server, reference):
    tokenizer = reranker_server.ctx.tokenizer
    response = post(reranker_server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2] and data[0]["object"] == "score"
    for item, document in zip(data, DOCUMENTS, strict=True):
        expected = expected_score(reference, tokenizer, QUERY, document)
        assert item["score"] == pytest.approx(expected, abs=ATOL)
    queries = [QUERY, "Which fruit is yellow?"]
    pairwise = post(reranker_server, "/v1/score", {"text_1": queries, "text_2": DOCUMENTS[:2]})
    for item, query, document in zip(pairwise.json()["data"], queries, DOCUMENTS[:2], strict=True):
        expected = expected_score(reference, tokenizer, query, document)
        assert item["score"] == pytest.approx(expected, abs=ATOL)
    assert reranker_server.wait_idle().device_blocks.used == 0


BAD = {
    "no documents": ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    "negative top_n": ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
    "mismatched lists": ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    "empty text_2": ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    "too long": ("/v1/rerank", {"query": QUERY, "documents": ["x " * 1100]}, "documents"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_scoring_input_is_400(reranker_server, case):
    path, body, param = BAD[case]
    response = post(reranker_server, path, body)
    assert response.status_code == 400, response.text
    assert param in (response.json()["error"]["param"] or "")


def test_without_a_reranker_both_routes_say_how_to_get_one(server):
    for path, body in (
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
    ):
        response = post(server, path, body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert "--reranker" in error["message"] and error["code"] == "model_not_supported"
