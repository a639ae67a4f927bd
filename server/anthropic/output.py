"""One message's output: the choice's output events as Anthropic content blocks, and,
when streaming, as Anthropic's event sequence.

Blocks open as their events arrive and close when another kind starts or the output ends:
``thinking`` (reasoning), ``text``, one ``tool_use`` per call (its input streamed as
``input_json_delta``). Whitespace before the first text is held back and dropped if a
tool call comes first. ``stop_reason``: ``tool_use`` after calls, ``max_tokens`` when the
token limit cut the output (``model_context_window_exceeded`` when the context's end came
first: a ``max_tokens`` past it is cut to it, as Anthropic's models do), ``stop_sequence``
(naming it) when a stop sequence did, else ``end_turn``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from server.routes.generation import ChoiceUpdate, GenerationRun
from server.routes.streaming import named_sse
from server.tools.events import (
    ContentText,
    OutputEvent,
    ReasoningText,
    ToolCallArguments,
    ToolCallStart,
)
from server.tools.output import ChoiceOutput

Event = dict[str, Any]


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class MessageOutput:
    """Content blocks built from one choice's events."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._json = ""  # the open tool_use block's input so far
        self._held = ""

    @property
    def called_tools(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.blocks) or (
            self._open is not None and self._open["type"] == "tool_use"
        )

    def feed(self, events: list[OutputEvent]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, ReasoningText):
                out += self._delta("thinking", {"type": "thinking_delta", "thinking": event.text})
            elif isinstance(event, ContentText):
                out += self._text(event.text)
            elif isinstance(event, ToolCallStart):
                self._held = ""
                out += self._close()
                block = {
                    "type": "tool_use",
                    "id": new_tool_use_id(),
                    "name": event.name,
                    "input": {},
                }
                out += self._start(block)
            else:
                assert isinstance(event, ToolCallArguments)
                self._json += event.text
                delta = {"type": "input_json_delta", "partial_json": event.text}
                out.append(
                    {"type": "content_block_delta", "index": len(self.blocks), "delta": delta}
                )
        return out

    def finish(self) -> list[Event]:
        self._held = ""
        return self._close()

    def _text(self, text: str) -> list[Event]:
        if self._open is None or self._open["type"] != "text":
            if not (self._held + text).strip():
                self._held += text
                return []
            text, self._held = self._held + text, ""
        return self._delta("text", {"type": "text_delta", "text": text})

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[Event]:
        out: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            out += self._close()
            empty = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            out += self._start(empty)
        assert self._open is not None
        field = "text" if kind == "text" else "thinking"
        self._open[field] += delta[field]
        out.append({"type": "content_block_delta", "index": len(self.blocks), "delta": delta})
        return out

    def _start(self, block: dict[str, Any]) -> list[Event]:
        self._open, self._json = block, ""
        start = {
            "type": "content_block_start",
            "index": len(self.blocks),
            "content_block": dict(block),
        }
        return [start]

    def _close(self) -> list[Event]:
        block, self._open = self._open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = _parsed_input(self._json)
        index = len(self.blocks)
        self.blocks.append(block)
        return [{"type": "content_block_stop", "index": index}]


def _parsed_input(text: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object ({} when they were cut short)."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageJob:
    """A submitted run and the Anthropic message it answers with."""

    def __init__(
        self, run: GenerationRun, choice: ChoiceOutput, model: str, window_bound: bool = False
    ) -> None:
        self.run = run
        self.model = model
        self.window_bound = window_bound  # the budget is what the context had left
        self.id = new_message_id()
        self.output = MessageOutput()
        self._choice = choice
        self._update: ChoiceUpdate | None = None

    def _events(self, update: ChoiceUpdate) -> list[Event]:
        events = self._choice.feed(update.text)
        if update.finish_reason is not None:
            events += self._choice.finish()
            self._update = update
        return self.output.feed(events)

    async def collect(self) -> dict[str, Any]:
        async for update in self.run:
            self._events(update)
        self.output.finish()
        return {
            **self._envelope(),
            "content": self.output.blocks,
            **self._stop(),
            "usage": self._usage(),
        }

    async def stream(self):  # type: ignore[no-untyped-def]
        start = {**self._envelope(), "content": [], "stop_reason": None, "stop_sequence": None}
        start["usage"] = {**self._usage(), "output_tokens": 0}
        yield _sse({"type": "message_start", "message": start})
        yield _sse({"type": "ping"})
        async for update in self.run:
            for event in self._events(update):
                yield _sse(event)
        for event in self.output.finish():
            yield _sse(event)
        usage = {"output_tokens": self.run.usage()["completion_tokens"]}
        yield _sse({"type": "message_delta", "delta": self._stop(), "usage": usage})
        yield _sse({"type": "message_stop"})

    def _envelope(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def _stop(self) -> dict[str, Any]:
        update = self._update
        reason = update.finish_reason if update is not None else None
        if update is not None and update.stop_string is not None:
            return {"stop_reason": "stop_sequence", "stop_sequence": update.stop_string}
        if reason == "length":
            cause = "model_context_window_exceeded" if self.window_bound else "max_tokens"
            return {"stop_reason": cause, "stop_sequence": None}
        if self.output.called_tools:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def _usage(self) -> dict[str, Any]:
        usage = self.run.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {
            "input_tokens": usage["prompt_tokens"] - cached,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": usage["completion_tokens"],
        }


def _sse(event: Event) -> str:
    return named_sse(event["type"], event)
