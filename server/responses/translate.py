"""A Responses request as the chat request the one generation path runs.

The conversation is kept as chat messages (plain dicts in ``ChatMessage``'s shape), which
is also what the response store keeps: ``previous_response_id`` continues from the stored
messages of that response (its input and its output, but not its ``instructions``, as
OpenAI documents), then this request's input is appended. Items map as:

- ``message`` -> a message of the same role (parts joined);
- ``function_call`` items -> ``tool_calls`` of one assistant message (consecutive calls,
  and a preceding assistant text, share it);
- ``function_call_output`` -> a ``role: tool`` message;
- ``reasoning`` -> the ``reasoning`` of the assistant message that follows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from server.errors import describe_validation_errors, invalid
from server.protocol import ChatCompletionRequest
from server.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
    flat_name,
)

Message = dict[str, Any]


def input_messages(body: ResponsesRequest) -> list[Message]:
    """This request's own input as chat messages (no history, no instructions)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    return items_to_messages(body.input)


def items_to_messages(items: Sequence[InputItem]) -> list[Message]:
    messages: list[Message] = []
    reasoning: list[str] = []
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning.append(item.text)
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {
                    "name": flat_name(item.namespace, item.name),
                    "arguments": item.arguments,
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not last.get("_closed"):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(_assistant(None, [call], reasoning))
        elif isinstance(item, FunctionCallOutputItem):
            _close(messages)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        else:
            _close(messages)
            assert isinstance(item, MessageItem)
            if item.role == "assistant":
                messages.append(_assistant(item.text, [], reasoning))
            else:
                messages.append({"role": item.role, "content": item.text})
    _close(messages)
    return messages


def _assistant(text: str | None, calls: list[Any], reasoning: list[str]) -> Message:
    message: Message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning"] = "".join(reasoning)
        reasoning.clear()
    return message


def _close(messages: list[Message]) -> None:
    """No later function call joins the last assistant message."""
    if messages and messages[-1]["role"] == "assistant":
        messages[-1]["_closed"] = True


def chat_request(
    body: ResponsesRequest, conversation: Sequence[Message], stream: bool
) -> ChatCompletionRequest:
    """The chat request for ``conversation`` (history and input) under ``body``'s
    instructions, tools, format and sampling fields."""
    messages = [{k: v for k, v in m.items() if k != "_closed"} for m in conversation]
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    fields: dict[str, Any] = {
        "messages": messages,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "stream": stream,
    }
    if stream:
        fields["stream_options"] = {"include_usage": True}
    optional = {
        "max_tokens": body.max_output_tokens,
        "stop": body.stop,
        "seed": body.seed,
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
        "tools": _tools(body),
        "tool_choice": _tool_choice(body),
        "response_format": _response_format(body),
    }
    fields |= {key: value for key, value in optional.items() if value is not None}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors(include_url=False))
        raise invalid(message, param) from None


def _tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    if not body.tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                key: value
                for key, value in {
                    "name": flat_name(namespace, tool.name),
                    "description": tool.description,
                    "parameters": tool.parameters,
                    "strict": tool.strict,
                }.items()
                if value is not None
            },
        }
        for namespace, tool in body.functions()
    ]


def call_names(body: ResponsesRequest) -> dict[str, tuple[str | None, str]]:
    """The chat name of each offered function -> (its namespace, its own name)."""
    return {flat_name(ns, tool.name): (ns, tool.name) for ns, tool in body.functions()}


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, TextFormatJsonObject):
        return {"type": "json_object"}
    if isinstance(fmt, TextFormatJsonSchema):
        spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        if fmt.description is not None:
            spec["description"] = fmt.description
        return {"type": "json_schema", "json_schema": spec}
    return None
