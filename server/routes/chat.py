"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from engine.outputs import TokenLogprob
from engine.request import LoRARequest, SamplingParams
from server.choice_output import OutputOptions
from server.logprob_format import vllm_prompt_logprobs
from server.protocol import ChatCompletionRequest
from server.reasoning import ReasoningFormat
from server.request_body import OffLoopBodyRoute
from server.routes.context import Ctx, ServingContext
from server.routes.generation import ChoiceUpdate, GenerationRun
from server.routes.prompts import chat_prompt, resolve_max_tokens, sampling_params
from server.routes.streaming import (
    complete_or_abort,
    finite,
    new_id,
    now_unix,
    sse,
    stream_when_started,
)
from server.structured import Constraint, constrained, requested_constraints
from server.token_bytes import TokenBytes
from server.tools.events import OutputEvent, ToolCallStart, assemble, delta_of
from server.tools.output import choice_output, finish_reason
from server.tools.plan import ToolPlan, output_constraint, plan_tools

router = APIRouter(route_class=OffLoopBodyRoute)


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: HTTPRequest,
    ctx: Ctx,
) -> JSONResponse | StreamingResponse:
    model = ctx.check_model(body.model)
    lora = ctx.lora_for(body.model)  # before any await: unloaded meanwhile is a 404, not the base
    ctx.check_generates()
    run, chat = await launch_chat(ctx, request, body, new_id("chatcmpl"), lora=lora)
    formatter = _ChatFormatter(ctx, run, model, body, chat)
    if body.stream:
        return await stream_when_started(request, run, formatter.events)
    return await complete_or_abort(request, run, formatter.collect)


async def launch_chat(
    ctx: ServingContext,
    request: HTTPRequest,
    body: ChatCompletionRequest,
    request_id: str,
    *,
    up_to_context: bool = False,
    lora: LoRARequest | None = None,
) -> tuple[GenerationRun, PreparedChat]:
    """The one generation path of the chat, Responses and Messages routes: prepare the
    request off the event loop, compile its constraint, submit it to the engine
    (``up_to_context``: a token budget past the context is cut to it, not refused) to run
    with the LoRA adapter ``lora`` (None: the base model)."""
    chat = await ctx.request_cpu.run(request, prepare_chat, ctx, body, up_to_context)
    params = await constrained(
        ctx.grammar_compiler,
        chat.params,
        chat.constraint,
        chat.plan.checks,
        chat.after,
        chat.opener,
    )
    run = GenerationRun(
        ctx,
        request_id,
        [chat.prompt_ids],
        params,
        stop=body.stop_strings,
        priority=body.priority,
        cache_salt=body.cache_salt,
        options=OutputOptions.from_request(body),
        lora=lora,
    )
    await run.submit()
    return run, chat


@dataclass(frozen=True)
class PreparedChat:
    """A chat request turned into what the engine runs, before its grammar is compiled:
    also how its output splits into reasoning and answer (None: no reasoning parser), and
    the tokens its constraint waits for (the end of the reasoning, server/reasoning.py)."""

    plan: ToolPlan
    constraint: Constraint | None
    prompt_ids: list[int]
    params: SamplingParams
    reasoning: ReasoningFormat | None = None
    after: tuple[int, ...] = ()
    prompt_text: str = ""  # the rendered template the ids encode
    opener: int | None = None  # the start tag whose opening makes the constraint wait


def prepare_chat(
    ctx: ServingContext, body: ChatCompletionRequest, up_to_context: bool = False
) -> PreparedChat:
    """Tools, output constraint, rendered and tokenized prompt, sampling parameters: all
    the request's own CPU work, in one call the route makes from a worker thread."""
    plan = plan_tools(body, ctx.settings)
    constraint = output_constraint(plan, requested_constraints(body))
    prompt = chat_prompt(ctx, body.messages, body, plan.tools)
    requested = body.requested_max_tokens
    max_tokens = resolve_max_tokens(
        ctx, len(prompt.ids), requested, "messages", up_to_context=up_to_context
    )
    params = sampling_params(ctx, body, max_tokens, body.num_logprobs)
    reasoning = ctx.settings.reasoning
    if reasoning is None:
        return PreparedChat(plan, constraint, prompt.ids, params, prompt_text=prompt.text)
    reasoning = reasoning.for_prompt(prompt.text)
    after: tuple[int, ...] = ()
    opener = None
    if constraint is not None:
        opener = reasoning.opener_id(ctx.tokenizer, prompt.text)
        if reasoning.starts_inside or opener is not None:
            after = reasoning.end_marker_ids(ctx.tokenizer)
    return PreparedChat(plan, constraint, prompt.ids, params, reasoning, after, prompt.text, opener)


class _ChatFormatter:
    def __init__(
        self,
        ctx: ServingContext,
        run: GenerationRun,
        model: str,
        body: ChatCompletionRequest,
        chat: PreparedChat,
    ) -> None:
        self.ctx = ctx
        self.run = run
        self.model = model
        self.body = body
        self.created = now_unix()
        # Each choice's text becomes reasoning, content and tool calls (server/tools/output.py).
        self.outputs = {c.index: choice_output(chat.plan, chat.reasoning) for c in run.choices}
        self.called_tools: set[int] = set()

        self.token_bytes = TokenBytes(ctx.tokenizer)
        # vLLM's chat echo: the reply starts with the final message when it is the
        # assistant's (a prefill returned whole).
        last = body.messages[-1]
        self.echo = last.text if body.echo and last.role == "assistant" else ""

    def _events(self, update: ChoiceUpdate) -> list[OutputEvent]:
        output = self.outputs[update.index]
        events = output.feed(update.text)
        if update.finish_reason is not None:
            events += output.finish()
        if any(isinstance(e, ToolCallStart) for e in events):
            self.called_tools.add(update.index)
        return events

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        return finish_reason(reason, index in self.called_tools)

    async def collect(self) -> dict[str, Any]:
        events: dict[int, list[OutputEvent]] = {c.index: [] for c in self.run.choices}
        logprobs: dict[int, list[dict[str, Any]]] = {c.index: [] for c in self.run.choices}
        async for update in self.run:
            events[update.index] += self._events(update)
            logprobs[update.index].extend(self._logprob_entries(update.logprobs))
        choices = [
            {
                "index": c.index,
                "message": self._message(events[c.index]),
                "logprobs": {"content": logprobs[c.index]} if self._wants_logprobs else None,
                "finish_reason": self._finish_reason(c.index, c.finish_reason),
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
            deltas = [delta_of(event) for event in self._events(update)]
            if not deltas and update.logprobs:
                deltas = [{"content": ""}]
            for i, delta in enumerate(deltas):  # the update's logprobs ride on its first
                yield self._chunk(update.index, delta, update=update if i == 0 else None)
            if update.finish_reason is not None:
                reason = self._finish_reason(update.index, update.finish_reason)
                yield self._chunk(update.index, {}, finish_reason=reason)
        if self.body.include_usage:
            yield sse({**self._envelope(), "choices": [], "usage": self.run.usage()})

    def _message(self, events: list[OutputEvent]) -> dict[str, Any]:
        message = assemble(events).as_openai()
        if self.echo:  # the prefilled assistant text comes back in front of the reply
            message["content"] = self.echo + (message.get("content") or "")
        return message

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
