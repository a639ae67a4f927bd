"""Reasoning through a live server: ``--reasoning-parser`` splits the scripted model's
``<think>`` block into chat's ``reasoning`` (whole and streamed), earlier reasoning and
``reasoning_effort`` reach the chat template, and with a template that opens the block in
the prompt (DeepSeek-R1's way) an output constraint applies only after the reasoning."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.agents import ANSWER, MODEL, REASONING, agent_settings
from tests.server.conftest import LiveServer, live_server

ASK = [{"role": "user", "content": "Hi"}]
# A template that shows what reaches it: each message's reasoning, the effort asked for,
# and a generation prompt that opens a think block (as DeepSeek-R1's templates do).
SHOWING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}[reasoning: {{ m.reasoning_content }}]{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if reasoning_effort %}[effort: {{ reasoning_effort }}]{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
)


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)


def test_chat_splits_reasoning_from_content(agent_server: LiveServer) -> None:
    chat = client(agent_server).chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0,  # type: ignore[arg-type]
    )
    message = chat.choices[0].message
    assert message.content == ANSWER
    assert (message.model_extra or {})["reasoning"] == REASONING
    assert chat.choices[0].finish_reason == "stop"


def test_streamed_reasoning_comes_first_in_its_own_field(agent_server: LiveServer) -> None:
    stream = client(agent_server).chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    reasoning, content, order = "", "", []
    for chunk in stream:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning"):
                reasoning += extra["reasoning"]
                order.append("reasoning")
            if choice.delta.content:
                content += choice.delta.content
                order.append("content")
    assert reasoning == REASONING and content == ANSWER
    assert order.index("content") > max(i for i, kind in enumerate(order) if kind == "reasoning")


@pytest.fixture(scope="module")
def r1_server(scripted_built: Any) -> Iterator[LiveServer]:
    settings = agent_settings(reasoning_parser="deepseek_r1", chat_template=SHOWING_TEMPLATE)
    with live_server(scripted_built, settings) as live:
        yield live


def rendered(server: LiveServer, body: dict[str, Any]) -> str:
    tokens = httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]
    return str(httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"])


def test_earlier_reasoning_is_rendered_through_the_template(r1_server: LiveServer) -> None:
    history = [
        *ASK,
        {"role": "assistant", "content": ANSWER, "reasoning": "I greeted back."},
        {"role": "user", "content": "Again"},
    ]
    assert "[reasoning: I greeted back.]" in rendered(r1_server, {"messages": history})
    older = [*ASK, {"role": "assistant", "content": ANSWER, "reasoning_content": "Old name."}]
    assert "[reasoning: Old name.]" in rendered(r1_server, {"messages": older})
    reply = client(r1_server).chat.completions.create(
        model=MODEL,
        messages=history,
        max_tokens=16,  # type: ignore[arg-type]
    )
    assert reply.choices[0].message.content == ANSWER


def test_reasoning_effort_reaches_the_template(r1_server: LiveServer) -> None:
    def prompt_tokens(**extra: Any) -> int:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 1, **extra}
        chat = httpx.post(f"{r1_server.v1}/chat/completions", json=body)
        assert chat.status_code == 200, chat.text
        return int(chat.json()["usage"]["prompt_tokens"])

    effort = "[effort: low]"  # what the template adds: this many more prompt tokens
    added = len(httpx.post(f"{r1_server.url}/tokenize", json={"prompt": effort}).json()["tokens"])
    assert prompt_tokens(reasoning_effort="low") == prompt_tokens() + added
    bad = httpx.post(
        f"{r1_server.v1}/chat/completions",
        json={"model": MODEL, "messages": ASK, "reasoning_effort": "extreme"},
    )
    assert bad.status_code == 400 and "reasoning_effort" in bad.json()["error"]["message"]


def assert_reasoning_then_json(server: LiveServer) -> None:
    """A JSON-object request: the scripted reasoning comes back whole, the answer is JSON
    (the scripted model would say "Hello" unconstrained)."""
    chat = client(server).chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    message = chat.choices[0].message
    assert (message.model_extra or {})["reasoning"] == REASONING
    assert isinstance(json.loads(message.content or ""), dict)


def test_a_constraint_applies_after_the_reasoning(r1_server: LiveServer) -> None:
    """The template opened the block: the model reasons freely, and the JSON constraint
    governs only what follows ``</think>`` (the scripted model would say "Hello")."""
    assert_reasoning_then_json(r1_server)


def test_a_model_that_chooses_to_think_may_open_a_block_before_the_constraint(
    agent_server: LiveServer,
) -> None:
    """Qwen3's way: the template leaves thinking to the model. Its first token may open a
    think block (the scripted model does), which defers the JSON constraint to the
    block's end; the reasoning comes back whole and the answer follows the constraint."""
    assert_reasoning_then_json(agent_server)


def test_a_forced_call_waits_for_the_reasoning(agent_server: LiveServer) -> None:
    from tests.server.test_tool_calling import TOOLS

    chat = client(agent_server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "The weather in Paris?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        temperature=0,
    )
    message = chat.choices[0].message
    assert (message.model_extra or {})["reasoning"] == REASONING
    (call,) = message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert isinstance(json.loads(call.function.arguments), dict)  # type: ignore[union-attr]


# Qwen3's template with ``enable_thinking: false``: an empty block closed in the prompt.
THINKING_OFF_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n<think></think>"
)


@pytest.fixture(scope="module")
def thinking_off_server(scripted_built: Any) -> Iterator[LiveServer]:
    with live_server(scripted_built, agent_settings(chat_template=THINKING_OFF_TEMPLATE)) as live:
        yield live


def test_thinking_off_puts_the_constraint_on_the_first_token(
    thinking_off_server: LiveServer,
) -> None:
    """With the block closed in the prompt nothing may open one: the constraint governs
    from the first token, and there is no reasoning."""
    resp = httpx.post(
        f"{thinking_off_server.v1}/chat/completions",
        json={
            "model": MODEL,
            "messages": ASK,
            "response_format": {"type": "json_object"},
            "max_tokens": 40,
            "temperature": 0,
        },
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    assert not message.get("reasoning")
    assert isinstance(json.loads(message["content"]), dict)
