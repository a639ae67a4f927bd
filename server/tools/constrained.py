"""Forced tool calls (``tool_choice: "required"`` or a named function): the JSON schema
the output is constrained to, and the scanner that turns that output into tool calls.

Output formats (chosen so that the response maps onto ``tool_calls`` with no guessing):

- named function: the output *is* the arguments object, valid against the function's
  ``parameters``; the call's name is the one requested.
- ``required``: ``{"name": <one of the offered names>, "arguments": {...}}`` (anyOf over
  the functions, each ``arguments`` under its own ``parameters``), or, when
  ``parallel_tool_calls`` is true, a non-empty JSON array of such objects.

Each function's schema is moved under ``$defs`` of the combined schema with its own
``$ref``s rewritten, so pydantic-style schemas (``$defs`` + ``#/$defs/...``) still resolve.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from server.tools.events import ContentText, OutputEvent, ToolCallArguments, ToolCallStart
from server.tools.events import new_call_id as _new_call_id
from server.tools.models import FunctionDefinition

_DEF_KEYS = ("$defs", "definitions")


def named_call_schema(function: FunctionDefinition) -> dict[str, Any]:
    return function.parameters_schema


def required_call_schema(functions: Sequence[FunctionDefinition], parallel: bool) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    options = []
    for i, function in enumerate(functions):
        prefix = f"tool{i}"
        defs.update(_hoisted(function.parameters_schema, prefix))
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": function.name},
                    "arguments": {"$ref": f"#/$defs/{prefix}"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    call = options[0] if len(options) == 1 else {"anyOf": options}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1} if parallel else call
    return {**schema, "$defs": defs}


def _hoisted(schema: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The schema (without its own definitions) as ``prefix`` and each of its definitions
    as ``prefix__<name>``, every local ``$ref`` rewritten to match."""
    body = {k: v for k, v in schema.items() if k not in _DEF_KEYS}
    out = {prefix: _rewrite_refs(body, prefix)}
    for key in _DEF_KEYS:
        for name, sub in (schema.get(key) or {}).items():
            out[f"{prefix}__{name}"] = _rewrite_refs(sub, prefix)
    return out


