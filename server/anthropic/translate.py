"""A Messages request as the chat request the one generation path runs.

- ``system`` -> a system message (text blocks joined with newlines);
- a user message's ``tool_result`` blocks -> ``role: tool`` messages, in order, then its
  text blocks -> one user message;
- an assistant message's text -> content, ``tool_use`` -> ``tool_calls`` (the input as
  JSON arguments), ``thinking`` -> ``reasoning``;
- ``tool_choice``: ``auto`` -> auto, ``any`` -> required, ``tool`` -> that function,
  ``none`` -> none; ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``;
- ``thinking`` -> the template's ``enable_thinking`` (``disabled``: false, else true);
- ``output_config.format`` -> a JSON-schema ``response_format``; ``output_config.effort``
  -> ``reasoning_effort`` (``xhigh`` and ``max`` as ``high``, the highest chat knows);
- ``stop_sequences`` -> ``stop``; ``top_k`` as vLLM's.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from server.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from server.errors import describe_validation_errors, invalid
from server.protocol import ChatCompletionRequest


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.system_text
    if system:
        out.append({"role": "system", "content": system})
    for message in body.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "system":
            out.append({"role": "system", "content": "\n".join(b.text for b in message.content)})
        elif message.role == "user":
            out += _user_turn(message.content)
        else:
            out.append(_assistant_turn(message.content))
    return out


def _user_turn(blocks: list[Any]) -> list[dict[str, Any]]:
    results = [
        {"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)}
        for block in blocks
        if isinstance(block, ToolResultBlock)
    ]
    texts = [block.text for block in blocks if isinstance(block, TextBlock)]
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _result_text(block: ToolResultBlock) -> str:
    return f"Error: {block.text}" if block.is_error else block.text


def _assistant_turn(blocks: list[Any]) -> dict[str, Any]:
    text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
    calls = [
        {
            "id": block.id,
            "type": "function",
            "function": {"name": block.name, "arguments": json.dumps(block.input)},
        }
        for block in blocks
        if isinstance(block, ToolUseBlock)
    ]
    thinking = "".join(block.thinking for block in blocks if isinstance(block, ThinkingBlock))
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning"] = thinking
    return message


def chat_request(body: CountTokensRequest, stream: bool = False) -> ChatCompletionRequest:
    """The chat request of ``body`` (a count_tokens body renders the same prompt)."""
    fields: dict[str, Any] = {"messages": chat_messages(body), "stream": stream}
    if isinstance(body, MessagesRequest):
        fields |= {"max_tokens": body.max_tokens, "temperature": body.temperature}
        optional = {"stop": body.stop_sequences or None, "top_p": body.top_p, "top_k": body.top_k}
        fields |= {key: value for key, value in optional.items() if value is not None}
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    **({"description": tool.description} if tool.description else {}),
                    "parameters": tool.input_schema,
                },
            }
            for tool in body.tools
        ]
        fields |= _tool_choice(body)
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    config = body.output_config
    if config is not None and config.format is not None:
        spec = {"name": "output", "schema": config.format.schema_}
        fields["response_format"] = {"type": "json_schema", "json_schema": spec}
    if config is not None and config.effort is not None:
        effort = {"xhigh": "high", "max": "high"}.get(config.effort, config.effort)
        fields["reasoning_effort"] = effort
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors(include_url=False))
        raise invalid(message, param) from None


def _tool_choice(body: CountTokensRequest) -> dict[str, Any]:
    choice = body.tool_choice
    if choice is None:
        return {}
    fields: dict[str, Any] = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type == "tool":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields
