"""Request models of ``POST /v1/messages`` and ``/v1/messages/count_tokens``, as
Anthropic documents them.

What kvserve runs: ``system`` (text or text blocks), ``messages`` of ``text``,
``tool_use``, ``tool_result`` and ``thinking`` blocks (``redacted_thinking`` is accepted
and dropped: its content is opaque), client ``tools`` with ``input_schema``,
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``; ``disable_parallel_tool_use``),
``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` (still taken
by the API, though the current SDK sends them only as ``extra_body``), ``thinking`` (to
the template's ``enable_thinking``), ``output_config`` (``format`` a JSON schema, through
the constrained decoding; ``effort`` to the template's ``reasoning_effort``),
``stream``. Accepted without effect: ``metadata``, ``service_tier``, ``speed``,
``inference_geo``, ``context_management`` (kvserve clears nothing from the context),
``cache_control`` anywhere (kvserve's prefix cache needs no markers),
``citations``, a tool's ``strict`` (its schema binds a forced call anyway),
``eager_input_streaming`` (inputs always stream), ``defer_loading``, ``input_examples``
and ``allowed_callers``. Refused by name, never ignored: image and document blocks,
server tools, unknown block types and fields.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, model_validator

from server.protocol import INT64_MAX, MAX_STOP_STRINGS

UNSUPPORTED_FIELDS = ("container", "mcp_servers", "diagnostics")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(StrictModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Discriminator("type"),
]


BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class Message(StrictModel):
    """A turn. ``system`` turns mid-conversation (a beta Claude Code uses) are text."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        """A block type kvserve does not run is named, not lost in a union's errors."""
        content = data.get("content") if isinstance(data, dict) else None
        for block in content if isinstance(content, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCK_TYPES:
                raise ValueError(
                    f"content blocks of type {kind!r} are not supported by this server "
                    f"(it takes {', '.join(BLOCK_TYPES)})"
                )
        return data

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> Message:
        if isinstance(self.content, str):
            return self
        for block in self.content:
            if self.role == "system" and not isinstance(block, TextBlock):
                raise ValueError(f"'{block.type}' blocks do not belong in a system turn")
            if self.role == "user" and isinstance(block, ToolUseBlock | ThinkingBlock):
                raise ValueError(f"'{block.type}' blocks belong to assistant messages")
            if self.role == "assistant" and isinstance(block, ToolResultBlock):
                raise ValueError("'tool_result' blocks belong to user messages")
        return self


class Tool(StrictModel):
    """A client tool (server tools such as web search have a ``type`` and are refused)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    defer_loading: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[Any] | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("'name' goes with tool_choice type 'tool', and only with it")
        return self


class Thinking(StrictModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class OutputConfig(StrictModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(StrictModel):
    user_id: str | None = None


class CountTokensRequest(StrictModel):
    """``POST /v1/messages/count_tokens``: what the prompt of such a request counts."""

    refused_fields: ClassVar[tuple[str, ...]] = UNSUPPORTED_FIELDS

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    # Anthropic's context editing (clearing old tool results as the context fills):
    # kvserve keeps the whole conversation, so honouring none of it loses nothing.
    context_management: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refusals(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in UNSUPPORTED_FIELDS:
                if data.get(name) is not None:
                    raise ValueError(f"'{name}' is not supported by this server")
            for i, tool in enumerate(data.get("tools") or ()):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if kind not in (None, "custom"):
                    raise ValueError(
                        f"tools.{i}: server tool '{kind}' is not supported (only client tools)"
                    )
        return data

    @property
    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(block.text for block in self.system)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT64_MAX)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: str | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None

    @model_validator(mode="after")
    def _check(self) -> MessagesRequest:
        if any(not stop for stop in self.stop_sequences or ()):
            raise ValueError("'stop_sequences' must not hold empty strings")
        return self


def tool_input_json(block: ToolUseBlock) -> str:
    return json.dumps(block.input, ensure_ascii=False)
