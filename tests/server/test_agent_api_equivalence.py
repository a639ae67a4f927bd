"""At temperature 0 the three front doors give the same answer for the same conversation:
chat completions, Responses and Anthropic Messages all become the same engine request
(issue 36). Served by the embedded SmolLM2 (float32), whose greedy answer moves with the
prompt (checked below), so a translation that rendered a different prompt (a lost system
turn, a different role, a dropped or reordered message) or sampled differently answers
differently; the prompt's token count is compared too."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer

MODEL = "smollm2"  # the smollm_tools_server fixture's name
SYSTEM = "You answer in few words."
TURNS = ("Name a river.", "The Danube.", "Which sea does it flow into?")
MAX_TOKENS = 12


def post(server: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def turns_as_messages(turns: tuple[str, ...]) -> list[dict[str, str]]:
    """User and assistant turns alternating, the user first."""
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": text}
        for i, text in enumerate(turns)
    ]


def chat_answer(server: LiveServer, turns: tuple[str, ...]) -> tuple[str, int, int]:
    messages = [{"role": "system", "content": SYSTEM}, *turns_as_messages(turns)]
    body = {"model": MODEL, "messages": messages, "temperature": 0}
    out = post(server, "/v1/chat/completions", {**body, "max_tokens": MAX_TOKENS})
    usage = out["usage"]
    return (
        out["choices"][0]["message"]["content"],
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


def responses_answer(server: LiveServer, turns: tuple[str, ...]) -> tuple[str, int, int]:
    items = turns_as_messages(turns)
    body = {
        "model": MODEL,
        "instructions": SYSTEM,
        "input": items,
        "temperature": 0,
        "max_output_tokens": MAX_TOKENS,
        "store": False,
    }
    out = post(server, "/v1/responses", body)
    text = "".join(
        part["text"]
        for item in out["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
    return text, out["usage"]["input_tokens"], out["usage"]["output_tokens"]


def messages_answer(server: LiveServer, turns: tuple[str, ...]) -> tuple[str, int, int]:
    messages = turns_as_messages(turns)
    body = {
        "model": MODEL,
        "system": SYSTEM,
        "messages": messages,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    out = post(server, "/v1/messages", body)
    text = "".join(block["text"] for block in out["content"] if block["type"] == "text")
    usage = out["usage"]
    # Anthropic counts the prompt's tokens read from the cache apart from input_tokens.
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    return text, prompt + usage["cache_creation_input_tokens"], usage["output_tokens"]


@pytest.mark.parametrize("turns", [TURNS[:1], TURNS], ids=["one-turn", "three-turns"])
def test_chat_responses_and_messages_answer_alike(
    smollm_tools_server: LiveServer, turns: tuple[str, ...]
):
    chat = chat_answer(smollm_tools_server, turns)
    assert chat[2] > 0
    assert responses_answer(smollm_tools_server, turns) == chat
    assert messages_answer(smollm_tools_server, turns) == chat


def test_the_check_tells_prompts_apart(smollm_tools_server: LiveServer) -> None:
    """The model's answer moves with the prompt, so equal answers above mean equal prompts."""
    river = chat_answer(smollm_tools_server, TURNS[:1])
    mountain = chat_answer(smollm_tools_server, ("Name a mountain.",))
    assert river[0] != mountain[0]
