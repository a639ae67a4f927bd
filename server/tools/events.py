"""What one choice's output becomes: content text and tool calls, as a stream of events.

Streaming sends each event as a delta; a whole response joins them (``assemble``), so a
streamed and a non-streamed answer to the same output are the same by construction.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ContentText:
    text: str


@dataclass(frozen=True)
class ReasoningText:
    """Reasoning the model wrote before its answer (server/reasoning.py)."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins: its position among the choice's calls, id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """More characters of the JSON arguments of call ``index``."""

    index: int
    text: str


OutputEvent = ContentText | ReasoningText | ToolCallStart | ToolCallArguments


def delta_of(event: OutputEvent) -> dict[str, Any]:
    """The OpenAI streaming ``delta`` for one event."""
    if isinstance(event, ContentText):
        return {"content": event.text}
    if isinstance(event, ReasoningText):
        return {"reasoning": event.text}
    if isinstance(event, ToolCallStart):
        call = {
            "index": event.index,
            "id": event.id,
            "type": "function",
            "function": {"name": event.name, "arguments": ""},
        }
        return {"tool_calls": [call]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


@dataclass
class AssembledMessage:
    content: str
    tool_calls: list[dict[str, Any]]
    reasoning: str | None = None  # None: the server splits no reasoning off

    def as_openai(self) -> dict[str, Any]:
        """The ``message`` of a chat completion: content is null when the choice only
        called tools (whitespace around the calls is not an answer); ``reasoning``
        (vLLM's field) when a reasoning parser split some off."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning"] = self.reasoning
        if self.tool_calls:
            message["content"] = self.content if self.content.strip() else None
            message["tool_calls"] = self.tool_calls
        return message


def assemble(events: Iterable[OutputEvent]) -> AssembledMessage:
    """Join a choice's events into its final content and tool calls."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        if isinstance(event, ContentText):
            content.append(event.text)
        elif isinstance(event, ReasoningText):
            reasoning.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls[event.index] = {
                "id": event.id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
        else:
            calls[event.index]["function"]["arguments"] += event.text
    joined = "".join(reasoning) if reasoning else None
    return AssembledMessage("".join(content), [calls[i] for i in sorted(calls)], joined)
