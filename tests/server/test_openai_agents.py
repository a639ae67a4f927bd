"""The openai-agents SDK running an agent with one function tool against kvserve's
Responses API: the model (forced to call) calls the tool, the SDK runs it and the run
ends with the tool's output (``tool_use_behavior="stop_on_first_tool"``: the scripted
model would call again forever)."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

from tests.server.agents import MODEL
from tests.server.conftest import LiveServer

agents = pytest.importorskip("agents")


def test_an_agent_calls_its_function_tool(agent_server: LiveServer) -> None:
    from openai import AsyncOpenAI

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:  # enum: a short forced call
        """The weather in a city."""
        calls.append(city)
        return f"18C in {city}"

    client = AsyncOpenAI(base_url=agent_server.v1, api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=120
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    agents.set_tracing_disabled(True)
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=3))
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")
    assert result.final_output == f"18C in {calls[0]}"
