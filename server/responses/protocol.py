"""Request models of ``POST /v1/responses``, as OpenAI documents them.

What kvserve runs: ``input`` as text or items (messages with ``input_text`` /
``output_text`` parts, ``function_call`` and ``function_call_output``, ``reasoning``
items sent back), ``instructions``, function ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (text, json_object, json_schema), sampling
fields, ``stop`` (vLLM's extension), ``reasoning.effort`` (to the chat template),
``store``, ``previous_response_id``, ``background``, ``stream``. Labels that change
nothing in the output are accepted without effect (``metadata``, ``user``,
``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``include``,
``truncation: "disabled"``, ``reasoning.summary``, ``text.verbosity``). Anything else a
client may send that would change the answer -- other tool types, image or file inputs,
``conversation``, ``prompt`` templates, ``top_logprobs`` -- is a 400 naming it: unknown
item and part types are refused, never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from server.protocol import INT64_MAX

# Fields of OpenAI's request that kvserve does not run: refused by name.
UNSUPPORTED_FIELDS = (
    "conversation",
    "prompt",
    "max_tool_calls",
    "context_management",
    "moderation",
    "background_options",
    "prompt_cache_options",
    "top_logprobs",
)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class ReasoningPart(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


ContentPart = Annotated[InputText | OutputText, Discriminator("type")]


class MessageItem(StrictModel):
    """A message: ``type`` may be left out (OpenAI's "easy input message")."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    namespace: str | None = None  # the function of a namespace tool
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningItem(StrictModel):
    """Reasoning an earlier response returned, sent back with the history."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(part.text for part in parts)


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text")


def check_known_types(items: Any) -> None:
    """An item or content part type kvserve does not run is named, not lost in a union's
    errors (images, files, other tools' calls)."""
    for item in items if isinstance(items, list) else ():
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in ITEM_TYPES:
            raise ValueError(
                f"input items of type {kind!r} are not supported by this server "
                f"(it takes {', '.join(ITEM_TYPES)})"
            )
        content = item.get("content")
        for part in content if kind == "message" and isinstance(content, list) else ():
            part_kind = part.get("type") if isinstance(part, dict) else None
            if part_kind not in PART_TYPES:
                raise ValueError(
                    f"content parts of type {part_kind!r} are not supported by this server "
                    f"(it takes {', '.join(PART_TYPES)})"
                )


def _item_kind(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # Accepted without effect: who may call it, deferred loading, the output's schema.
    allowed_callers: list[str] | None = None
    async_: bool | None = Field(None, alias="async")
    defer_loading: bool | None = None
    output_schema: dict[str, Any] | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class NamespaceTool(StrictModel):
    """A named group of functions (Codex sends its agent tools so). Each function reaches
    the model as ``<namespace>__<name>``; its calls come back with ``namespace`` set."""

    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=30)
    description: str | None = None
    tools: list[FunctionTool] = Field(min_length=1)


Tool = Annotated[FunctionTool | NamespaceTool, Discriminator("type")]
NAMESPACE_SEPARATOR = "__"


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


TextFormat = Annotated[
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Discriminator("type")
]


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted without effect


class ReasoningConfig(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted without effect
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # accepted without effect


class ResponsesRequest(StrictModel):
    """``POST /v1/responses``. As in OpenAI's API, an explicit null means the default."""

    refused_fields: ClassVar[tuple[str, ...]] = UNSUPPORTED_FIELDS

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None  # checked as chat checks it (translate.py)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    # Accepted without effect: labels for OpenAI's platform.
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    client_metadata: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _defaults_and_refusals(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in UNSUPPORTED_FIELDS:
            if data.get(name) is not None:
                raise ValueError(f"'{name}' is not supported by this server")
        check_known_types(data.get("input"))
        for i, tool in enumerate(data.get("tools") or ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in ("function", "namespace"):
                raise ValueError(
                    f"tools.{i}: tools of type {kind!r} are not supported "
                    "(only 'function' and 'namespace' of functions)"
                )
        return {key: value for key, value in data.items() if value is not None}

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if isinstance(self.input, list) and not self.input:
            raise ValueError("'input' must not be an empty list")
        if self.tool_choice is not None and not self.tools:
            raise ValueError("'tool_choice' is only allowed when 'tools' are given")
        if self.background and not self.store:
            raise ValueError("'background' needs 'store': true (its result is fetched later)")
        return self

    def functions(self) -> list[tuple[str | None, FunctionTool]]:
        """Every function offered, with its namespace (None for a plain function tool)."""
        out: list[tuple[str | None, FunctionTool]] = []
        for tool in self.tools or ():
            if isinstance(tool, NamespaceTool):
                out += [(tool.name, function) for function in tool.tools]
            else:
                out.append((None, tool))
        return out


def flat_name(namespace: str | None, name: str) -> str:
    """The name a (namespaced) function has in the chat request the model sees."""
    return name if namespace is None else f"{namespace}{NAMESPACE_SEPARATOR}{name}"
