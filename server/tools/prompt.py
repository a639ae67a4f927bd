"""Tools and tool history in the prompt.

When the tokenizer's chat template knows about tools (its source mentions ``tools``), the
tools go to ``apply_chat_template(tools=...)`` and the history keeps OpenAI's shape
(assistant ``tool_calls`` with arguments decoded to objects, ``role: "tool"`` messages),
which is what tool-aware templates (Qwen, Hermes, Llama 3.1, SmolLM3) expect.

Otherwise (the embedded SmolLM2, for one) kvserve uses a generic format, documented in
docs/reference/tools.md:
- the tools are described in the system message: their OpenAI JSON between ``<tools>``
  tags, with the instruction to call one as ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` (the hermes convention, which ``--tool-call-parser hermes`` reads);
- an assistant message's tool calls are rendered in that same form after its text;
- tool results become a user turn of ``<tool_response>{"name", "content"}</tool_response>``
  blocks (consecutive results share one turn, so templates that insist on alternating
  roles accept it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from server.errors import invalid
from server.tools.models import ToolDefinition

_TOOLS_WORD = re.compile(r"\btools\b")

TOOL_SYSTEM_PROMPT = (
    "You can call functions to help answer the user. The functions are described as JSON "
    "between <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and its arguments "
    "between <tool_call></tool_call> tags, one tag per call:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n'
    "</tool_call>\n"
    "The results come back between <tool_response></tool_response> tags. If no function "
    "fits, answer in plain text."
)


def template_supports_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: a "tool_use" one, or any mention
        return "tool_use" in template or any(
            _TOOLS_WORD.search(t) for t in template.values() if isinstance(t, str)
        )
    return isinstance(template, str) and source_supports_tools(template)


def source_supports_tools(source: str) -> bool:
    """Whether a template's Jinja source reads a ``tools`` variable."""
    return bool(_TOOLS_WORD.search(source))


def build_conversation(
    messages: Sequence[Any], tools: Sequence[ToolDefinition], native: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The template's messages and extra ``apply_chat_template`` arguments."""
    _check_tool_results(messages)
    if native:
        kwargs = {"tools": [_tool_json(t) for t in tools]} if tools else {}
        return [_native_message(m) for m in messages], kwargs
    return _generic_conversation(messages, tools), {}


def _tool_json(tool: ToolDefinition) -> dict[str, Any]:
    return {"type": "function", "function": tool.function.as_openai()}


def _named(message: Any, entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with the message's ``name`` (multi-agent conversations), when it has one."""
    name = getattr(message, "name", None)
    return entry if name is None else {**entry, "name": name}


def _with_reasoning(message: Any, entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with the message's earlier reasoning under the names templates read it
    by (``reasoning_content``: Qwen3, DeepSeek-R1; ``thinking``: gpt-oss)."""
    thinking = getattr(message, "thinking", None)
    if thinking is None:
        return entry
    return {**entry, "reasoning_content": thinking, "thinking": thinking}


def _native_message(message: Any) -> dict[str, Any]:
    out = _with_reasoning(message, _named(message, {"role": message.role, "content": message.text}))
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": call.function.arguments_object(),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _generic_conversation(
    messages: Sequence[Any], tools: Sequence[ToolDefinition]
) -> list[dict[str, Any]]:
    names = _call_names(messages)
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool":
            block = _tool_response(names.get(message.tool_call_id or "", ""), message.text)
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif message.tool_calls:
            calls = [
                _tool_call_text(c.function.name, c.function.arguments_object())
                for c in message.tool_calls
            ]
            text = "\n".join(([message.text] if message.text else []) + calls)
            out.append(_with_reasoning(message, {"role": "assistant", "content": text}))
        else:
            entry = _named(message, {"role": message.role, "content": message.text})
            out.append(_with_reasoning(message, entry))
    for entry in out:
        entry.pop("_tool_results", None)
    if tools:
        _add_tool_system_prompt(out, tools)
    return out


def _add_tool_system_prompt(conversation: list[dict[str, Any]], tools: Sequence[ToolDefinition]):
    listing = "\n".join(json.dumps(_tool_json(t), ensure_ascii=False) for t in tools)
    prompt = TOOL_SYSTEM_PROMPT.format(tools=listing)
    if conversation and conversation[0]["role"] == "system":
        conversation[0]["content"] = f"{conversation[0]['content']}\n\n{prompt}"
    else:
        conversation.insert(0, {"role": "system", "content": prompt})


def _tool_call_text(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _tool_response(name: str, content: str) -> str:
    body = json.dumps({"name": name, "content": content}, ensure_ascii=False)
    return f"<tool_response>\n{body}\n</tool_response>"


def _call_names(messages: Sequence[Any]) -> dict[str, str]:
    return {
        call.id: call.function.name for message in messages for call in (message.tool_calls or ())
    }


def _check_tool_results(messages: Sequence[Any]) -> None:
    """OpenAI's rule: a tool message answers a tool call made earlier in the history."""
    seen: set[str] = set()
    for i, message in enumerate(messages):
        for call in message.tool_calls or ():
            seen.add(call.id)
        if message.role == "tool" and message.tool_call_id not in seen:
            raise invalid(
                f"messages[{i}] has role 'tool' but its tool_call_id "
                f"'{message.tool_call_id}' answers no tool call of an earlier assistant message",
                f"messages.{i}.tool_call_id",
            )
