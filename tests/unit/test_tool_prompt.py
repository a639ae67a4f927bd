"""How tools and tool history reach the prompt: the generic format for templates without
tool support (the embedded SmolLM2), and ``tools=`` for templates that handle them."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any

import pytest

from server.errors import APIError
from server.protocol import ChatMessage
from server.tools.models import ToolDefinition
from server.tools.prompt import build_conversation, template_supports_tools

TOOL = ToolDefinition.model_validate(
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
)
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Add 2."},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "2"},
    {"role": "tool", "tool_call_id": "call_1", "content": "again 2"},
]


def messages(raw: list[dict[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def test_generic_format_describes_tools_and_renders_history():
    conversation, kwargs = build_conversation(messages(HISTORY), [TOOL], native=False)
    assert kwargs == {}
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user"]
    system = conversation[0]["content"]
    assert system.startswith("Be brief.\n\n") and "<tools>" in system
    assert json.dumps(TOOL.function.as_openai()) in system
    call = conversation[2]["content"]
    assert call == '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    results = conversation[3]["content"]  # both results in one user turn
    assert results.count("<tool_response>") == 2 and '"name": "add"' in results


def test_generic_format_without_tools_keeps_history_only():
    conversation, _ = build_conversation(messages(HISTORY), [], native=False)
    assert conversation[0] == {"role": "system", "content": "Be brief."}


def test_native_format_passes_tools_and_openai_shaped_history(smollm_tokenizer: Any):
    conversation, kwargs = build_conversation(messages(HISTORY), [TOOL], native=True)
    assert kwargs["tools"] == [{"type": "function", "function": TOOL.function.as_openai()}]
    assert conversation[2]["tool_calls"][0]["function"]["arguments"] == {"a": 2}
    assert conversation[3] == {"role": "tool", "content": "2", "tool_call_id": "call_1"}
    tokenizer = copy.deepcopy(smollm_tokenizer)
    tokenizer.chat_template = (
        "{% for t in tools or [] %}TOOL:{{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% endfor %}"
    )
    assert template_supports_tools(tokenizer)
    text = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert text.startswith("TOOL:add\n") and "tool:2\n" in text


def test_template_support_detection(smollm_tokenizer: Any):
    assert not template_supports_tools(smollm_tokenizer)  # the embedded model's template
    assert template_supports_tools(SimpleNamespace(chat_template={"tool_use": "x"}))
    assert not template_supports_tools(SimpleNamespace(chat_template=None))


def test_tool_result_must_answer_an_earlier_call():
    bad = [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x", "content": "1"}]
    with pytest.raises(APIError) as info:
        build_conversation(messages(bad), [], native=False)
    assert info.value.param == "messages.1.tool_call_id"
