"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's shapes).

Registered only under ``--allow-runtime-lora-updating`` (or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): a client that may call them can make the server read
any adapter directory on its machine. Success is vLLM's plain-text 200; a refusal is an
OpenAI-shaped error:

* 400: LoRA not enabled (``--enable-lora``), an empty name or path, a name already served
  (a loaded adapter or the base model), an adapter the engine cannot serve (no such
  directory, not PEFT, rank above ``--max-lora-rank``, a module the base lacks, shapes of
  another model: the catalog's message says which and what to change).
* 404: unloading a name no adapter has.
* 409: unloading an adapter that requests still run with; it may be unloaded once they end.

An unloaded adapter's name is a 404 for new requests at once; what ran with it has ended.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from engine.errors import EngineDeadError
from engine.lora.adapter import LoRAError
from engine.lora.catalog import LoRACatalog
from engine.request import LoRARequest
from server.errors import APIError, invalid
from server.protocol import StrictModel
from server.request_body import OffLoopBodyRoute
from server.routes.context import Ctx, ServingContext

router = APIRouter(route_class=OffLoopBodyRoute)


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str
    # vLLM's field; as in vLLM the name alone decides (ids are the server's own).
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, ctx: Ctx) -> PlainTextResponse:
    catalog = _catalog(ctx)
    name, path = body.lora_name, body.lora_path
    if not name or not path:
        raise invalid("both 'lora_name' and 'lora_path' must be given and non-empty")
    _check_name_free(ctx, catalog, name)
    try:
        # Reads and checks every weight: off the event loop.
        await asyncio.to_thread(catalog.load, name, path)
    except (LoRAError, OSError) as exc:
        taken = catalog.get(name) is not None  # a concurrent load of the same name won
        raise invalid(str(exc), param="lora_name" if taken else "lora_path") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, ctx: Ctx) -> PlainTextResponse:
    catalog = _catalog(ctx)
    name = body.lora_name
    lora = catalog.get(name)
    if lora is None:
        raise _not_loaded(name)
    users = await _users(ctx, lora)
    if users:
        raise APIError(
            409,
            f"the LoRA adapter '{name}' is in use by {users} running "
            f"request{'s' if users != 1 else ''}; unload it once they have finished",
            param="lora_name",
            code="adapter_in_use",
        )
    if catalog.get(name) is not lora:  # unloaded (or reloaded) while the engine counted
        raise _not_loaded(name)
    catalog.unload(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _catalog(ctx: ServingContext) -> LoRACatalog:
    if ctx.lora_catalog is None:
        raise invalid(
            "LoRA adapters are not enabled on this server: start it with --enable-lora",
            code="lora_not_enabled",
        )
    return ctx.lora_catalog


def _check_name_free(ctx: ServingContext, catalog: LoRACatalog, name: str) -> None:
    """400 for a name clients could not tell from something already served; checked
    before the (slow) read, and again by the catalog under its lock."""
    if name in ctx.served_model_names:
        raise invalid(
            f"'{name}' is the base model's served name; give the adapter another name",
            param="lora_name",
        )
    if catalog.get(name) is not None:
        raise invalid(
            f"the LoRA adapter '{name}' is already loaded; unload it first to load it anew",
            param="lora_name",
        )


def _not_loaded(name: str) -> APIError:
    return APIError(
        404, f"the LoRA adapter '{name}' is not loaded", param="lora_name", code="not_found"
    )


async def _users(ctx: ServingContext, lora: LoRARequest) -> int:
    """The sequences that run with ``lora``: the engine's live requests, or the server's
    own count where that is higher (a run submitted after the engine answered). The
    caller must not await between this and the unload."""
    try:
        in_engine = await ctx.engine.probe(functools.partial(_live_with, lora.id))
    except EngineDeadError:
        in_engine = 0  # nothing runs in a dead engine; the server's count still holds
    return max(in_engine, ctx.lora_use.count(lora.id))


def _live_with(adapter_id: int, core: Any) -> int:
    """On the engine thread, between steps: live sequences running adapter ``adapter_id``."""
    return sum(
        1
        for request in core.scheduler.live_requests()
        if request.lora is not None and request.lora.id == adapter_id
    )
