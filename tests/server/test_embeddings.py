"""/v1/embeddings against real uvicorn and the official ``openai`` client: vectors equal
transformers' final hidden states pooled the same way (fp32), beside chat streams too;
every input form and encoding; each bad input a 4xx in OpenAI's shape; no KV block left
in use afterwards; the pooling metrics."""

from __future__ import annotations

import base64
import json
import re
import shutil
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from server.settings import ServerSettings
from tests.server.conftest import TINY_MODEL_NAME, LiveServer, build_tiny, live_server

# fp32 on both sides; kvserve's paged attention sums in another order than transformers.
ATOL = 1e-4
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "hi"]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def pooled(reference: Any, ids: list[int], kind: str, normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        out = reference(torch.tensor([ids]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0].float()  # after the final norm
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[kind]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=True))


def post(server: LiveServer, body: dict[str, Any], path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def assert_close(got: list[float], expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), expected, atol=ATOL, rtol=0)


def test_sdk_string_list_and_token_ids_match_transformers(client, server, reference):
    tokenizer = server.ctx.tokenizer
    one = client.embeddings.create(model=TINY_MODEL_NAME, input=TEXTS[0])  # SDK: base64
    assert len(one.data) == 1 and one.data[0].index == 0
    assert_close(one.data[0].embedding, pooled(reference, ids_of(tokenizer, TEXTS[0]), "last"))
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids_of(tokenizer, TEXTS[0]))

    many = client.embeddings.create(model=TINY_MODEL_NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    for text, item in zip(TEXTS, many.data, strict=True):
        assert_close(item.embedding, pooled(reference, ids_of(tokenizer, text), "last"))
    assert many.usage.prompt_tokens == sum(len(ids_of(tokenizer, t)) for t in TEXTS)

    ids = [ids_of(tokenizer, t) for t in TEXTS]
    by_ids = client.embeddings.create(model=TINY_MODEL_NAME, input=ids[0])
    assert_close(by_ids.data[0].embedding, pooled(reference, ids[0], "last"))
    by_lists = client.embeddings.create(model="alias", input=ids)
    assert by_lists.model == TINY_MODEL_NAME
    for seq, item in zip(ids, by_lists.data, strict=True):
        assert_close(item.embedding, pooled(reference, seq, "last"))
    assert server.wait_idle().device_blocks.used == 0


def test_float_and_base64_agree_and_base64_is_little_endian_float32(server):
    floats = post(server, {"input": TEXTS[1], "encoding_format": "float"}).json()
    encoded = post(server, {"input": TEXTS[1], "encoding_format": "base64"}).json()
    raw = base64.b64decode(encoded["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    vector = floats["data"][0]["embedding"]
    assert len(vector) == 64  # the tiny model's hidden size
    assert decoded == pytest.approx(vector, abs=1e-6)
    assert sum(v * v for v in vector) == pytest.approx(1.0, abs=1e-5)
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"


def test_normalize_false_and_truncate_prompt_tokens(server, reference):
    ids = ids_of(server.ctx.tokenizer, TEXTS[0])
    raw = post(server, {"input": ids, "normalize": False}).json()
    assert_close(raw["data"][0]["embedding"], pooled(reference, ids, "last", normalize=False))
    cut = post(server, {"input": ids, "truncate_prompt_tokens": 4}).json()
    assert cut["usage"]["prompt_tokens"] == 4
    assert_close(cut["data"][0]["embedding"], pooled(reference, ids[-4:], "last"))
    long_ids = [7] * (server.ctx.max_model_len + 10)
    whole = post(server, {"input": long_ids, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == server.ctx.max_model_len


BAD_INPUTS = {
    "empty string": ({"input": ""}, 400, "input"),
    "empty list": ({"input": []}, 400, "input"),
    "empty string in a list": ({"input": ["a", ""]}, 400, "input"),
    "empty token list": ({"input": [[1, 2], []]}, 400, "input"),
    "token outside the vocabulary": ({"input": [10**9]}, 400, "input"),
    "too long": ({"input": [7] * 1100}, 400, "input"),
    "truncation past the context": (
        {"input": "x", "truncate_prompt_tokens": 5000},
        400,
        "truncate_prompt_tokens",
    ),
    "dimensions on a plain model": ({"input": "x", "dimensions": 8}, 400, "dimensions"),
    "bad encoding_format": ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    "wrong model": ({"input": "x", "model": "nope"}, 404, "model"),
    "mixed list": ({"input": ["a", 1]}, 400, "input"),
    "input missing": ({}, 400, "input"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_a_4xx_in_openai_shape(server, case):
    body, status, param = BAD_INPUTS[case]
    response = post(server, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert param in (error["param"] or "")
    assert server.wait_idle().device_blocks.used == 0


def test_sdk_raises_on_bad_input(client):
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=TINY_MODEL_NAME, input="")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")


def test_embeddings_beside_chat_streams(client, server, reference):
    """Chat streams and embedding requests at once (they share engine steps): every
    vector still equals the reference, the chats finish, and no block stays in use."""
    tokenizer = server.ctx.tokenizer
    texts = [f"{t} number {i}" for i in range(4) for t in TEXTS]

    def stream_chat(i: int) -> int:
        stream = client.chat.completions.create(
            model=TINY_MODEL_NAME,
            messages=[{"role": "user", "content": f"Tell me a story {i}"}],
            max_tokens=48,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content)

    def embed(text: str) -> list[float]:
        return client.embeddings.create(model=TINY_MODEL_NAME, input=text).data[0].embedding

    with ThreadPoolExecutor(8) as pool:
        chats = [pool.submit(stream_chat, i) for i in range(3)]
        vectors = list(pool.map(embed, texts))
        assert all(f.result() > 0 for f in chats)
    for text, vector in zip(texts, vectors, strict=True):
        assert_close(vector, pooled(reference, ids_of(tokenizer, text), "last"))
    assert server.wait_idle().device_blocks.used == 0
    scrape = httpx.get(server.url + "/metrics", timeout=30).text
    used = re.search(r'kvserve_kv_cache_blocks\{[^}]*pool="device",state="used"\} (\S+)', scrape)
    assert used is not None and float(used.group(1)) == 0
    requests = re.search(
        r'kvserve_pooling_requests_total\{endpoint="embeddings"[^}]*\} (\S+)', scrape
    )
    assert requests is not None and float(requests.group(1)) >= len(texts)


@pytest.fixture(scope="module")
def sentence_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model dressed as a sentence-transformers Matryoshka model: mean pooling,
    Normalize, trained for 16 and 32 dimensions."""
    path = tmp_path_factory.mktemp("tiny-embedder") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32]
    (path / "config.json").write_text(json.dumps(config))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )
    return path


@pytest.fixture(scope="module")
def sentence_server(sentence_model_dir: Path) -> Iterator[LiveServer]:
    built = build_tiny(sentence_model_dir, kernels="torch")
    with live_server(built, ServerSettings(served_model_names=(TINY_MODEL_NAME,))) as live:
        yield live


def test_model_pooling_and_matryoshka_dimensions(sentence_server, reference):
    ids = ids_of(sentence_server.ctx.tokenizer, TEXTS[0])
    full = post(sentence_server, {"input": ids}).json()["data"][0]["embedding"]
    assert_close(full, pooled(reference, ids, "mean"))  # the model's own pooling: mean
    short = post(sentence_server, {"input": ids, "dimensions": 16}).json()["data"][0]["embedding"]
    expected = pooled(reference, ids, "mean", normalize=False)[:16]
    assert_close(short, torch.nn.functional.normalize(expected, dim=0))  # cut, then normalised
    bad = post(sentence_server, {"input": ids, "dimensions": 20})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
    assert sentence_server.wait_idle().device_blocks.used == 0


@pytest.mark.parametrize("kind", ["mean", "cls"])
def test_pooling_flag_overrides(tiny_built, reference, kind):
    settings = ServerSettings(served_model_names=(TINY_MODEL_NAME,), pooling=kind)
    with live_server(tiny_built, settings) as live:
        tokenizer = live.ctx.tokenizer
        body = post(live, {"input": TEXTS, "encoding_format": "float"}).json()
        for text, item in zip(TEXTS, body["data"], strict=True):
            assert_close(item["embedding"], pooled(reference, ids_of(tokenizer, text), kind))
        assert live.wait_idle().device_blocks.used == 0


def test_langchain_openai_embeddings(server, reference):
    """LangChain's OpenAIEmbeddings. Its default ``check_embedding_ctx_length`` tokenizes
    with tiktoken (OpenAI's vocabulary, and a download) and sends those ids; against any
    other model the texts must go as text."""
    langchain_openai = pytest.importorskip("langchain_openai")
    embedder = langchain_openai.OpenAIEmbeddings(
        base_url=server.v1,
        api_key="x",
        model=TINY_MODEL_NAME,
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    tokenizer = server.ctx.tokenizer
    documents = embedder.embed_documents(TEXTS)
    for text, vector in zip(TEXTS, documents, strict=True):
        assert_close(vector, pooled(reference, ids_of(tokenizer, text), "last"))
    query = embedder.embed_query(TEXTS[0])
    assert_close(query, pooled(reference, ids_of(tokenizer, TEXTS[0]), "last"))
