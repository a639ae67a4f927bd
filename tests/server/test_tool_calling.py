"""Tool calling through the official ``openai`` SDK against a live server: forced calls
(``required`` and a named function, streamed and not) whose arguments validate against
the function's schema, a full round trip with a ``role: tool`` message, ``auto`` with the
hermes parser, and the 400s for malformed tool requests."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import TINY_MODEL_NAME, LiveServer

# A hang guard, not a speed claim: building the SmolLM2 fixture on a busy shared CPU
# can take several minutes, which pytest-timeout counts against the first test.
pytestmark = pytest.mark.timeout(1800)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}  # type: ignore[index]
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300)


def assert_valid_calls(calls: Any, names: set[str]) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_valid_calls(smollm_tools_server: LiveServer, parallel: bool):
    resp = sdk(smollm_tools_server).chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=150,
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert_valid_calls(choice.message.tool_calls, {"get_weather", "add"})
    if not parallel:
        assert len(choice.message.tool_calls or []) == 1


@pytest.mark.slow
def test_named_function_returns_a_call_of_it(smollm_tools_server: LiveServer):
    resp = sdk(smollm_tools_server).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is 2 plus 3?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=60,
        temperature=0,
    )
    calls = resp.choices[0].message.tool_calls
    assert_valid_calls(calls, {"add"})
    assert len(calls or []) == 1
    assert resp.choices[0].finish_reason == "tool_calls"


def stream_calls(stream: Any) -> tuple[dict[int, dict[str, Any]], str | None, list[Any]]:
    """Reassemble streamed tool calls by hand, keeping the raw deltas to check their shape."""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    deltas = []
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                deltas.append(delta)
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                if delta.id:
                    call["id"] = delta.id
                if delta.function and delta.function.name:
                    call["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    return calls, finish, deltas


@pytest.mark.slow
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_forced_calls(smollm_tools_server: LiveServer, tool_choice: Any):
    stream = sdk(smollm_tools_server).chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=tool_choice,
        max_tokens=150,
        temperature=0,
        stream=True,
    )
    calls, finish, deltas = stream_calls(stream)
    assert finish == "tool_calls"
    first = deltas[0]
    assert first.id.startswith("call_") and first.type == "function" and first.function.name
    assert len(deltas) > 2, "arguments should arrive in several fragments"
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=30)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


@pytest.mark.slow
def test_sdk_stream_helper_parses_pydantic_tool_arguments(smollm_tools_server: LiveServer):
    tool = openai.pydantic_function_tool(GetWeather)
    with sdk(smollm_tools_server).chat.completions.stream(
        model="smollm2",
        messages=ASK,  # type: ignore[arg-type]
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,  # one call: an array of calls has no length bound
        max_tokens=120,
        temperature=0,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, GetWeather)


@pytest.mark.slow
def test_full_tool_round_trip(smollm_tools_server: LiveServer):
    client = sdk(smollm_tools_server)
    messages: list[Any] = [{"role": "user", "content": "What is 2 plus 3? Use the add tool."}]
    first = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=60,
        temperature=0,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls or []
    args = json.loads(call.function.arguments)
    messages.append(message)  # the SDK's own message object, as agent loops do
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}
    )
    second = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=30,
        temperature=0,
    )
    answer = second.choices[0]
    assert answer.message.tool_calls is None
    assert answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # The call and its result reached the prompt: it is longer than the question alone
    # rendered the same way (tool_choice "none" leaves the tool list out of both).
    alone = client.chat.completions.create(
        model="smollm2",
        messages=messages[:1],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=1,
    )
    assert second.usage and alone.usage
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 10


@pytest.mark.slow
def test_auto_answers_in_text_or_valid_calls(smollm_tools_server: LiveServer):
    resp = sdk(smollm_tools_server).chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=TOOLS,
        max_tokens=80,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = resp.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name in SCHEMAS
            assert isinstance(json.loads(call.function.arguments), dict)
    else:  # a text answer (a malformed <tool_call> the model wrote stays text)
        assert choice.message.content
        assert choice.finish_reason in ("stop", "length")


# ---------------------------------------------------------------------- tiny model


def post(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "messages": ASK, "max_tokens": 40, **fields}


def test_named_call_from_a_random_model_still_validates(server: LiveServer):
    """The grammar, not the model, guarantees the arguments: even random weights give a
    valid call once the output finishes (here: an enum-only schema, so it must)."""
    tool = {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {
                "type": "object",
                "properties": {"color": {"enum": ["red", "blue"]}},
                "required": ["color"],
                "additionalProperties": False,
            },
        },
    }
    body = chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "pick"}})
    resp = post(server, body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    if choice["finish_reason"] == "tool_calls":
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "pick"
        assert json.loads(call["function"]["arguments"])["color"] in ("red", "blue")
    else:  # whitespace the grammar allows may run out the budget
        assert choice["finish_reason"] == "length"
    server.wait_idle()


def error_of(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


NAMED_ADD = {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
        ({"tools": []}, "tools", ""),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "required"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools.0.type", ""),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
            "names",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
            "valid JSON schema",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
            "object",
        ),
        ({"tools": [ADD, ADD], "tool_choice": "required"}, "tools[1]", "twice"),
        (
            {
                "tools": [
                    ADD,
                    {
                        "type": "function",
                        "function": {
                            "name": "g",
                            "parameters": {
                                "type": "object",
                                "properties": {"s": {"type": "string", "pattern": "(?<=a)b"}},
                            },
                        },
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
            "ookbehind",
        ),
        (
            {"tools": TOOLS, "tool_choice": NAMED_ADD, "response_format": {"type": "json_object"}},
            None,
            "at most one",
        ),
        (
            {"messages": [{"role": "tool", "tool_call_id": "call_x", "content": "5"}]},
            "messages.0.tool_call_id",
            "call_x",
        ),
        ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, "messages.0", ""),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages.0.content", ""),
        ({"functions": [{"name": "f"}]}, None, "functions"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(
    server: LiveServer, fields: dict[str, Any], param: str | None, needle: str
):
    error = error_of(post(server, chat(**fields)))
    assert needle in error["message"]
    if param is not None:
        assert (error["param"] or "").startswith(param), error
    server.wait_idle()


def test_auto_with_a_constraint_is_refused(tiny_built: Any):
    from server.settings import ServerSettings
    from tests.server.conftest import live_server

    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with live_server(tiny_built, settings) as live:
        body = chat(tools=TOOLS, response_format={"type": "json_object"}, model=None)
        error = error_of(post(live, body))
        assert "could never call a tool" in error["message"]
        assert error["param"] == "response_format"
        ok = post(live, chat(tools=TOOLS, model=None, max_tokens=4))
        assert ok.status_code == 200, ok.text
