"""Anthropic's Messages API through the official ``anthropic`` SDK against a live server:
the scripted model's thinking and text blocks, whole and streamed (with the SDK's text
helper); forced tool use and a ``tool_result`` round trip; ``count_tokens``; stop
sequences; ``output_config.format``; Anthropic's error envelope and ``x-api-key``. The
same conversation through chat completions gives the same tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server.agents import ANSWER, MODEL, REASONING, agent_settings
from tests.server.conftest import LiveServer, live_server

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0}  # the current SDK sends sampling fields as extra_body


def sdk(server: LiveServer, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120)


def test_thinking_and_text_blocks(agent_server: LiveServer) -> None:
    message = sdk(agent_server).messages.create(
        model=MODEL, max_tokens=64, messages=ASK, extra_body=GREEDY
    )
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == REASONING  # type: ignore[union-attr]
    assert message.content[1].text == ANSWER  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.usage.output_tokens == 6


def test_the_same_tokens_as_chat_completions(agent_server: LiveServer) -> None:
    message = sdk(agent_server).messages.create(
        model=MODEL, max_tokens=64, messages=ASK, extra_body=GREEDY
    )
    chat = openai.OpenAI(base_url=agent_server.v1, api_key="x").chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0,  # type: ignore[arg-type]
    )
    assert chat.choices[0].message.content == message.content[1].text  # type: ignore[union-attr]
    assert chat.usage is not None
    usage = message.usage
    assert chat.usage.prompt_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert chat.usage.completion_tokens == usage.output_tokens


def test_the_stream_and_its_helpers(agent_server: LiveServer) -> None:
    with sdk(agent_server).messages.stream(
        model=MODEL, max_tokens=64, messages=ASK, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert deltas[0] == "thinking_delta" and "text_delta" in deltas
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[1].text == ANSWER  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 6
    with sdk(agent_server).messages.stream(
        model=MODEL, max_tokens=64, messages=ASK, extra_body=GREEDY
    ) as stream:
        assert "".join(stream.text_stream) == ANSWER


def test_forced_tool_use_and_its_result(agent_server: LiveServer) -> None:
    client = sdk(agent_server)
    message = client.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    assert message.stop_reason == "tool_use"
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    answer = client.messages.create(
        model=MODEL,
        max_tokens=64,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18C"}],
            },
        ],
        extra_body=GREEDY,
    )
    assert answer.content[-1].text == ANSWER  # type: ignore[union-attr]


def test_streamed_tool_use_arrives_as_input_json(agent_server: LiveServer) -> None:
    with sdk(agent_server).messages.stream(
        model=MODEL,
        max_tokens=200,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(
        e.delta.partial_json  # type: ignore[union-attr]
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"  # type: ignore[union-attr]
    )
    (use,) = [block for block in final.content if block.type == "tool_use"]
    assert json.loads(partial) == use.input and final.stop_reason == "tool_use"


def test_count_tokens_is_the_prompt_a_message_runs(agent_server: LiveServer) -> None:
    client = sdk(agent_server)
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER])  # type: ignore[list-item]
    message = client.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=ASK,
        tools=[WEATHER],
        extra_body=GREEDY,  # type: ignore[list-item]
    )
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    plain = client.messages.count_tokens(model=MODEL, messages=ASK)
    assert plain.input_tokens < counted.input_tokens  # the tools are in the prompt


def test_stop_sequences_name_the_one_that_stopped(agent_server: LiveServer) -> None:
    message = sdk(agent_server).messages.create(
        model=MODEL, max_tokens=64, messages=ASK, stop_sequences=[" user"], extra_body=GREEDY
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == " user"
    assert message.content[0].thinking == "The"  # type: ignore[union-attr]


def test_output_config_format_constrains_the_answer(agent_server: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    message = sdk(agent_server).messages.create(
        model=MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "A city as JSON"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    text = "".join(b.text for b in message.content if b.type == "text")  # type: ignore[union-attr]
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "content blocks of type 'image'",
        ),
        ({"messages": ASK, "tools": [{"type": "web_search_20250305", "name": "s"}]}, "server tool"),
        ({"messages": ASK, "max_tokens": None}, "max_tokens"),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_requests_are_anthropic_400s(
    agent_server: LiveServer, body: dict[str, Any], needle: str
) -> None:
    resp = httpx.post(
        f"{agent_server.url}/v1/messages", json={"model": MODEL, "max_tokens": 8, **body}
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert needle in error["error"]["message"]


def test_an_unknown_model_is_a_not_found_error(agent_server: LiveServer) -> None:
    with pytest.raises(anthropic.NotFoundError) as raised:
        sdk(agent_server).messages.create(model="claude-opus", max_tokens=8, messages=ASK)
    assert raised.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


@pytest.fixture(scope="module")
def keyed_server(scripted_built: Any) -> Iterator[LiveServer]:
    with live_server(scripted_built, agent_settings(api_key="sekret")) as live:
        yield live


def test_x_api_key_is_the_api_key(keyed_server: LiveServer) -> None:
    message = sdk(keyed_server, key="sekret").messages.create(
        model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY
    )
    assert message.content[-1].text == ANSWER  # type: ignore[union-attr]
    with pytest.raises(anthropic.AuthenticationError) as raised:
        sdk(keyed_server, key="wrong").messages.create(model=MODEL, max_tokens=8, messages=ASK)
    assert raised.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    bearer = httpx.post(
        f"{keyed_server.url}/v1/chat/completions",
        headers={"x-api-key": "sekret"},
        json={"model": MODEL, "messages": ASK, "max_tokens": 2},
    )
    assert bearer.status_code == 200  # the same key header works on every route
