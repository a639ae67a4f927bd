"""Parsers that find tool calls in free model output (``tool_choice: auto``), selected
with ``--tool-call-parser`` as in vLLM.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the convention
  of Hermes, Qwen and SmolLM3 (and of kvserve's generic tool prompt). A tag may also hold
  a JSON list of such objects (SmolLM2's training format). Text outside the tags is the
  message content.
- ``llama3_json``: the whole output is one or more JSON objects ``{"name": ...,
  "parameters"|"arguments": {...}}``, optionally after ``<|python_tag|>``, separated by
  ``;``. Anything else is plain content.

Each parser is incremental: ``feed`` takes the next piece of text and returns the events
that are certain, ``finish`` the rest. Text that may still become a call is held back, so
streaming never sends a call's JSON as content. A call is emitted whole (name, then its
arguments in one piece) once its JSON is complete; a would-be call whose JSON does not
parse, or that names a function not offered, is content. With ``max_calls`` (1 when
``parallel_tool_calls`` is false) further calls are dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Protocol

from server.tools.events import ContentText, OutputEvent, ToolCallArguments, ToolCallStart
from server.tools.events import new_call_id as _new_call_id

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


class ToolCallParser(Protocol):
    def feed(self, text: str) -> list[OutputEvent]: ...

    def finish(self) -> list[OutputEvent]: ...


def make_parser(name: str, function_names: Iterable[str], max_calls: int | None) -> ToolCallParser:
    calls = _CallEmitter(frozenset(function_names), max_calls)
    if name == "hermes":
        return HermesParser(calls)
    if name == "llama3_json":
        return Llama3JsonParser(calls)
    raise ValueError(f"unknown tool call parser {name!r}; choose from {TOOL_CALL_PARSERS}")


class _CallEmitter:
    """Turns decoded call objects into events: checks the name, numbers the calls."""

    def __init__(self, function_names: frozenset[str], max_calls: int | None) -> None:
        self.function_names = function_names
        self.max_calls = max_calls
        self.count = 0

    def calls_from(self, decoded: Any) -> list[tuple[str, str]] | None:
        """(name, arguments JSON) for an object or a list of objects, or None when the
        value is not a valid call (the caller then treats the text as content)."""
        items = decoded if isinstance(decoded, list) else [decoded]
        calls = [_as_call(item, self.function_names) for item in items]
        if any(call is None for call in calls):
            return None
        return [call for call in calls if call is not None]

    def events(self, calls: list[tuple[str, str]]) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for name, arguments in calls:
            if self.max_calls is not None and self.count >= self.max_calls:
                break
            out.append(ToolCallStart(self.count, _new_call_id(), name))
            out.append(ToolCallArguments(self.count, arguments))
            self.count += 1
        return out


def _as_call(item: Any, function_names: frozenset[str]) -> tuple[str, str] | None:
    if not isinstance(item, dict):
        return None
    name = item.get("name")
    arguments = item.get("arguments", item.get("parameters", {}))
    if not isinstance(name, str) or name not in function_names:
        return None
    if isinstance(arguments, str):  # some models emit the arguments pre-encoded
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class HermesParser:
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self, calls: _CallEmitter) -> None:
        self._calls = calls
        self._buffer = ""
        self._inside = False

    def feed(self, text: str) -> list[OutputEvent]:
        self._buffer += text
        events: list[OutputEvent] = []
        while True:
            if self._inside:
                end = self._buffer.find(self.CLOSE)
                if end < 0:
                    return events
                events += self._tag(self._buffer[:end], closed=True)
                self._buffer = self._buffer[end + len(self.CLOSE) :]
                self._inside = False
                continue
            start = self._buffer.find(self.OPEN)
            if start < 0:
                keep = _held_prefix(self._buffer, self.OPEN)
                events += _content(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return events
            events += _content(self._buffer[:start])
            self._buffer = self._buffer[start + len(self.OPEN) :]
            self._inside = True

    def finish(self) -> list[OutputEvent]:
        rest, self._buffer = self._buffer, ""
        if self._inside:  # the output ended inside a tag (a stop string, EOS, max_tokens)
            self._inside = False
            return self._tag(rest, closed=False)
        return _content(rest)

    def _tag(self, body: str, *, closed: bool) -> list[OutputEvent]:
        try:
            calls = self._calls.calls_from(json.loads(body))
        except ValueError:
            calls = None
        if calls is None:
            raw = self.OPEN + body + (self.CLOSE if closed else "")
            return _content(raw)
        return self._calls.events(calls)


class Llama3JsonParser:
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, calls: _CallEmitter) -> None:
        self._calls = calls
        self._buffer = ""
        self._plain = False  # decided: the output is not a call, stream it as content

    def feed(self, text: str) -> list[OutputEvent]:
        if self._plain:
            return _content(text)
        self._buffer += text
        head = self._buffer.lstrip()
        if not head or self.PYTHON_TAG.startswith(head):
            return []
        if head.startswith(("{", self.PYTHON_TAG)):
            return []  # a call, perhaps: only the whole output can tell
        self._plain = True
        rest, self._buffer = self._buffer, ""
        return _content(rest)

    def finish(self) -> list[OutputEvent]:
        rest, self._buffer = self._buffer, ""
        if self._plain:
            return []
        calls = self._parse(rest)
        return _content(rest) if calls is None else self._calls.events(calls)

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        body = text.strip()
        body = body.removeprefix(self.PYTHON_TAG).strip()
        decoder = json.JSONDecoder()
        calls: list[tuple[str, str]] = []
        pos = 0
        while pos < len(body):
            try:
                value, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return None
            found = self._calls.calls_from(value)
            if found is None or isinstance(value, list):
                return None
            calls += found
            next_pos = _skip_separator(body, pos)
            if next_pos is None:
                return None
            pos = next_pos
        return calls or None


def _skip_separator(text: str, pos: int) -> int | None:
    """Past whitespace and at most one ';' between two calls; None for anything else."""
    rest = text[pos:]
    stripped = rest.lstrip()
    if stripped.startswith(";"):
        stripped = stripped[1:].lstrip()
        if not stripped:
            return None  # a trailing ';' promises a call that never came
    elif stripped:
        return None
    return len(text) - len(stripped)


def _content(text: str) -> list[OutputEvent]:
    return [ContentText(text)] if text else []
