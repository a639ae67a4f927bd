"""What every route needs to serve the model: the engine, tokenizer, names and limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from engine.async_engine import AsyncEngine
from engine.pooling_config import ModelPooling
from engine.request import LoRARequest
from server.chat_template import ChatTemplate
from server.errors import APIError
from server.request_cpu import RequestCpu
from server.responses.state import ResponsesState
from server.settings import ServerSettings
from server.unknown_fields import IgnoredFields

if TYPE_CHECKING:
    from engine.lora.catalog import LoRACatalog
    from server.metrics import RequestRecord, ServerMetrics


class AdapterUse:
    """The sequences each LoRA adapter (by id) has in runs the server submitted and has not
    seen end. Event-loop only. An unload reads it together with the engine's live
    requests: a run submitted after the engine answered that count is still seen here,
    and both the read and the submission happen between two awaits."""

    def __init__(self) -> None:
        self._sequences: dict[int, int] = {}

    def acquire(self, adapter_id: int, sequences: int) -> None:
        self._sequences[adapter_id] = self._sequences.get(adapter_id, 0) + sequences

    def release(self, adapter_id: int, sequences: int) -> None:
        left = self._sequences.get(adapter_id, 0) - sequences
        if left > 0:
            self._sequences[adapter_id] = left
        else:
            self._sequences.pop(adapter_id, None)

    def count(self, adapter_id: int) -> int:
        return self._sequences.get(adapter_id, 0)

    def busy(self) -> tuple[int, ...]:
        """The ids of the adapters some submitted run still holds."""
        return tuple(self._sequences)


@dataclass(frozen=True)
class ServingContext:
    """Immutable per-app state; the routes read it from ``app.state.ctx``."""

    engine: AsyncEngine
    tokenizer: Any  # a Hugging Face tokenizer (decode, encode, apply_chat_template)
    served_model_names: tuple[str, ...]
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    settings: ServerSettings
    metrics: ServerMetrics | None = None
    created: int = 0  # unix time the model was loaded, for /v1/models
    # engine.structured.GrammarCompiler: compile structured-output specs off the event
    # loop (asyncio.to_thread) before submitting; None when the engine has none.
    grammar_compiler: Any = None
    # The startup log's totals and KV shape, for the block-map page (server/ui/facts.py).
    startup_facts: dict[str, Any] | None = None
    scheduling_policy: str = "fcfs"  # the engine's; under fcfs a priority is refused
    chat_template: ChatTemplate | None = None  # built from settings when None
    # The worker threads of requests' own CPU work (server/request_cpu.py).
    request_cpu: RequestCpu = field(default_factory=RequestCpu)
    # The Responses API's stored and running responses (server/responses/state.py).
    responses: ResponsesState = field(default_factory=ResponsesState)
    # The unknown fields requests carried and the server ignored (server/unknown_fields.py).
    ignored_fields: IgnoredFields = field(default_factory=IgnoredFields)
    # What the model directory says about pooling, and its hidden size (embeddings).
    model_pooling: ModelPooling = field(default_factory=ModelPooling)
    hidden_size: int = 0
    # The classifier head's logits of a *ForSequenceClassification model (it scores with
    # them, server/cross_encoder.py, and generates nothing); 0 for a causal LM.
    num_labels: int = 0
    # The LoRA adapters served by name (engine/lora/catalog.py); None without --enable-lora.
    lora_catalog: LoRACatalog | None = None
    lora_use: AdapterUse = field(default_factory=AdapterUse)

    def template(self) -> ChatTemplate:
        """The chat template the routes render with (--chat-template or the model's)."""
        if self.chat_template is not None:
            return self.chat_template
        settings = self.settings
        return ChatTemplate(
            self.tokenizer, settings.chat_template, settings.chat_template_content_format
        )

    @property
    def model_name(self) -> str:
        """The name reported in responses."""
        return self.served_model_names[0]

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def check_model(self, model: str | None) -> str:
        """The name a response reports for ``model``: the base's (``model`` None or a
        served name) or a loaded LoRA adapter's; 404 for anything else."""
        if model is None or model in self.served_model_names:
            return self.model_name
        if self.lora_for(model) is not None:
            return model
        raise self.model_not_found(model)

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The loaded LoRA adapter named ``model``; None for the base model (and for a name
        nothing serves: ``check_model`` refuses that)."""
        if self.lora_catalog is None or model is None or model in self.served_model_names:
            return None
        return self.lora_catalog.get(model)

    def model_not_found(self, model: str) -> APIError:
        """The 404 for a ``model`` this server does not serve, naming what it does serve."""
        adapters = self.lora_catalog.adapters() if self.lora_catalog is not None else ()
        served = (*self.served_model_names, *(lora.name for lora in adapters))
        return APIError(
            404,
            f"The model `{model}` does not exist. Served: {', '.join(served)}",
            param="model",
            code="model_not_found",
            reason="model_not_found",
        )

    def check_base_model(self, model: str | None, route: str) -> None:
        """404 for a ``model`` nothing serves; 400 for a LoRA adapter on a route that runs
        the base model only (embeddings, scoring: they would silently ignore it)."""
        self.check_model(model)
        if self.lora_for(model) is not None:
            raise APIError(
                400,
                f"`{model}` is a LoRA adapter; {route} runs the base model only: "
                f"set 'model' to `{self.model_name}`",
                param="model",
                code="model_not_supported",
                reason="invalid",
            )

    def check_generates(self) -> None:
        """400 on a generation route when the model is a sequence classifier: it has no
        LM head to sample from (its checkpoint's ``score`` head replaces it)."""
        if self.num_labels:
            raise APIError(
                400,
                "this model is a sequence classifier (a *ForSequenceClassification "
                "checkpoint, no LM head); it serves /v1/score, /v1/rerank and "
                "/v1/embeddings, not generation",
                param="model",
                code="model_not_supported",
                reason="invalid",
            )

    def record(self, record: RequestRecord) -> None:
        if self.metrics is not None:
            self.metrics.observe_request(record)

    def count_rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.count_rejected(reason)


def get_context(request: Request) -> ServingContext:
    """FastAPI dependency: the app's serving context."""
    ctx: ServingContext = request.app.state.ctx
    return ctx


# Route parameter type: ``ctx: Ctx`` injects the serving context.
Ctx = Annotated[ServingContext, Depends(get_context)]
