"""Structured outputs through the official ``openai`` SDK against a live server: the
output parses and validates against the requested schema (the embedded SmolLM2), vLLM's
``structured_outputs`` / ``guided_*`` fields, and the 400s for bad constraints."""

from __future__ import annotations

import json
import re
from enum import Enum
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

ASK = [{"role": "user", "content": "Describe a person called Ada who is 36, as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)  # bounded: a small model may repeat digits


TRIP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "season": {"enum": ["spring", "summer", "autumn", "winter"]},
        "budget": {
            "type": "object",
            "properties": {
                "amount": {"type": "integer", "minimum": 0, "maximum": 100000},
                "currency": {"enum": ["EUR", "USD"]},
            },
            "required": ["amount", "currency"],
            "additionalProperties": False,
        },
        "sights": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["city", "season", "budget", "sights"],
    "additionalProperties": False,
}

TRIP_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "trip", "schema": TRIP_SCHEMA, "strict": True},
}


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300)


@pytest.mark.slow
def test_sdk_parse_into_a_pydantic_model(smollm_tools_server: LiveServer):
    completion = sdk(smollm_tools_server).chat.completions.parse(
        model="smollm2", messages=ASK, response_format=Person, max_tokens=120, temperature=0
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content or "") == choice.message.parsed


@pytest.mark.slow
def test_json_object(smollm_tools_server: LiveServer):
    resp = sdk(smollm_tools_server).chat.completions.create(
        model="smollm2",
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=150,
        temperature=0,
    )
    # Any object is allowed, so nothing bounds a string the model keeps writing: a
    # "length" finish is truncated JSON (documented, as OpenAI does); a "stop" one parses.
    content = resp.choices[0].message.content or ""
    if resp.choices[0].finish_reason == "length":
        assert content.startswith("{")
    else:
        assert resp.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(content), dict)


@pytest.mark.slow
def test_schema_with_enums_nested_objects_arrays_and_required(smollm_tools_server: LiveServer):
    resp = sdk(smollm_tools_server).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Plan a short trip to Rome as JSON."}],
        response_format=TRIP_FORMAT,  # type: ignore[arg-type]
        max_tokens=200,
        temperature=0,
    )
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content or ""), TRIP_SCHEMA)


@pytest.mark.slow
def test_json_schema_streamed_with_two_sampled_choices(smollm_tools_server: LiveServer):
    stream = sdk(smollm_tools_server).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Plan a short trip as JSON."}],
        response_format=TRIP_FORMAT,  # type: ignore[arg-type]
        max_tokens=200,
        temperature=0.8,
        seed=7,
        n=2,
        stream=True,
    )
    texts: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str | None] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), TRIP_SCHEMA)


class Mood(str, Enum):
    happy = "happy"
    sad = "sad"


@pytest.mark.slow
def test_vllm_structured_outputs_choice_and_regex(smollm_tools_server: LiveServer):
    client = sdk(smollm_tools_server)
    question = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    resp = client.chat.completions.create(
        model="smollm2",
        messages=question,
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert resp.choices[0].message.content in ("yes", "no")
    assert resp.choices[0].finish_reason == "stop"
    resp = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Give a phone number."}],
        max_tokens=20,
        extra_body={"guided_regex": r"\+[0-9]{2} [0-9]{3}-[0-9]{4}"},
    )
    assert re.fullmatch(r"\+[0-9]{2} [0-9]{3}-[0-9]{4}", resp.choices[0].message.content or "")


@pytest.mark.slow
def test_completions_response_format(smollm_tools_server: LiveServer):
    resp = sdk(smollm_tools_server).completions.create(
        model="smollm2",
        prompt="A JSON object describing a cat:",
        max_tokens=120,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].text), dict)


# ---------------------------------------------------------------------- tiny model
# The grammar holds whatever the (random) model prefers: cheap end-to-end checks.


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "messages": ASK, "max_tokens": 8, **fields}


def test_choice_constrains_even_a_random_model(server: LiveServer):
    body = chat(structured_outputs={"choice": ["red", "green", "blue"]}, n=3, temperature=1.0)
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        assert choice["message"]["content"] in ("red", "green", "blue")
        assert choice["finish_reason"] == "stop"


def test_legacy_guided_choice_on_completions(server: LiveServer):
    body = {"model": TINY_MODEL_NAME, "prompt": "x", "max_tokens": 8, "guided_choice": ["a", "b"]}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] in ("a", "b")


def error_of(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema",
            "required",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "string", "pattern": "(?<=a)b"},
                    },
                }
            },
            "response_format.json_schema.schema",
            "ookbehind",
        ),
        ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs.regex", "ookbehind"),
        ({"structured_outputs": {}}, "structured_outputs", "one of"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least"),
        ({"guided_json": "{not json"}, "guided_json", "JSON"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "guided_regex",
            "at most one",
        ),
        (
            {"structured_outputs": {"json": {"type": "object"}, "regex": "a"}},
            "structured_outputs.regex",
            "at most one",
        ),
        ({"structured_outputs": {"whitespace_pattern": " "}}, None, "whitespace_pattern"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    server: LiveServer, fields: dict[str, Any], param: str | None, needle: str
):
    error = error_of(post(server, "/v1/chat/completions", chat(**fields)))
    assert needle in error["message"]
    if param is not None:
        assert (error["param"] or "").startswith(param), error
    server.wait_idle()
