"""Embeddings as OpenAI serves them, from the same engine as chat.

``POST /v1/embeddings`` (server/routes/embeddings.py) takes ``input`` as a string, a list
of strings, a list of token ids or a list of such lists; each becomes one engine request
that is prefill only (``SamplingParams(max_tokens=0, pooling=...)``): scheduled beside
generation under the same token budget, chunked, preemptible and aborted on disconnect
like any prompt (engine/pooling.py). The engine returns the pooled final hidden state;
this module truncates it (``dimensions``, Matryoshka models only), L2-normalises it and
encodes it (``float`` or ``base64``: little-endian float32, as OpenAI's SDK decodes it).

Pooling: ``--pooling`` if given, else the model directory's sentence-transformers Pooling
module (engine/pooling_config.py), else the last token (a causal LM's summary of its
prompt). ``run_pooled`` is shared with /v1/score and /v1/rerank (server/scoring.py).
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from engine.async_engine import GroupStream
from engine.errors import EngineDeadError, RequestRejected
from engine.request import PoolingParams, Request, SamplingParams
from server.errors import APIError, engine_dead, from_rejection, invalid
from server.protocol import StrictModel
from server.routes.context import ServingContext
from server.routes.prompts import check_token_ids
from server.text_tokens import encode_text

# OpenAI's own bound on inputs per request.
MAX_INPUTS = 2048
DEFAULT_POOLING = "last"

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(StrictModel):
    """OpenAI's embeddings request, plus vLLM's ``truncate_prompt_tokens``,
    ``add_special_tokens`` and ``normalize``. ``input`` is not a conversation:
    --max-messages does not bound it (``MAX_INPUTS`` and the body size do)."""

    TURN_LIST_FIELDS: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM: keep the last k tokens of each input (-1: the model's context length).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    add_special_tokens: bool = True
    normalize: bool = True


def pooling_kind(ctx: ServingContext) -> str:
    """``--pooling``, else what the model was trained with, else the last token."""
    return ctx.settings.pooling or ctx.model_pooling.kind or DEFAULT_POOLING


def check_dimensions(ctx: ServingContext, dimensions: int | None) -> None:
    """``dimensions`` only for a Matryoshka model, and only sizes it can give."""
    if dimensions is None:
        return
    facts = ctx.model_pooling
    if not facts.matryoshka:
        raise invalid(
            "this model does not support 'dimensions' (it is not a Matryoshka model); leave it out",
            "dimensions",
        )
    hidden = ctx.hidden_size
    if hidden and dimensions > hidden:
        raise invalid(f"'dimensions' must be at most {hidden} for this model", "dimensions")
    if facts.dimensions and dimensions not in facts.dimensions:
        allowed = ", ".join(map(str, facts.dimensions))
        raise invalid(f"'dimensions' must be one of {allowed} for this model", "dimensions")


def prepare_inputs(ctx: ServingContext, body: EmbeddingRequest) -> list[list[int]]:
    """Each input as token ids, truncated as asked and checked against the context.
    Blocking (tokenizes): run it off the event loop."""
    raw = body.input
    if isinstance(raw, str):
        items: Sequence[str | list[int]] = [raw]
    elif raw and isinstance(raw[0], int):
        items = [raw]  # type: ignore[list-item]  # one list of token ids
    else:
        items = raw  # type: ignore[assignment]
    if not items:
        raise invalid("'input' must not be empty", "input")
    if len(items) > MAX_INPUTS:
        raise invalid(f"'input' may hold at most {MAX_INPUTS} items", "input")
    prompts = [
        tokens_of(ctx, item, body.add_special_tokens, index) for index, item in enumerate(items)
    ]
    return [truncate(ctx, ids, body.truncate_prompt_tokens, "input") for ids in prompts]


def tokens_of(ctx: ServingContext, item: str | list[int], special: bool, index: int) -> list[int]:
    if isinstance(item, str):
        if not item:
            raise invalid(f"'input[{index}]' is an empty string", "input")
        ids = encode_text(ctx.tokenizer, item, add_special_tokens=special)
        if not ids:
            raise invalid(f"'input[{index}]' has no tokens", "input")
        return ids
    if not item:
        raise invalid(f"'input[{index}]' is an empty list of token ids", "input")
    check_token_ids(ctx, item, "input")
    return list(item)


def truncate(ctx: ServingContext, ids: list[int], keep: int | None, param: str) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep the last ``keep`` tokens (-1: as many as
    the context holds); without it, an input longer than the context is a 400."""
    limit = ctx.max_model_len
    if keep is not None:
        if keep > limit:
            raise invalid(
                f"'truncate_prompt_tokens' ({keep}) exceeds the model's context ({limit})",
                "truncate_prompt_tokens",
            )
        keep = limit if keep == -1 else keep
        if keep == 0:
            raise invalid("'truncate_prompt_tokens' must not be 0", "truncate_prompt_tokens")
        return ids[-keep:]
    if len(ids) > limit:
        raise invalid(
            f"an input of {len(ids)} tokens exceeds the model's context of {limit} tokens; "
            "shorten it or set 'truncate_prompt_tokens'",
            param,
            code="context_length_exceeded",
        )
    return ids


