"""POST /v1/completions (legacy text completions)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from engine.outputs import TokenLogprob
from engine.request import SamplingParams
from server.choice_output import OutputOptions
from server.logprob_format import vllm_prompt_logprobs
from server.protocol import CompletionRequest
from server.request_body import OffLoopBodyRoute
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
from server.structured import (
    Constraint,
    constrained,
    requested_constraints,
    single_constraint,
)

router = APIRouter(route_class=OffLoopBodyRoute)


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest,
    request: HTTPRequest,
    ctx: Ctx,
) -> JSONResponse | StreamingResponse:
    model = ctx.check_model(body.model)
    lora = ctx.lora_for(body.model)  # before any await: unloaded meanwhile is a 404, not the base
    ctx.check_generates()
    prompts, params, constraint = await ctx.request_cpu.run(request, prepare_completion, ctx, body)
    params = await constrained(ctx.grammar_compiler, params, constraint)
    run = GenerationRun(
        ctx,
        new_id("cmpl"),
        prompts,
        params,
        stop=body.stop_strings,
        priority=body.priority,
        cache_salt=body.cache_salt,
        options=OutputOptions.from_request(body),
        lora=lora,
    )
    await run.submit()
    formatter = _CompletionFormatter(ctx, run, model, body, prompts)
    if body.stream:
        return await stream_when_started(request, run, formatter.events)
    return await complete_or_abort(request, run, formatter.collect)


def prepare_completion(
    ctx: ServingContext, body: CompletionRequest
) -> tuple[list[list[int]], SamplingParams, Constraint | None]:
    """Prompt ids, sampling parameters and output constraint: all the request's own CPU
    work, in one call the route makes from a worker thread."""
    prompts = completion_prompts(ctx, body)
    # One budget for all prompts: omitted max_tokens means what the longest prompt leaves.
    longest = max(len(ids) for ids in prompts)
    requested = body.requested_max_tokens
    if body.max_tokens is None:  # the default 16, or what the context leaves if less
        requested = max(1, min(requested, ctx.max_model_len - longest))
    max_tokens = resolve_max_tokens(ctx, longest, requested, "prompt")
    params = sampling_params(ctx, body, max_tokens, body.num_logprobs)
    constraint = single_constraint(requested_constraints(body))
    return prompts, params, constraint


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
        self.offsets = {index: 0 for index in self.echo}
        self._started: set[int] = set()  # choices whose echo (and prompt logprobs) went out

    async def collect(self) -> dict[str, Any]:
        texts: dict[int, list[str]] = {index: [] for index in self.echo}
        logprobs = {index: _empty_logprobs() for index in self.echo}
        extras: dict[int, dict[str, Any]] = {}
        async for update in self.run:
            if update.index not in self._started:
                extras[update.index] = self._start_choice(update.index, texts, logprobs)
            texts[update.index].append(update.text)
            _extend(logprobs[update.index], self._logprobs(update.index, update.logprobs))
        for c in self.run.choices:  # a choice that ended without any update
            if c.index not in self._started:
                extras[c.index] = self._start_choice(c.index, texts, logprobs)
        choices = [
            {
                "index": c.index,
                "text": "".join(texts[c.index]),
                "logprobs": logprobs[c.index] if self._wants_logprobs else None,
                "finish_reason": c.finish_reason,
                **extras[c.index],
            }
            for c in self.run.choices
        ]
        return {**self._envelope(), "choices": choices, "usage": self.run.usage()}

    def _start_choice(
        self, index: int, texts: dict[int, list[str]], logprobs: dict[int, dict[str, Any]]
    ) -> dict[str, Any]:
        """Put the echoed prompt (and its logprobs) first; return the vLLM extras."""
        self._started.add(index)
        texts[index].append(self.echo[index])
        _extend(logprobs[index], self._echo_logprobs(index))
        self.offsets[index] = len(self.echo[index])
        return self._prompt_logprob_extras(index)

    async def events(self) -> AsyncIterator[str]:
        async for update in self.run:
            index = update.index
            if index not in self._started:
                async for chunk in self._start_events(index):
                    yield chunk
            if update.text or update.logprobs or update.finish_reason:
                logprobs = self._logprobs(index, update.logprobs)
                yield self._chunk(index, update.text, logprobs, update.finish_reason)
        for c in self.run.choices:
            if c.index not in self._started:
                async for chunk in self._start_events(c.index):
                    yield chunk
        if self.body.include_usage:
            yield sse({**self._envelope(), "choices": [], "usage": self.run.usage()})

    async def _start_events(self, index: int) -> AsyncIterator[str]:
        self._started.add(index)
        extras = self._prompt_logprob_extras(index)
        if self.body.echo or extras:
            yield self._chunk(index, self.echo[index], self._echo_logprobs(index), None, extras)
        self.offsets[index] = len(self.echo[index])

    def _echo_logprobs(self, index: int) -> dict[str, Any]:
        """The legacy logprobs of the echoed prompt: its first token has none."""
        result = _empty_logprobs()
        if not (self.body.echo and self._wants_logprobs):
            return result
        decode = self.ctx.tokenizer.decode
        prompt = self.run.prompt_ids(index)
        scored = self.run.prompt_logprobs(index) or []
        top_n = self.body.logprobs or 0
        offset = 0
        for position, token_id in enumerate(prompt):
            token = decode([token_id])
            result["tokens"].append(token)
            result["text_offset"].append(offset)
            offset += len(token)
            if position == 0 or position > len(scored):
                result["token_logprobs"].append(None)
                result["top_logprobs"].append(None)
                continue
            lp = scored[position - 1]
            result["token_logprobs"].append(finite(lp.logprob))
            result["top_logprobs"].append({decode([t]): finite(v) for t, v in lp.top[:top_n]})
        return result

    def _prompt_logprob_extras(self, index: int) -> dict[str, Any]:
        if self.body.prompt_logprobs is None:
            return {}
        scored = self.run.prompt_logprobs(index) or []
        prompt = self.run.prompt_ids(index)
        return {
            "prompt_logprobs": vllm_prompt_logprobs(
                self.ctx.tokenizer, prompt, scored, self.body.prompt_logprobs
            )
        }

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
        self,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        finish: str | None,
        extras: dict[str, Any] | None = None,
    ) -> str:
        chunk: dict[str, Any] = {
            **self._envelope(),
            "choices": [
                {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs if self._wants_logprobs else None,
                    "finish_reason": finish,
                    **(extras or {}),
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
