"""OpenAI-compatible request models (pydantic 2), validated strictly.

Rules: wrong types are errors (no "5" -> 5 coercion), unknown fields are errors, and
fields we know but do not implement get a 400 that names them. The only fields accepted
without effect on the output are ``user`` (an end-user label for abuse tracking),
``stream_options`` when there is no usage to report, ``response_format`` of type
``text`` and ``best_of`` equal to ``n``; explicit ``null`` values mean "the default".
Structured outputs (``response_format``, vLLM's ``structured_outputs`` and ``guided_*``)
are mapped in server/structured.py; tools in server/tools/.

Also accepted without effect: ``metadata``, ``store``, ``service_tier``,
``prompt_cache_key`` and ``safety_identifier`` (labels for OpenAI's platform).
docs/reference/api.md classifies every OpenAI and vLLM field.

Beyond OpenAI, the vLLM sampling extensions are honoured: ``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``priority``
(lower is more important) and ``stream_options.continuous_usage_stats``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from server.structured import ResponseFormat, StructuredOutputsParams
from server.tools.models import ToolCallMessage, ToolChoice, ToolDefinition

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16

# Known OpenAI and vLLM fields kvserve does not implement: a request using them is refused
# with a message naming the field instead of being answered as if they were honoured
# (under --unknown-fields ignore too: server/unknown_fields.py only drops what it does not
# know).
UNSUPPORTED_VLLM_FIELDS = (
    "use_beam_search",
    "length_penalty",
    "truncate_prompt_tokens",
    "allowed_token_ids",
    "bad_words",
    "logits_processors",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "prompt_embeds",
    "kv_transfer_params",
    "vllm_xargs",
    "request_id",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structural_tag",
)
UNSUPPORTED_CHAT_FIELDS = (
    # The legacy function-calling API (superseded by ``tools``/``tool_choice``).
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "verbosity",
    "logit_processors",
    "chat_template",
    "documents",
    "mm_processor_kwargs",
    "media_io_kwargs",
    *UNSUPPORTED_VLLM_FIELDS,
)
UNSUPPORTED_COMPLETION_FIELDS = ("suffix", *UNSUPPORTED_VLLM_FIELDS)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _reject_unsupported(data: Any, fields: tuple[str, ...]) -> None:
    if not isinstance(data, dict):
        return
    for name in fields:
        if name in data and data[name] is not None:
            raise ValueError(f"'{name}' is not supported by this server")


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(StrictModel):
    """Fields shared by chat and text completions.

    As in OpenAI's API, an explicit ``null`` means "use the default": such keys are
    dropped before validation (a required field sent as null is then reported missing).
    """

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=2**31)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    # Output constraints, at most one per request (server/structured.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's per-request prefix-cache salt: only requests with the same salt share blocks.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # Accepted without effect (docs/reference/api.md): labels and routing hints for OpenAI's
    # platform that change nothing in the output.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's output controls (server/detokenize.py).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_common(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' is only allowed when 'stream' is true")
        for text in self.stop_strings:
            if not text:
                raise ValueError("'stop' strings must not be empty")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(f"'stop' accepts at most {MAX_STOP_STRINGS} strings")
        for value in (self.logit_bias or {}).values():
            if not -100.0 <= value <= 100.0:
                raise ValueError("'logit_bias' values must be in [-100, 100]")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: None (off) or alternatives per prompt token."""
        return self.prompt_logprobs


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCallMessage] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this result answers
    # Null (or absent) only for an assistant message that calls tools.
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None  # passed to the template (multi-agent conversations)
    # An assistant turn's earlier reasoning, sent back by agent frameworks (vLLM's
    # ``reasoning``, and the older ``reasoning_content``): rendered through the template.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, content: Any, info: ValidationInfo) -> Any:
        calls_tools = info.data.get("role") == "assistant" and info.data.get("tool_calls")
        if content is None and not calls_tools:
            raise ValueError("required (it may be null only with 'tool_calls')")
        return content

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry 'tool_calls'")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a message has 'tool_call_id' exactly when its role is 'tool'")
        if self.thinking is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry 'reasoning'")
        if None not in (self.reasoning, self.reasoning_content) and (
            self.reasoning != self.reasoning_content
        ):
            raise ValueError("give 'reasoning' or 'reasoning_content', not two different ones")
        return self

    @property
    def thinking(self) -> str | None:
        """The reasoning sent with this (assistant) message, under either name."""
        return self.reasoning if self.reasoning is not None else self.reasoning_content

    @property
    def text(self) -> str:
        """The message's text; content parts are joined with newlines."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    # Known to kvserve, refused by name (server/unknown_fields.py never drops them).
    refused_fields: ClassVar[tuple[str, ...]] = UNSUPPORTED_CHAT_FIELDS

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Tool calling (server/tools/plan.py).
    tools: list[ToolDefinition] | None = Field(None, min_length=1)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # Chat template controls (vLLM; server/chat_template.py). ``reasoning_effort`` reaches
    # the template as a variable of that name (gpt-oss's template reads it).
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    echo: bool = False
    # OpenAI's cache-routing and abuse-tracking labels: accepted without effect.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        _reject_unsupported(data, UNSUPPORTED_CHAT_FIELDS)
        return data

    @model_validator(mode="after")
    def _check_template_controls(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "'continue_final_message' needs 'add_generation_prompt': false (the reply "
                "continues the final message instead of opening a new turn)"
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("'continue_final_message' needs a final message of role 'assistant'")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("'prompt_logprobs' is not supported with 'stream' on chat")
        return self

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("'top_logprobs' requires 'logprobs' to be true")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("give 'max_tokens' or 'max_completion_tokens', not both")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (off) or how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


def _prompt_form(value: Any) -> str:
    """Which form of ``prompt`` the value is, told by its first element: a long list
    validated against one form instead of all four costs ~15x less (500,000 token ids:
    ~25 ms instead of ~400, every one of them holding the GIL)."""
    if not isinstance(value, list):
        return "text"
    first = value[0] if value else 0
    if isinstance(first, str):
        return "texts"
    return "id_lists" if isinstance(first, list) else "ids"


PromptInput = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts")]
    | Annotated[list[int], Tag("ids")]
    | Annotated[list[list[int]], Tag("id_lists")],
    Discriminator(_prompt_form),
]


class CompletionRequest(SamplingFields):
    refused_fields: ClassVar[tuple[str, ...]] = UNSUPPORTED_COMPLETION_FIELDS

    prompt: PromptInput
    # 0 (with n == 1) scores the prompt without generating: echo and logprobs, or
    # prompt_logprobs, then say what the model thinks of it.
    max_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        _reject_unsupported(data, UNSUPPORTED_COMPLETION_FIELDS)
        return data

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("'best_of' other than 'n' is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("'prompt' must not be an empty list")
        if self.max_tokens == 0 and self.n != 1:
            raise ValueError("'max_tokens' 0 (scoring the prompt) needs 'n' 1")
        return self

    @property
    def requested_max_tokens(self) -> int:
        """OpenAI's and vLLM's default is 16 tokens (capped by the context)."""
        return DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: echo with logprobs scores the echoed prompt."""
        if self.prompt_logprobs is not None:
            return (
                max(self.prompt_logprobs, self.logprobs or 0) if self.echo else self.prompt_logprobs
            )
        return self.logprobs if self.echo and self.logprobs is not None else None


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: either a raw ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # With ``messages``: the functions a chat request would offer, rendered as it renders
    # them (through the template when it takes tools), so a client can count a tool prompt.
    tools: list[ToolDefinition] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        if self.tools is not None and self.messages is None:
            raise ValueError("'tools' go with 'messages', not with a raw 'prompt'")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
