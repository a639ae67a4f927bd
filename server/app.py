"""The FastAPI application: routes, OpenAI-shaped errors, auth and body limits.

``build_app(ctx)`` wires a ready ``ServingContext``; ``serving_context(built, settings)``
makes one from what ``engine.builder.build_engine`` returns. The engine thread starts
with the app's lifespan and is shut down (aborting what still runs) when it ends.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.async_engine import AsyncEngine
from engine.compute_thread import ComputeThread
from engine.pooling_config import ModelPooling
from server.body_reader import BodyReadMiddleware, send_error
from server.chat_template import ChatTemplate
from server.cors import add_cors
from server.cross_encoder import check_classifier_settings
from server.errors import APIError, install_error_handlers
from server.responses.state import ResponsesState
from server.responses.store import ResponseStore
from server.routes import (
    chat,
    completions,
    embeddings,
    health,
    lora,
    messages,
    models,
    render,
    responses,
    scoring,
    tokenize,
)
from server.routes.context import ServingContext
from server.settings import ServerSettings
from server.unknown_fields import IgnoredFields

logger = logging.getLogger(__name__)

# Paths that need the API key when one is configured (unless protect_open_endpoints).
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/ui/api/")
# The block-map page's shell holds no data and must load to ask for the key: it never
# needs one, even under protect_open_endpoints (its data comes from /ui/api/).
UI_SHELL_PATHS = ("/ui", "/ui/")
UI_SHELL_PREFIX = "/ui/static/"


def build_app(ctx: ServingContext) -> FastAPI:
    """The HTTP application around an (unstarted) AsyncEngine."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await ctx.engine.start()
        try:
            yield
        finally:
            # Abort what is left on the loop's thread, then wait for the engine thread
            # without blocking the loop.
            ctx.engine.request_shutdown()
            await asyncio.to_thread(ctx.engine.join)
            ctx.request_cpu.shutdown()

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app, ctx.count_rejected)
    routes = (chat, completions, embeddings, scoring, render, responses, messages, models)
    for module in (*routes, tokenize, health):
        app.include_router(module.router)
    settings = ctx.settings
    if settings.allow_runtime_lora_updating:
        # As vLLM: the routes exist only when asked for (any client could load files).
        logger.warning(
            "runtime LoRA loading is on: POST /v1/load_lora_adapter reads any directory "
            "on this machine for any client of the API"
        )
        app.include_router(lora.router)
    if settings.enable_ui:
        _install_ui(app, ctx)
    # Starlette runs the last added middleware first: auth before reading any body.
    app.add_middleware(
        BodyReadMiddleware,
        limit=settings.max_request_body_bytes,
        timeout_s=settings.request_body_timeout_s,
        on_reject=ctx.count_rejected,
    )
    if settings.api_key is not None:
        app.add_middleware(
            AuthMiddleware,
            api_key=settings.api_key,
            protect_all=settings.protect_open_endpoints,
            on_reject=ctx.count_rejected,
        )
    add_cors(app, settings)  # outermost: a preflight is answered before auth
    return app


def _install_ui(app: FastAPI, ctx: ServingContext) -> None:
    from server.ui import router as ui_router
    from server.ui.hub import BlockMapHub

    app.include_router(ui_router.router)
    app.state.ui_hub = BlockMapHub(ctx.engine)
    app.state.ui_facts = ctx.startup_facts


def serving_context(
    built: Any,
    settings: ServerSettings,
    *,
    cache_info: dict[str, str] | None = None,
    with_metrics: bool = True,
    compute: ComputeThread | None = None,
) -> ServingContext:
    """Wrap a ``BuiltEngine`` (engine.builder) into the routes' context; ``compute`` is
    the thread that built it, on which the engine then steps (engine/compute_thread.py).
    ValueError for settings the model contradicts (``--reranker`` on a classifier)."""
    pooling = getattr(built, "pooling", None) or ModelPooling()
    num_labels = getattr(built, "num_labels", 0)
    check_classifier_settings(num_labels, pooling, settings.reranker)  # before any thread
    engine = AsyncEngine(built.core, queue_timeout_s=settings.queue_timeout_s, compute=compute)
    names = settings.served_model_names or (built.model_name,)
    catalog = getattr(built, "lora_catalog", None)
    _check_adapter_names(catalog, names)
    metrics = _make_metrics(built, engine, names[0], cache_info) if with_metrics else None
    responses = ResponsesState(
        ResponseStore(settings.responses_store_size, settings.responses_store_bytes)
    )
    if metrics is not None:
        metrics.watch_response_store(responses.store)
    return ServingContext(
        engine=engine,
        tokenizer=built.tokenizer,
        served_model_names=tuple(names),
        max_model_len=built.max_model_len,
        eos_token_ids=tuple(built.eos_token_ids),
        settings=settings,
        metrics=metrics,
        created=int(time.time()),
        grammar_compiler=getattr(built, "grammar_compiler", None),
        startup_facts=_startup_facts(built, engine),
        scheduling_policy=built.core.scheduler.config.scheduling_policy,
        chat_template=ChatTemplate(
            built.tokenizer, settings.chat_template, settings.chat_template_content_format
        ),
        responses=responses,
        ignored_fields=IgnoredFields(metrics.count_ignored_field if metrics else None),
        model_pooling=pooling,
        hidden_size=getattr(built, "hidden_size", 0),
        num_labels=num_labels,
        lora_catalog=catalog,
    )


