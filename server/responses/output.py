"""One response's output: the choice's output events (reasoning, content, tool calls) as
Responses output items, and, when streaming, as the typed event sequence.

Items open as their events arrive and close when another kind starts or the output ends:
a ``reasoning`` item (``rs_``) with one ``reasoning_text`` part, a ``message`` item
(``msg_``) with one ``output_text`` part, a ``function_call`` item (``fc_``) per call.
Whitespace before the first answer text is held back and dropped if a tool call comes
first (an answer of nothing but calls has no message item), as the chat route drops it.
Every stream event carries the next ``sequence_number``; ``ResponseOutput.items`` is the
finished ``output`` either way, so a streamed and a whole response agree by construction.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

from server.tools.events import (
    ContentText,
    OutputEvent,
    ReasoningText,
    ToolCallArguments,
    ToolCallStart,
)

Event = dict[str, Any]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Sequencer:
    """Numbers a stream's events."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def event(self, kind: str, **fields: Any) -> Event:
        return {"type": kind, "sequence_number": next(self._next), **fields}


class ResponseOutput:
    """Output items built from one choice's events."""

    def __init__(
        self, sequencer: Sequencer, names: dict[str, tuple[str | None, str]] | None = None
    ) -> None:
        self.seq = sequencer
        self._names = names or {}  # chat names of namespaced functions -> (namespace, name)
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text = ""  # the open item's text or arguments so far
        self._held = ""  # whitespace before the first answer text

    @property
    def called_tools(self) -> bool:
        return any(item["type"] == "function_call" for item in self.items)

    @property
    def text(self) -> str:
        """The answer text of every message item (what the SDK calls ``output_text``)."""
        return "".join(
            part["text"]
            for item in self.items
            if item["type"] == "message"
            for part in item["content"]
        )

    def feed(self, events: list[OutputEvent]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, ReasoningText):
                out += self._delta("reasoning", event.text)
            elif isinstance(event, ContentText):
                out += self._content(event.text)
            elif isinstance(event, ToolCallStart):
                self._held = ""
                out += self._close()
                out += self._open_call(event)
            else:
                assert isinstance(event, ToolCallArguments)
                out += self._delta("function_call", event.text)
        return out

    def finish(self, status: str = "completed") -> list[Event]:
        """Close the open item (``incomplete`` when the output was cut)."""
        self._held = ""
        return self._close(status)

    def _content(self, text: str) -> list[Event]:
        if self._open is None or self._open["type"] != "message":
            if not (self._held + text).strip():
                self._held += text
                return []
            text, self._held = self._held + text, ""
        return self._delta("message", text)

    def _delta(self, kind: str, text: str) -> list[Event]:
        out: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            out += self._close()
            out += self._open_item(kind)
        assert self._open is not None
        self._text += text
        where = self._where()
        if kind == "message":
            out.append(
                self.seq.event(
                    "response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]
                )
            )
        elif kind == "reasoning":
            out.append(
                self.seq.event(
                    "response.reasoning_text.delta", **where, content_index=0, delta=text
                )
            )
        else:
            out.append(
                self.seq.event("response.function_call_arguments.delta", **where, delta=text)
            )
        return out

    def _open_item(self, kind: str) -> list[Event]:
        if kind == "message":
            item = {
                "id": new_item_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {
                "id": new_item_id("rs"),
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [],
            }
            part = {"type": "reasoning_text", "text": ""}
        self._open, self._text = item, ""
        where = self._where()
        return [
            self.seq.event(
                "response.output_item.added", output_index=where["output_index"], item=item
            ),
            self.seq.event("response.content_part.added", **where, content_index=0, part=part),
        ]

    def _open_call(self, start: ToolCallStart) -> list[Event]:
        namespace, name = self._names.get(start.name, (None, start.name))
        item = {
            "id": new_item_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": start.id,
            "name": name,
            "arguments": "",
        }
        if namespace is not None:
            item["namespace"] = namespace
        self._open, self._text = item, ""
        added = self.seq.event(
            "response.output_item.added", output_index=len(self.items), item=dict(item)
        )
        return [added]

    def _close(self, status: str = "completed") -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items)}
        text = self._text
        out: list[Event] = []
        if item["type"] == "function_call":
            item["arguments"] = text
            out.append(
                self.seq.event(
                    "response.function_call_arguments.done",
                    **where,
                    arguments=text,
                    name=item["name"],
                )
            )
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out.append(
                self.seq.event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
            )
            out.append(
                self.seq.event("response.content_part.done", **where, content_index=0, part=part)
            )
        else:
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            out.append(
                self.seq.event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
            out.append(
                self.seq.event("response.content_part.done", **where, content_index=0, part=part)
            )
        item["status"] = status
        self.items.append(item)
        out.append(
            self.seq.event(
                "response.output_item.done", output_index=where["output_index"], item=item
            )
        )
        return out

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items)}
