"""POST /v1/completions (legacy text completions)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from engine.outputs import TokenLogprob
from server.protocol import CompletionRequest
from server.routes.context import Ctx, ServingContext
from server.routes.generation import GenerationRun
from server.routes.prompts import completion_prompts, resolve_max_tokens, sampling_params
from server.routes.streaming import (
    complete_or_abort,
    finite,
    new_id,
    now_unix,
    sse,
    stream_when_started,
)
from server.structured import constrained, requested_constraints, single_constraint

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest,
    request: HTTPRequest,
    ctx: Ctx,
) -> JSONResponse | StreamingResponse:
    model = ctx.check_model(body.model)
    prompts = completion_prompts(ctx, body)
    # One budget for all prompts: omitted max_tokens means what the longest prompt leaves.
    longest = max(len(ids) for ids in prompts)
    max_tokens = resolve_max_tokens(ctx, longest, body.requested_max_tokens, "prompt")
    params = sampling_params(ctx, body, max_tokens, body.num_logprobs)
    constraint = single_constraint(requested_constraints(body))
    params = await constrained(ctx.grammar_compiler, params, constraint)
    run = GenerationRun(
        ctx,
        new_id("cmpl"),
        prompts,
        params,
        stop=body.stop_strings,
        priority=body.priority,
        cache_salt=body.cache_salt,
    )
    await run.submit()
    formatter = _CompletionFormatter(ctx, run, model, body, prompts)
    if body.stream:
        return await stream_when_started(request, run, formatter.events)
    return await complete_or_abort(request, run, formatter.collect)


class _CompletionFormatter:
    def __init__(
        self,
        ctx: ServingContext,
        run: GenerationRun,
        model: str,
        body: CompletionRequest,
        prompts: list[list[int]],
    ) -> None:
        self.ctx = ctx
        self.run = run
        self.model = model
        self.body = body
        self.created = now_unix()
        n = body.n
        # Echo repeats the prompt text in front of every choice of that prompt.
        self.echo = {
            p * n + i: ctx.tokenizer.decode(ids) if body.echo else ""
            for p, ids in enumerate(prompts)
            for i in range(n)
        }
        self.offsets = {index: len(text) for index, text in self.echo.items()}

    async def collect(self) -> dict[str, Any]:
        texts = {index: [echo] for index, echo in self.echo.items()}
        logprobs = {index: _empty_logprobs() for index in self.echo}
        async for update in self.run:
            texts[update.index].append(update.text)
            _extend(logprobs[update.index], self._logprobs(update.index, update.logprobs))
        choices = [
            {
                "index": c.index,
                "text": "".join(texts[c.index]),
                "logprobs": logprobs[c.index] if self._wants_logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in self.run.choices
        ]
        return {**self._envelope(), "choices": choices, "usage": self.run.usage()}

    async def events(self) -> AsyncIterator[str]:
        if self.body.echo:
            for index, echo in self.echo.items():
                yield self._chunk(index, echo, None, None)
        async for update in self.run:
            if update.text or update.logprobs or update.finish_reason:
                logprobs = self._logprobs(update.index, update.logprobs)
                yield self._chunk(update.index, update.text, logprobs, update.finish_reason)
        if self.body.include_usage:
            yield sse({**self._envelope(), "choices": [], "usage": self.run.usage()})

    @property
    def _wants_logprobs(self) -> bool:
        return self.body.logprobs is not None

    def _envelope(self) -> dict[str, Any]:
        return {
            "id": self.run.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def _chunk(
        self, index: int, text: str, logprobs: dict[str, Any] | None, finish: str | None
    ) -> str:
        chunk: dict[str, Any] = {
            **self._envelope(),
            "choices": [
                {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs if self._wants_logprobs else None,
                    "finish_reason": finish,
                }
            ],
        }
        if self.body.continuous_usage:
            chunk["usage"] = self.run.usage()
        elif self.body.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def _logprobs(self, index: int, entries: list[TokenLogprob]) -> dict[str, Any]:
        """The legacy logprobs object for new tokens; text_offset counts from the start
        of this choice's text (echoed prompt included)."""
        result = _empty_logprobs()
        decode = self.ctx.tokenizer.decode
        for lp in entries:
            token = decode([lp.token_id])
            result["tokens"].append(token)
            result["token_logprobs"].append(finite(lp.logprob))
            result["top_logprobs"].append({decode([t]): finite(v) for t, v in lp.top})
            result["text_offset"].append(self.offsets[index])
            self.offsets[index] += len(token)
        return result


def _empty_logprobs() -> dict[str, Any]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _extend(target: dict[str, Any], more: dict[str, Any]) -> None:
    for key, values in more.items():
        target[key].extend(values)
