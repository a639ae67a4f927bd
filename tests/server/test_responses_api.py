"""OpenAI's Responses API through the official ``openai`` SDK against a live server: the
scripted model's reasoning and answer as items, streamed and whole; function calls and
their outputs; ``text.format``; ``previous_response_id``; the store (GET, DELETE,
bounds in /metrics); background responses and ``/cancel``; the errors. The same
conversation through chat completions gives the same tokens."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.agents import ANSWER, MODEL, REASONING, agent_settings
from tests.server.conftest import LiveServer, live_server
from tests.server.test_endpoints import metric_value
from tests.server.test_tool_calling import TOOLS

FUNCTION_TOOLS = [
    {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
    for t in TOOLS
]


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)


def test_reasoning_and_answer_come_back_as_items(agent_server: LiveServer) -> None:
    response = sdk(agent_server).responses.create(model=MODEL, input="Hi", temperature=0)
    assert response.status == "completed" and response.error is None
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    reasoning = response.output[0]
    assert [part.text for part in reasoning.content or []] == [REASONING]
    assert response.output_text == ANSWER
    assert response.id.startswith("resp_") and response.output[1].id.startswith("msg_")
    usage = response.usage
    assert usage is not None and usage.output_tokens == 6  # 5 scripted tokens and EOS
    assert usage.output_tokens_details.reasoning_tokens == 2
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_the_same_tokens_as_chat_completions(agent_server: LiveServer) -> None:
    client = sdk(agent_server)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0
    )
    response = client.responses.create(model=MODEL, input="Hi", temperature=0)
    message = chat.choices[0].message
    assert message.content == response.output_text == ANSWER
    assert (message.model_extra or {}).get("reasoning") == REASONING
    assert chat.usage is not None and response.usage is not None
    assert chat.usage.prompt_tokens == response.usage.input_tokens
    assert chat.usage.completion_tokens == response.usage.output_tokens


def test_the_stream_is_the_typed_event_sequence(agent_server: LiveServer) -> None:
    with sdk(agent_server).responses.stream(model=MODEL, input="Hi", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    for expected in (
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert expected in kinds, expected
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == ANSWER
    assert [item.type for item in final.output] == ["reasoning", "message"]


def test_a_streamed_function_call_sends_its_argument_events(agent_server: LiveServer) -> None:
    with sdk(agent_server).responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=FUNCTION_TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=200,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert deltas == done.arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])  # type: ignore[index]
    assert kinds[-1] == "response.completed"
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(agent_server: LiveServer) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "metadata": {"k": "v"}}
    with sdk(agent_server).responses.stream(**body) as stream:  # type: ignore[arg-type]
        events = list(stream)
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert last.response.metadata == {"k": "v"}  # echoed as sent
    assert last.response.usage is not None and last.response.usage.output_tokens == 3


def test_stop_ends_the_answer_before_the_stop_text(agent_server: LiveServer) -> None:
    word = ANSWER[2:]  # the scripted answer is one word: stop inside it
    resp = httpx.post(
        f"{agent_server.v1}/responses",
        json={"model": MODEL, "input": "Hi", "stop": [word], "temperature": 0, "store": False},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    (message,) = [item for item in resp.json()["output"] if item["type"] == "message"]
    text = message["content"][0]["text"]
    assert text == ANSWER[:2]


def test_a_function_call_and_its_output_round_trip(agent_server: LiveServer) -> None:
    client = sdk(agent_server)
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=FUNCTION_TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=200,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    arguments = json.loads(calls[0].arguments)
    jsonschema.validate(arguments, TOOLS[0]["function"]["parameters"])  # type: ignore[index]
    follow = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C"}],
        tools=FUNCTION_TOOLS,  # type: ignore[arg-type]
        temperature=0,
    )
    assert follow.status == "completed" and follow.output_text == ANSWER
    assert follow.usage is not None and first.usage is not None
    assert follow.usage.input_tokens > first.usage.input_tokens  # the history came along
    assert follow.usage.input_tokens_details.cached_tokens > 0  # from the prefix cache
    # The same history sent as items, without the store: the same prompt.
    again = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C"},
        ],
        tools=FUNCTION_TOOLS,  # type: ignore[arg-type]
        temperature=0,
        store=False,
    )
    assert again.usage is not None and again.usage.input_tokens == follow.usage.input_tokens


def test_text_format_json_schema_is_followed(agent_server: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    response = sdk(agent_server).responses.create(
        model=MODEL,
        input="Name a city as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        temperature=0,
        max_output_tokens=60,
    )
    jsonschema.validate(json.loads(response.output_text), schema)


def test_stored_responses_are_read_deleted_and_missed(agent_server: LiveServer) -> None:
    client = sdk(agent_server)
    response = client.responses.create(model=MODEL, input="Hi", temperature=0)
    fetched = client.responses.retrieve(response.id)
    assert fetched.output_text == ANSWER and fetched.status == "completed"
    items = httpx.get(f"{agent_server.v1}/responses/{response.id}/input_items").json()
    assert items["object"] == "list" and items["data"][0]["content"] == "Hi"
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as missed:
        client.responses.create(model=MODEL, input="x", previous_response_id=response.id)
    error = missed.value.body
    assert isinstance(error, dict) and error["code"] == "previous_response_not_found"
    assert error["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.fixture(scope="module")
def small_store(scripted_built: Any) -> Iterator[LiveServer]:
    with live_server(scripted_built, agent_settings(responses_store_size=2)) as live:
        yield live


def test_the_store_evicts_the_least_recent_and_says_so(small_store: LiveServer) -> None:
    client = sdk(small_store)
    ids = [client.responses.create(model=MODEL, input=f"Hi {i}").id for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[2]).status == "completed"
    assert metric_value(small_store, "kvserve_responses_stored") == 2
    assert metric_value(small_store, "kvserve_responses_evicted_total") == 1
    assert metric_value(small_store, "kvserve_responses_store_misses_total") >= 1
    assert metric_value(small_store, "kvserve_responses_stored_bytes") > 0


@pytest.fixture(scope="module")
def long_server(tiny_built: Any) -> Iterator[LiveServer]:
    """The random tiny model, which never says EOS: responses that run until stopped."""
    with live_server(tiny_built, agent_settings(served_model_names=(MODEL,))) as live:
        yield live


def test_background_responses_are_polled_and_cancelled(long_server: LiveServer) -> None:
    client = sdk(long_server)
    short = client.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=4)
    assert short.status in ("in_progress", "completed")
    deadline = time.monotonic() + 60
    while client.responses.retrieve(short.id).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    done = client.responses.retrieve(short.id)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    long = client.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=900)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    deadline = time.monotonic() + 30
    while client.responses.retrieve(long.id).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.responses.retrieve(long.id).status == "cancelled"
    long_server.wait_idle()  # the cancelled run left no block behind


def test_a_response_deleted_while_running_stays_deleted(long_server: LiveServer) -> None:
    client = sdk(long_server)
    long = client.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=900)
    deleted = httpx.delete(f"{long_server.v1}/responses/{long.id}", timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    long_server.wait_idle()  # the run ended (and left no block behind)
    time.sleep(0.5)  # room for the job's own end, which stored it again before the fix
    # Its end was not stored again as "cancelled": a read and a second delete both miss.
    missed = httpx.get(f"{long_server.v1}/responses/{long.id}", timeout=30)
    assert missed.status_code == 404, missed.text
    assert httpx.delete(f"{long_server.v1}/responses/{long.id}").status_code == 404


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input": [{"type": "computer_call", "id": "x"}]}, "input items of type 'computer_call'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "content parts of type 'input_image'",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools of type 'web_search'"),
        ({"input": "x", "conversation": "conv_1"}, "'conversation' is not supported"),
        ({"input": []}, "must not be an empty list"),
        ({"input": "x", "temperature": 3}, "temperature"),
    ],
)
def test_bad_requests_are_400s_naming_what_is_wrong(
    agent_server: LiveServer, body: dict[str, Any], needle: str
) -> None:
    resp = httpx.post(f"{agent_server.v1}/responses", json={"model": MODEL, **body})
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]


def test_namespace_tools_call_back_with_their_namespace(agent_server: LiveServer) -> None:
    """Codex groups tools in namespaces: the model sees ``<namespace>__<name>``, the call
    comes back as the namespace's function, and goes into the history the same way."""
    lookup = {
        "type": "function",
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"key": {"enum": ["a", "b"]}},
            "required": ["key"],
            "additionalProperties": False,
        },
    }
    tools = [{"type": "namespace", "name": "store", "description": "A store.", "tools": [lookup]}]
    client = sdk(agent_server)
    first = client.responses.create(
        model=MODEL,
        input="Look it up.",
        tools=tools,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=60,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, call.namespace) == ("lookup", "store")
    history = [
        {"role": "user", "content": "Look it up."},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": "lookup",
            "namespace": "store",
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "found"},
    ]
    follow = client.responses.create(model=MODEL, input=history, tools=tools, temperature=0)  # type: ignore[arg-type]
    assert follow.output_text == ANSWER


def test_a_forced_call_cut_by_the_token_limit_is_reported_as_cut(agent_server: LiveServer) -> None:
    """Cut before the function's name was whole: ``length`` / ``incomplete``, and no call
    of an empty name on any route."""
    client = sdk(agent_server)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_tokens=2,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "length"
    assert all(call.function.name for call in choice.message.tool_calls or [])
    response = client.responses.create(
        model=MODEL,
        input="Weather?",
        tools=FUNCTION_TOOLS,
        tool_choice="required",
        max_output_tokens=2,  # type: ignore[arg-type]
    )
    assert response.status == "incomplete"
    assert all(item.name for item in response.output if item.type == "function_call")
