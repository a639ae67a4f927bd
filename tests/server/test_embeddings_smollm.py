"""/v1/embeddings on the real SmolLM2-135M GGUF (float32, torch kernels): last-token and
mean-pooled vectors equal transformers' final hidden states pooled the same way, while
chat streams run beside them; no KV block is left in use."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from engine.config import EngineArgs
from server.settings import ServerSettings
from tests.server.conftest import LiveServer, live_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# Normalised vectors, fp32 on both sides through 30 layers; kvserve's attention and
# matmuls sum in another order than transformers'.
ATOL = 2e-4
TEXTS = [
    "What is the capital of France?",
    "Paris is the capital and largest city of France.",
    "The mitochondria is the powerhouse of the cell.",
    "def add(a, b):\n    return a + b",
]


@pytest.fixture(scope="module")
def built_smollm(smollm_gguf: Path) -> Any:
    from engine.builder import build_engine

    return build_engine(
        EngineArgs(
            model=str(smollm_gguf),
            device="cpu",
            dtype="float32",
            max_model_len=1024,
            num_kv_blocks=256,
            block_size=16,
            swap_space_gib=0.01,
            max_num_seqs=16,
            max_num_batched_tokens=64,  # long inputs are chunked beside the chats' decodes
            kernels="torch",
        )
    )


@pytest.fixture(scope="module")
def reference(smollm_gguf: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm_gguf.parent, gguf_file=smollm_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module", params=["last", "mean"])
def smollm_server(request: pytest.FixtureRequest, built_smollm: Any) -> Iterator[LiveServer]:
    settings = ServerSettings(served_model_names=("smollm2",), pooling=request.param)
    with live_server(built_smollm, settings) as live:
        yield live


def test_vectors_match_transformers_beside_chat(smollm_server, reference):
    kind = smollm_server.ctx.settings.pooling
    client = openai.OpenAI(base_url=smollm_server.v1, api_key="x", max_retries=0, timeout=600)
    tokenizer = smollm_server.ctx.tokenizer
    long_text = " ".join(TEXTS * 8)  # > 64 tokens: several chunks

    def chat(i: int) -> str:
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"Count to {i + 5}."}],
            max_tokens=32,
            temperature=0,
            stream=True,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(4) as pool:
        chats = [pool.submit(chat, i) for i in range(2)]
        response = client.embeddings.create(model="smollm2", input=[*TEXTS, long_text])
        assert all(f.result() for f in chats)
    for text, item in zip([*TEXTS, long_text], response.data, strict=True):
        ids = tokenizer.encode(text, add_special_tokens=True)
        with torch.no_grad():
            hidden = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        vector = hidden[0, -1] if kind == "last" else hidden[0].mean(dim=0)
        expected = torch.nn.functional.normalize(vector.float(), dim=0)
        torch.testing.assert_close(torch.tensor(item.embedding), expected, atol=ATOL, rtol=0)
    assert smollm_server.wait_idle().device_blocks.used == 0
