"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from engine.outputs import TokenLogprob
from server.choice_output import OutputOptions
from server.logprob_format import vllm_prompt_logprobs
from server.protocol import ChatCompletionRequest
from server.routes.context import Ctx, ServingContext
from server.routes.generation import ChoiceUpdate, GenerationRun
from server.routes.prompts import chat_prompt_ids_async, resolve_max_tokens, sampling_params
from server.routes.streaming import (
    complete_or_abort,
    finite,
    new_id,
    now_unix,
    sse,
    stream_when_started,
)
from server.token_bytes import TokenBytes

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: HTTPRequest,
    ctx: Ctx,
) -> JSONResponse | StreamingResponse:
    model = ctx.check_model(body.model)
    prompt_ids = await chat_prompt_ids_async(ctx, body)
    max_tokens = resolve_max_tokens(ctx, len(prompt_ids), body.requested_max_tokens, "messages")
    params = sampling_params(ctx, body, max_tokens, body.num_logprobs)
    run = GenerationRun(
        ctx,
        new_id("chatcmpl"),
        [prompt_ids],
        params,
        stop=body.stop_strings,
        priority=body.priority,
        options=OutputOptions.from_request(body),
    )
    await run.submit()
    formatter = _ChatFormatter(ctx, run, model, body)
    if body.stream:
        return await stream_when_started(request, run, formatter.events)
    return await complete_or_abort(request, run, formatter.collect)


class _ChatFormatter:
    def __init__(
        self, ctx: ServingContext, run: GenerationRun, model: str, body: ChatCompletionRequest
    ) -> None:
        self.ctx = ctx
        self.run = run
        self.model = model
        self.body = body
        self.created = now_unix()
        self.token_bytes = TokenBytes(ctx.tokenizer)
        # vLLM's chat echo: the reply starts with the final message when it is the
        # assistant's (a prefill returned whole).
        last = body.messages[-1]
        self.echo = last.text if body.echo and last.role == "assistant" else ""

    async def collect(self) -> dict[str, Any]:
        texts: dict[int, list[str]] = {c.index: [self.echo] for c in self.run.choices}
        logprobs: dict[int, list[dict[str, Any]]] = {c.index: [] for c in self.run.choices}
        async for update in self.run:
            texts[update.index].append(update.text)
            logprobs[update.index].extend(self._logprob_entries(update.logprobs))
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(texts[c.index])},
                "logprobs": {"content": logprobs[c.index]} if self._wants_logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in self.run.choices
        ]
        response = {
            "id": self.run.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.run.usage(),
            "system_fingerprint": None,
        }
        if self.body.prompt_logprobs is not None:  # vLLM: on the response, not per choice
            response["prompt_logprobs"] = vllm_prompt_logprobs(
                self.ctx.tokenizer,
                self.run.prompt_ids(0),
                self.run.prompt_logprobs(0) or [],
                self.body.prompt_logprobs,
            )
        return response

    async def events(self) -> AsyncIterator[str]:
        for choice in self.run.choices:
            yield self._chunk(choice.index, {"role": "assistant", "content": self.echo})
        async for update in self.run:
            if update.text or update.logprobs:
                yield self._chunk(update.index, {"content": update.text}, update=update)
            if update.finish_reason is not None:
                yield self._chunk(update.index, {}, finish_reason=update.finish_reason)
        if self.body.include_usage:
            yield sse({**self._envelope(), "choices": [], "usage": self.run.usage()})

    @property
    def _wants_logprobs(self) -> bool:
        return self.body.logprobs

    def _envelope(self) -> dict[str, Any]:
        return {
            "id": self.run.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any],
        *,
        update: ChoiceUpdate | None = None,
        finish_reason: str | None = None,
    ) -> str:
        logprobs = None
        if self._wants_logprobs and update is not None:
            logprobs = {"content": self._logprob_entries(update.logprobs)}
        chunk: dict[str, Any] = {
            **self._envelope(),
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            ],
        }
        if self.body.continuous_usage:
            chunk["usage"] = self.run.usage()
        elif self.body.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def _logprob_entries(self, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
        if not self._wants_logprobs:
            return []
        return [
            {
                **self._token_entry(lp.token_id, lp.logprob),
                "top_logprobs": [self._token_entry(t, v) for t, v in lp.top],
            }
            for lp in logprobs
        ]

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.ctx.tokenizer.decode([token_id])
        return {
            "token": text,
            "logprob": finite(logprob),
            "bytes": self.token_bytes.bytes_of(token_id),
        }