def _check_adapter_names(catalog: Any, names: Sequence[str]) -> None:
    """ValueError for a --lora-modules adapter named like the base model: ``model`` could
    not tell them apart."""
    for adapter in catalog.adapters() if catalog is not None else ():
        if adapter.name in names:
            raise ValueError(
                f"--lora-modules {adapter.name}: the name is the base model's served name; "
                "give the adapter another name"
            )


def _startup_facts(built: Any, engine: AsyncEngine) -> dict[str, Any] | None:
    from server.ui.facts import startup_facts

    try:
        return startup_facts(built, engine.stats().host_blocks.total)
    except AttributeError:  # a stand-in engine without a capacity plan (tests)
        return None


def _make_metrics(
    built: Any, engine: AsyncEngine, model_name: str, cache_info: dict[str, str] | None
) -> Any:
    try:
        from server.metrics import ServerMetrics
    except ImportError:
        logger.warning("server.metrics is not available: /metrics answers 503")
        return None
    stats = engine.stats()
    info = {
        "block_size": str(stats.block_size),
        "num_device_blocks": str(stats.device_blocks.total),
        # The same count under the label the Gateway API Inference Extension's picker and
        # vLLM use (server/gateway_protocol.py).
        "num_gpu_blocks": str(stats.device_blocks.total),
        "num_host_blocks": str(stats.host_blocks.total),
        "kv_cache_dtype": str(built.kv_shape.kv_dtype),
        "max_model_len": str(built.max_model_len),
        "device": str(built.device),
        "dtype": str(built.dtype),
        **(cache_info or {}),
    }
    return ServerMetrics(
        model_name=model_name,
        stats_fn=engine.stats,
        cache_info=info,
        kv_shape=built.kv_shape,
        weight_bytes=built.weight_bytes,
        health_fn=lambda: engine.is_alive,
        memory_fn=getattr(built.core.runner, "measured_memory", None),
        planned_bytes={
            "activation_reserve": built.plan.activation_reserve_bytes,
            "copy_staging": built.plan.copy_staging_bytes,
        },
        max_loras=built.core.scheduler.config.max_loras,
    )


class AuthMiddleware:
    """Requires the API key on the API paths (constant-time compare): ``Authorization:
    Bearer <key>``, or ``x-api-key: <key>`` as Anthropic's clients send it. A refusal on
    the Messages routes is in Anthropic's shape."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str,
        protect_all: bool,
        on_reject: Callable[[str], None],
    ) -> None:
        self.app = app
        self._key = api_key.encode()
        self._protect_all = protect_all
        self._on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._needs_key(scope["path"]):
            await self.app(scope, receive, send)
            return
        if self._authorized(scope):
            await self.app(scope, receive, send)
            return
        self._on_reject("auth")
        error = APIError(
            401,
            "Missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await send_error(scope, send, error)

    def _needs_key(self, path: str) -> bool:
        if path in UI_SHELL_PATHS or path.startswith(UI_SHELL_PREFIX):
            return False
        return self._protect_all or path.startswith(PROTECTED_PREFIXES)

    def _authorized(self, scope: Scope) -> bool:
        bearer = api_key = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                bearer = value
            elif name == b"x-api-key":
                api_key = value
        # compare_digest on the whole token: no early exit that leaks the key's prefix.
        if api_key is not None and hmac.compare_digest(api_key.strip(), self._key):
            return True
        scheme, _, token = (bearer or b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