def _rewrite_refs(node: Any, prefix: str) -> Any:
    if isinstance(node, list):
        return [_rewrite_refs(item, prefix) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rewrite_refs(v, prefix) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = _local_ref(ref, prefix)
    return out


def _local_ref(ref: str, prefix: str) -> str:
    for key in _DEF_KEYS:
        head = f"#/{key}/"
        if ref.startswith(head):
            name, _, rest = ref[len(head) :].partition("/")
            return f"#/$defs/{prefix}__{name}" + (f"/{rest}" if rest else "")
    return f"#/$defs/{prefix}" + ref[1:]


class NamedCallOutput:
    """The output is the arguments of the one named call: stream it straight through."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False
        self._pending = ""

    def feed(self, text: str) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        if not self._started:
            text = text.lstrip()
            if not text:
                return events
            self._started = True
            events.append(ToolCallStart(0, _new_call_id(), self._name))
        self._pending += text
        # Whitespace may be the end of the output: keep it until more text follows.
        body = self._pending.rstrip()
        self._pending = self._pending[len(body) :]
        if body:
            events.append(ToolCallArguments(0, body))
        return events

    def finish(self) -> list[OutputEvent]:
        if not self._started:  # nothing but whitespace (or nothing) was generated
            return [ToolCallStart(0, _new_call_id(), self._name)]
        return []


class RequiredCallsOutput:
    """Scans ``{"name", "arguments"}`` objects (or an array of them) as they are
    generated: a call starts once its name is complete, then its arguments stream as
    they arrive. Characters between calls (brackets, commas, whitespace) are dropped;
    text the grammar would not allow (it cannot happen while the grammar holds) is
    content."""

    def __init__(self, parallel: bool) -> None:
        self._call_depth = 2 if parallel else 1
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._phase = "key"  # key, in_key, colon, value_start, value
        self._key_raw = ""
        self._key = ""
        self._value = ""  # raw text of the current value not yet emitted
        self._count = 0
        self._call: _Call | None = None

    def feed(self, text: str) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        for ch in text:
            events += self._char(ch)
        if self._call is not None and self._phase == "value" and self._key == "arguments":
            events += self._call.arguments(self._take_value(final=False))
        return events

    def finish(self) -> list[OutputEvent]:
        """The end of the output. A call cut (max_tokens) before its name was whole is
        dropped rather than reported with an empty name: the choice ends with
        ``length``, never as a call of nothing."""
        events: list[OutputEvent] = []
        if self._call is not None:  # truncated inside a call
            if self._phase == "value" and not (self._key == "name" and not self._whole_name()):
                events += self._end_value()
            if self._call.started:
                events += self._call.close()
            self._call = None
        return events

    def _whole_name(self) -> bool:
        """Whether the name value read so far is a complete, non-empty JSON string."""
        try:
            name = json.loads(self._value.strip())
        except ValueError:
            return False
        return isinstance(name, str) and bool(name)

    # ------------------------------------------------------------------ scanning
    def _char(self, ch: str) -> list[OutputEvent]:
        if self._in_string:
            self._string_char(ch)
            return []
        if self._depth < self._call_depth:
            return self._between_calls(ch)
        if self._depth > self._call_depth:
            self._value_char(ch)
            return []
        return self._call_level(ch)

    def _string_char(self, ch: str) -> None:
        if self._phase == "in_key":
            self._key_raw += ch
        else:
            self._value += ch
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._in_string = False
            if self._phase == "in_key":
                self._key = json.loads(self._key_raw)
                self._phase = "colon"

    def _between_calls(self, ch: str) -> list[OutputEvent]:
        if ch in "{[":
            self._depth += 1
            if self._depth == self._call_depth:
                if ch == "[":
                    return [ContentText(ch)]
                self._call = _Call(self._count)
                self._count += 1
                self._phase = "key"
        elif ch in "]}":
            self._depth -= 1
        elif not ch.isspace() and ch != ",":
            return [ContentText(ch)]
        return []

    def _call_level(self, ch: str) -> list[OutputEvent]:
        if self._phase == "value":
            if ch in ",}":
                events = self._end_value()
                if ch == "}":
                    events += self._close_call()
                return events
            self._value_char(ch)
            return []
        if ch.isspace():
            return []
        if self._phase == "key":
            if ch == '"':
                self._phase, self._key_raw, self._in_string = "in_key", '"', True
            elif ch == "}":
                return self._close_call()
        elif self._phase == "colon":
            if ch == ":":
                self._phase = "value_start"
        elif self._phase == "value_start":
            self._phase, self._value = "value", ""
            self._value_char(ch)
        return []

    def _value_char(self, ch: str) -> None:
        self._value += ch
        if ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
        elif ch == '"':
            self._in_string = True

    def _end_value(self) -> list[OutputEvent]:
        self._phase = "key"
        assert self._call is not None
        if self._key == "name":
            try:
                name = json.loads(self._take_value(final=True))
            except ValueError:
                name = None
            return self._call.named(name if isinstance(name, str) else "")
        if self._key == "arguments":
            return self._call.arguments(self._take_value(final=True))
        self._value = ""
        return []

    def _take_value(self, *, final: bool) -> str:
        """The value's raw text so far, less trailing whitespace unless it ended."""
        text = self._value.rstrip()
        self._value = "" if final else self._value[len(text) :]
        return text

    def _close_call(self) -> list[OutputEvent]:
        self._depth -= 1
        events = self._call.close() if self._call is not None else []
        self._call = None
        return events


class _Call:
    """One call being scanned: arguments wait until the name is known."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.started = False
        self.pending = ""

    def named(self, name: str) -> list[OutputEvent]:
        if self.started:
            return []
        self.started = True
        events: list[OutputEvent] = [ToolCallStart(self.index, _new_call_id(), name)]
        if self.pending:
            events.append(ToolCallArguments(self.index, self.pending))
            self.pending = ""
        return events

    def arguments(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        if not self.started:
            self.pending += text
            return []
        return [ToolCallArguments(self.index, text)]

    def close(self) -> list[OutputEvent]:
        return self.named("") if not self.started else []
