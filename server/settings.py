"""Server-side settings (the HTTP layer's half of the CLI; the engine's half is EngineArgs)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import POOLING_KINDS
from server.reasoning import REASONING_PARSERS, ReasoningFormat
from server.tools.parsers import TOOL_CALL_PARSERS
from server.unknown_fields import UNKNOWN_FIELD_POLICIES

# Causal rerankers whose prompt format /v1/score and /v1/rerank know (server/scoring.py,
# RERANKER_FORMATS; kept here so the settings need not import the scoring module).
RERANKERS: tuple[str, ...] = ("qwen3",)
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# A request's headers must be complete this many seconds after its first byte (on a new
# connection: after the connection opened), its body this many seconds after the headers.
DEFAULT_REQUEST_HEADER_TIMEOUT_S = 10.0
DEFAULT_REQUEST_BODY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ServerSettings:
    """How the HTTP front end behaves.

    ``served_model_names`` are the ids clients may put in ``model`` (the first is the one
    reported in responses); empty means "use the model's own name". ``api_key`` None
    disables auth. ``protect_open_endpoints`` puts /health, /version and /metrics behind
    the key as well.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    protect_open_endpoints: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # 408 / connection closed past these (server/http_server.py, server/body_reader.py);
    # 0 = no bound.
    request_header_timeout_s: float = DEFAULT_REQUEST_HEADER_TIMEOUT_S
    request_body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S
    shutdown_timeout_s: float = 30.0
    retry_after_s: int = 1
    max_n: int = 16
    # A request not scheduled within this many seconds is answered 503 (0 = wait forever).
    queue_timeout_s: float = 0.0
    max_messages: int = 512
    # --unknown-fields: a body's unknown top-level keys ignored or refused
    # (server/unknown_fields.py).
    unknown_fields: str = "ignore"
    log_level: str = "info"
    # The live block-map page at /ui (server/ui/); --disable-ui turns it off.
    enable_ui: bool = True
    # tool_choice "auto": parse tool calls out of free output (vLLM's flags of these names).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # --reasoning-parser: split <think> output into reasoning (server/reasoning.py).
    reasoning_parser: str | None = None
    # The Responses API's store of responses (server/responses/store.py): its bounds.
    responses_store_size: int = 1024
    responses_store_bytes: int = 64 * 1024 * 1024
    # --chat-template (its text, already read from a file) and how content reaches it.
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    # CORS (server/cors.py): off while allowed_origins is empty.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # Embeddings (server/embeddings.py): --pooling overrides the model's own pooling;
    # --reranker names a causal reranker's prompt format for /v1/score and /v1/rerank.
    pooling: str | None = None
    reranker: str | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist (server/routes/lora.py):
    # --allow-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING, as in vLLM.
    allow_runtime_lora_updating: bool = False

    @property
    def reasoning(self) -> ReasoningFormat | None:
        """The reasoning format --reasoning-parser names, or None."""
        return None if self.reasoning_parser is None else REASONING_PARSERS[self.reasoning_parser]

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in [0, 65535]")
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes must be >= 1")
        if self.request_header_timeout_s < 0 or self.request_body_timeout_s < 0:
            raise ValueError("request header and body timeouts must be >= 0 (0 = no bound)")
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must be >= 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (use None to disable auth)")
        if self.max_n < 1:
            raise ValueError("max_n must be >= 1")
        if self.queue_timeout_s < 0:
            raise ValueError("queue_timeout_s must be >= 0")
        if self.max_messages < 1:
            raise ValueError("max_messages must be >= 1")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.responses_store_size < 0 or self.responses_store_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0 (0: store nothing)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")
        if self.unknown_fields not in UNKNOWN_FIELD_POLICIES:
            raise ValueError(f"unknown_fields must be one of {', '.join(UNKNOWN_FIELD_POLICIES)}")
        if self.pooling is not None and self.pooling not in POOLING_KINDS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_KINDS)}")
        if self.reranker is not None and self.reranker not in RERANKERS:
            raise ValueError(f"reranker must be one of {', '.join(RERANKERS)}")
        if self.chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError("chat_template_content_format must be auto, string or openai")
