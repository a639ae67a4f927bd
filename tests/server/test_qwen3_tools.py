"""Qwen3's tool calling through a live server and the official ``openai`` client: a tiny
random Qwen3 with SmolLM2's tokenizer and a chat template in Qwen3's tool format
(tests/server/templates/qwen3_style.jinja; no Qwen3 tokenizer is at hand offline), served
with ``--tool-call-parser hermes``. Forced calls come back as valid calls; a whole round
trip (the call in the assistant turn, the result as ``role: tool``) renders through the
model's own template exactly as Qwen3 expects it; Qwen3-shaped output (a think block, then
calls) parses into content and calls."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.builder import build_engine
from engine.config import EngineArgs
from server.settings import ServerSettings
from server.tools.events import assemble
from server.tools.parsers import make_parser
from tests.model.family_models import FAMILIES
from tests.model.test_family_serving import saved_model
from tests.server.conftest import LiveServer, live_server
from tests.server.test_tool_calling import ASK, TOOLS, assert_valid_calls

TEMPLATE = Path(__file__).parent / "templates" / "qwen3_style.jinja"


@pytest.fixture(scope="module")
def qwen3_server(
    tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any
) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = copy.deepcopy(smollm_tokenizer)  # the session's own stays as it is
    tokenizer.chat_template = TEMPLATE.read_text()
    saved_model(FAMILIES["qwen3"][0], tokenizer, path)
    args = EngineArgs(
        model=str(path),
        device="cpu",
        dtype="float32",
        max_model_len=512,  # the tiny model's context
        kv_cache_memory_gib=16 / 1024,
        swap_space_gib=0,
        kernels="torch",
    )
    settings = ServerSettings(
        served_model_names=("qwen3",), enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    with live_server(build_engine(args), settings) as live:
        yield live


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "add"}}]
)
def test_forced_calls_come_back_as_valid_calls(qwen3_server: LiveServer, tool_choice: Any) -> None:
    resp = sdk(qwen3_server).chat.completions.create(
        model="qwen3",
        messages=ASK,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=tool_choice,
        parallel_tool_calls=False,  # a random model would fill the whole array
        max_tokens=180,  # a string may run to its maxLength
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    names = {"add"} if isinstance(tool_choice, dict) else {"get_weather", "add"}
    assert_valid_calls(choice.message.tool_calls, names)


def test_a_round_trip_renders_in_qwen3s_format(qwen3_server: LiveServer) -> None:
    """The history a client sends back (its call, then the result) reaches the model as
    Qwen3 was trained on it: tools in the system turn, the call as a <tool_call> block, the
    result in a <tool_response> block of a user turn; and the server answers it."""
    arguments = {"city": "Paris", "unit": "celsius"}
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    tokens = httpx.post(
        f"{qwen3_server.url}/tokenize", json={"messages": messages, "tools": TOOLS}
    ).json()["tokens"]
    text = httpx.post(f"{qwen3_server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    assert f"<|im_start|>assistant\n\n{call}\n</tool_call><|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees and sunny\n</tool_response>" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    resp = sdk(qwen3_server).chat.completions.create(
        model="qwen3",
        messages=messages,
        tools=TOOLS,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert resp.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert resp.usage is not None and resp.usage.prompt_tokens == len(tokens)


def test_qwen3_shaped_output_parses_into_content_and_calls() -> None:
    """What a Qwen3 writes when it calls two functions after thinking."""
    text = (
        "<think>\nThe user wants the weather, and a sum.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
        "</tool_call>"
    )
    parser = make_parser("hermes", ("get_weather", "add"), None)
    message = assemble(parser.feed(text) + parser.finish()).as_openai()
    assert message["content"].startswith("<think>")  # reasoning is its own parser's job
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]
    assert calls == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("add", {"a": 2, "b": 3}),
    ]
