"""POST /v1/chat/completions/render and /v1/completions/render (vLLM's shapes).

What the engine would run for a request, without running it: the prompt's token ids, its
rendered text, and the sampling parameters the server resolved. A precise prefix-cache
router (llm-d's, vllm-router's ``kv_aware``, Dynamo's) renders a request this way, cuts
the ids into blocks, and looks the blocks up in the index it keeps from the replicas' KV
events (engine/kv/events.py), so the ids must be exactly those the engine will see: the
routes here call the same preparation as generation (``prepare_chat``,
``prepare_completion``), with the same validation and the same 4xx for a bad request.

The answer is vLLM's ``GenerateRequest``: ``request_id``, ``token_ids``, ``features``
(null: kvserve serves text only), ``sampling_params`` (vLLM's names), ``model``,
``stream``, ``stream_options``, ``cache_salt``, ``priority``; kvserve adds ``prompt``, the
rendered text. The chat route answers one object, the completions route a list of them,
one per prompt, as vLLM does. The JSON is written in a worker thread (a long prompt is a
large body).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from engine.request import SamplingParams
from server.choice_output import OutputOptions
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.request_body import OffLoopBodyRoute
from server.routes.chat import prepare_chat
from server.routes.completions import prepare_completion
from server.routes.context import Ctx, ServingContext
from server.routes.streaming import new_id
from server.structured import Constraint

router = APIRouter(route_class=OffLoopBodyRoute)


@router.post("/v1/chat/completions/render", response_class=Response)
async def render_chat_completion(
    body: ChatCompletionRequest, request: HTTPRequest, ctx: Ctx
) -> Response:
    model = ctx.check_model(body.model)
    payload = await ctx.request_cpu.run(request, _chat_json, ctx, body, model)
    return Response(payload, media_type="application/json")


@router.post("/v1/completions/render", response_class=Response)
async def render_completion(body: CompletionRequest, request: HTTPRequest, ctx: Ctx) -> Response:
    model = ctx.check_model(body.model)
    payload = await ctx.request_cpu.run(request, _completion_json, ctx, body, model)
    return Response(payload, media_type="application/json")


def _chat_json(ctx: ServingContext, body: ChatCompletionRequest, model: str) -> bytes:
    chat = prepare_chat(ctx, body)
    rendered = generate_request(
        new_id("chatcmpl"), chat.prompt_ids, chat.prompt_text, chat.params, chat.constraint, body
    )
    return _json_bytes({**rendered, "model": model})


def _completion_json(ctx: ServingContext, body: CompletionRequest, model: str) -> bytes:
    prompts, params, constraint = prepare_completion(ctx, body)
    rendered = [
        {
            **generate_request(
                new_id("cmpl"), ids, ctx.tokenizer.decode(ids), params, constraint, body
            ),
            "model": model,
        }
        for ids in prompts
    ]
    return _json_bytes(rendered)


def generate_request(
    request_id: str,
    token_ids: list[int],
    prompt: str,
    params: SamplingParams,
    constraint: Constraint | None,
    body: ChatCompletionRequest | CompletionRequest,
) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` for one prompt (``model`` is the caller's to add)."""
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "features": None,
        "sampling_params": vllm_sampling_params(params, body, constraint),
        "stream": bool(body.stream),
        "stream_options": body.stream_options.model_dump() if body.stream_options else None,
        "cache_salt": body.cache_salt,
        "priority": body.priority,
        "prompt": prompt,
    }


def vllm_sampling_params(
    params: SamplingParams,
    body: ChatCompletionRequest | CompletionRequest,
    constraint: Constraint | None,
) -> dict[str, Any]:
    """The resolved parameters under vLLM's ``SamplingParams`` names."""
    options = OutputOptions.from_request(body)
    return {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "seed": params.seed,
        "stop": list(body.stop_strings),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "logit_bias": {str(token): bias for token, bias in params.logit_bias} or None,
        "include_stop_str_in_output": options.include_stop_str_in_output,
        "skip_special_tokens": options.skip_special_tokens,
        "spaces_between_special_tokens": options.spaces_between_special_tokens,
        "structured_outputs": _structured(constraint),
    }


def _structured(constraint: Constraint | None) -> dict[str, Any] | None:
    """vLLM's ``StructuredOutputsParams``: one of json / regex / choice / grammar."""
    if constraint is None:
        return None
    if constraint.kind == "json_schema":
        return {"json": json.loads(constraint.value)}
    if constraint.kind == "json_object":
        return {"json_object": True}
    if constraint.kind == "choice":
        return {"choice": json.loads(constraint.value)}
    return {constraint.kind: constraint.value}


def _json_bytes(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
