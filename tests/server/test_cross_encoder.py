"""A cross-encoder served as it is: a tiny random LlamaForSequenceClassification (SmolLM2's
tokenizer) behind real uvicorn. /v1/rerank and /v1/score through httpx give
sigmoid(transformers' logit) of ``tokenizer(query, document)`` and order by it, without
--reranker; generation routes answer 400 in the API's error shape; a two-label head
cannot score (400); --reranker on a classifier is refused at startup; `kvserve plan`
counts the weights the server holds."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from server.app import serving_context
from server.plan import add_plan_parser, build_report
from server.settings import ServerSettings
from tests.conftest import tiny_llama_config
from tests.server.conftest import LiveServer, build_tiny, live_server

ATOL = 1e-5  # on sigmoids of fp32 logits that agree to ~1e-5
NAME = "tiny-cross-encoder"
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital of France.",
    "Bananas are yellow.",
    "France borders Spain, Italy and Germany.",
    "The Eiffel Tower is in Paris, on the Seine.",
]


def save_classifier(path: Path, tokenizer: Any, num_labels: int) -> Any:
    """A random fp32 classifier over SmolLM2's vocabulary (weights scaled so the
    logits spread), saved with the tokenizer; returns the reference model."""
    from transformers import LlamaForSequenceClassification

    config = tiny_llama_config(vocab_size=len(tokenizer))
    config.num_labels = num_labels
    config.pad_token_id = None  # transformers then reads the last position, as kvserve does
    torch.manual_seed(11)
    model = LlamaForSequenceClassification(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Any:
    path = tmp_path_factory.mktemp("cross-encoder")
    return path, save_classifier(path, smollm_tokenizer, num_labels=1)


@pytest.fixture(scope="module")
def classifier_built(classifier: Any) -> Any:
    return build_tiny(classifier[0])


@pytest.fixture(scope="module")
def xenc_server(classifier_built: Any) -> Iterator[LiveServer]:
    with live_server(classifier_built, ServerSettings(served_model_names=(NAME,))) as live:
        yield live


def expected_score(reference: Any, ids: list[int]) -> float:
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0]
    assert logits.shape == (1,)
    return 1.0 / (1.0 + math.exp(-float(logits[0])))


def pair_ids(tokenizer: Any, query: str, document: str) -> list[int]:
    return list(tokenizer(query, document)["input_ids"])


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_rerank_scores_are_sigmoids_of_the_heads_logit(xenc_server, classifier):
    reference = classifier[1]
    tokenizer = xenc_server.ctx.tokenizer
    prompts = [pair_ids(tokenizer, QUERY, d) for d in DOCUMENTS]
    expected = [expected_score(reference, ids) for ids in prompts]
    assert len({round(e, 3) for e in expected}) == len(expected)  # an order to check
    response = post(xenc_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    body = response.json()
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -expected[i])
    for result in results:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=ATOL)
        assert result["document"]["text"] == DOCUMENTS[result["index"]]
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in prompts)
    top = post(xenc_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert [r["index"] for r in top.json()["results"]] == [r["index"] for r in results[:2]]
    assert xenc_server.wait_idle().device_blocks.used == 0


def test_score_pairs_one_to_many_and_many_to_many(xenc_server, classifier):
    reference = classifier[1]
    tokenizer = xenc_server.ctx.tokenizer
    response = post(xenc_server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2, 3]
    for item, document in zip(data, DOCUMENTS, strict=True):
        expected = expected_score(reference, pair_ids(tokenizer, QUERY, document))
        assert item["score"] == pytest.approx(expected, abs=ATOL)
    queries = [QUERY, "Which fruit is yellow?"]
    pairwise = post(xenc_server, "/v1/score", {"text_1": queries, "text_2": DOCUMENTS[:2]})
    for item, query, document in zip(pairwise.json()["data"], queries, DOCUMENTS[:2], strict=True):
        expected = expected_score(reference, pair_ids(tokenizer, query, document))
        assert item["score"] == pytest.approx(expected, abs=ATOL)
    assert xenc_server.wait_idle().device_blocks.used == 0


def test_truncation_keeps_the_last_tokens_and_the_context_bounds_a_pair(xenc_server, classifier):
    reference = classifier[1]
    ids = pair_ids(xenc_server.ctx.tokenizer, QUERY, DOCUMENTS[3])
    body = {"text_1": QUERY, "text_2": DOCUMENTS[3], "truncate_prompt_tokens": 6}
    response = post(xenc_server, "/v1/score", body)
    assert response.status_code == 200, response.text
    score = response.json()["data"][0]["score"]
    assert score == pytest.approx(expected_score(reference, ids[-6:]), abs=ATOL)
    too_long = post(xenc_server, "/v1/rerank", {"query": QUERY, "documents": ["x " * 1100]})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"


def test_an_instruction_is_a_causal_rerankers_and_is_refused(xenc_server):
    body = {"query": QUERY, "documents": DOCUMENTS, "instruction": "Judge it"}
    response = post(xenc_server, "/v1/rerank", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "instruction"


GENERATION = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
}


@pytest.mark.parametrize("path", list(GENERATION))
def test_generation_on_a_classifier_is_a_400_naming_the_scoring_routes(xenc_server, path):
    body = {"model": NAME, **GENERATION[path]}
    response = post(xenc_server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "sequence classifier" in error["message"] and "/v1/rerank" in error["message"]
    if path != "/v1/messages":  # Anthropic's route answers in Anthropic's shape
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "model_not_supported" and error["param"] == "model"
    assert xenc_server.wait_idle().num_running == 0


def test_embeddings_pool_the_final_hidden_state(xenc_server):
    """Documented: /v1/embeddings still pools the decoder's last hidden row."""
    response = post(xenc_server, "/v1/embeddings", {"input": QUERY})
    assert response.status_code == 200, response.text
    vector = response.json()["data"][0]["embedding"]
    assert len(vector) == 64 and math.fsum(v * v for v in vector) == pytest.approx(1.0)


def test_a_two_label_head_cannot_score(tmp_path, smollm_tokenizer):
    save_classifier(tmp_path, smollm_tokenizer, num_labels=2)
    built = build_tiny(tmp_path, num_kv_blocks=64)
    with live_server(built, ServerSettings(served_model_names=(NAME,))) as live:
        for path, body in (
            ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
            ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}),
        ):
            response = post(live, path, body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "model_not_supported" and "2 logits" in error["message"]


def test_a_reranker_format_on_a_classifier_is_refused_at_startup(classifier, classifier_built):
    with pytest.raises(ValueError, match="leave --reranker out"):
        serving_context(classifier_built, ServerSettings(reranker="qwen3"), with_metrics=False)
    command = [sys.executable, "-m", "server.cli", "serve", "--model", str(classifier[0])]
    flags = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256"]
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [*command, *flags, "--reranker", "qwen3", "--port", "0"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "leave --reranker out" in done.stderr


def test_plan_counts_the_weights_the_server_holds(classifier, classifier_built):
    parser = argparse.ArgumentParser(prog="kvserve")
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["plan", "--model", str(classifier[0]), "--device", "cpu", "--dtype", "float32"]
    )
    assert build_report(args).weight_bytes == classifier_built.weight_bytes
