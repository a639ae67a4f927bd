"""``langchain-openai`` against a live kvserve of the embedded SmolLM2: the default
``with_structured_output`` (json_schema) round-trips a pydantic model, and ``bind_tools``
with a forced choice returns valid tool calls, whole and streamed."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import LiveServer

pytest.importorskip("langchain_openai")

# A hang guard, not a speed claim: building the SmolLM2 fixture on a busy shared CPU
# can take several minutes, which pytest-timeout counts against the first test.
pytestmark = pytest.mark.timeout(1800)


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)  # bounded: a small model may repeat digits


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=30)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


def chat_model(server: LiveServer, **kwargs: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=server.v1,
        api_key="x",  # type: ignore[arg-type]
        model="smollm2",
        temperature=0,
        max_retries=0,
        timeout=300,
        **kwargs,
    )


@pytest.mark.slow
def test_with_structured_output_returns_the_model(smollm_tools_server: LiveServer):
    structured = chat_model(smollm_tools_server, max_tokens=120).with_structured_output(Person)
    person = structured.invoke("Describe a person called Ada who is 36.")
    assert isinstance(person, Person)


@pytest.mark.slow
def test_bind_tools_with_a_forced_call(smollm_tools_server: LiveServer):
    llm = chat_model(smollm_tools_server, max_tokens=120).bind_tools(
        [GetWeather], tool_choice="GetWeather"
    )
    message = llm.invoke("What is the weather like in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])
    assert call["id"].startswith("call_")


@pytest.mark.slow
def test_bind_tools_streamed_chunks_reassemble(smollm_tools_server: LiveServer):
    llm = chat_model(smollm_tools_server, max_tokens=120).bind_tools(
        [GetWeather], tool_choice="required", parallel_tool_calls=False
    )
    chunks = list(llm.stream("What is the weather like in Oslo?"))
    assert len(chunks) > 2
    message = chunks[0]
    for chunk in chunks[1:]:
        message = message + chunk
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])