async def run_pooled(
    ctx: ServingContext, prompts: list[list[int]], pooling: PoolingParams, prefix: str
) -> list[list[float]]:
    """Submit every prompt as a prefill-only engine request and wait for their pooled
    vectors, in order. Every request still in the engine is aborted on the way out (a
    refusal, an error, a client that went away: the caller's task is cancelled)."""
    params = SamplingParams(max_tokens=0, pooling=pooling)
    base = f"{prefix}-{uuid.uuid4().hex}"
    requests = [
        Request(f"{base}-{i}", ids, params, eos_token_ids=ctx.eos_token_ids, group_id=f"{base}-{i}")
        for i, ids in enumerate(prompts)
    ]
    streams: list[GroupStream] = []
    try:
        # All added at once: the engine admits adds between steps, so adding them one
        # after another would give each its own step (32 inputs took 32 steps).
        added = await asyncio.gather(
            *(ctx.engine.add([request]) for request in requests), return_exceptions=True
        )
        streams = [item for item in added if isinstance(item, GroupStream)]
        for item in added:
            if isinstance(item, BaseException):
                raise item
        return list(await asyncio.gather(*(_vector(ctx, stream) for stream in streams)))
    except RequestRejected as exc:
        raise from_rejection(exc, ctx.settings.retry_after_s) from exc
    except EngineDeadError as exc:
        raise engine_dead(exc, in_flight=bool(streams)) from exc
    finally:
        for stream in streams:
            stream.close()


async def _vector(ctx: ServingContext, stream: GroupStream) -> list[float]:
    async for delta in stream:
        if delta.error:
            if delta.error_code == "queue_timeout":
                raise APIError(
                    503,
                    f"the request was not scheduled in time: {delta.error}",
                    code="queue_timeout",
                    reason="queue_timeout",
                    headers={"Retry-After": str(ctx.settings.retry_after_s)},
                )
            raise APIError(
                500, f"the engine failed this request: {delta.error}", code="engine_fault"
            )
        if delta.finished:
            if delta.pooled is None:
                raise APIError(500, "the engine returned no pooled vector", code="engine_fault")
            return delta.pooled
    raise APIError(500, "the engine ended the request without a result", code="engine_fault")


def finish_vector(values: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """Truncate (Matryoshka) first, then L2-normalise, as such models are trained."""
    if dimensions is not None:
        values = values[:dimensions]
    if normalize:
        norm = math.sqrt(math.fsum(v * v for v in values))
        if norm > 0:
            values = [v / norm for v in values]
    return values


def encode(values: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


async def create_embeddings(
    ctx: ServingContext, body: EmbeddingRequest, prompts: list[list[int]]
) -> dict[str, Any]:
    """The response body for ``prompts`` (already prepared), OpenAI's shape."""
    start = time.monotonic()
    pooling = PoolingParams(pooling_kind(ctx))  # type: ignore[arg-type]  # settings checked it
    vectors = await run_pooled(ctx, prompts, pooling, "embd")
    num_tokens = sum(len(ids) for ids in prompts)
    if ctx.metrics is not None:
        ctx.metrics.observe_pooling(
            "embeddings", len(prompts), num_tokens, time.monotonic() - start
        )
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": encode(
                finish_vector(vector, body.dimensions, body.normalize), body.encoding_format
            ),
        }
        for index, vector in enumerate(vectors)
    ]
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": ctx.model_name,
        "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
