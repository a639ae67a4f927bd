"""From validated request models to token ids and SamplingParams, with the checks that
need the tokenizer or the context length (the pydantic models cannot know those).

Everything here is CPU work proportional to the request (rendering, tokenizing, walking
token ids): the routes call it from a worker thread, never on the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.request import SamplingParams
from server.chat_template import ChatTemplateOptions
from server.errors import APIError, invalid
from server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from server.routes.context import ServingContext
from server.text_tokens import encode_text
from server.tools.models import ToolDefinition


def render_chat(
    ctx: ServingContext,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    options: ChatTemplateOptions | None = None,
) -> str:
    """The chat template (server/chat_template.py) applied to the messages."""
    limit = ctx.settings.max_messages
    if len(messages) > limit:
        raise invalid(
            f"'messages' has {len(messages)} messages; this server accepts at most {limit} "
            "(--max-messages)",
            "messages",
            code="too_many_messages",
        )
    options = options or ChatTemplateOptions(add_generation_prompt=add_generation_prompt)
    return ctx.template().render(messages, options)


def chat_options(
    body: ChatCompletionRequest, tools: Sequence[ToolDefinition] = ()
) -> ChatTemplateOptions:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return ChatTemplateOptions(
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        kwargs=kwargs,
        tools=tuple(tools),
    )


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    ids: list[int]


def chat_prompt(
    ctx: ServingContext,
    messages: Sequence[ChatMessage],
    body: ChatCompletionRequest | None = None,
    tools: Sequence[ToolDefinition] = (),
) -> RenderedPrompt:
    """Rendered and tokenised. The template already contains any BOS the model wants, so
    no special tokens are added unless the request asks (vLLM's add_special_tokens)."""
    options = chat_options(body, tools) if body is not None else None
    text = render_chat(ctx, messages, options=options)
    add_special = body.add_special_tokens if body is not None else False
    return RenderedPrompt(text, encode_text(ctx.tokenizer, text, add_special_tokens=add_special))


def completion_prompts(ctx: ServingContext, body: CompletionRequest) -> list[list[int]]:
    """Every form of ``prompt`` (string, strings, ids, lists of ids) as id lists."""
    prompt = body.prompt
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    result = []
    for item in items:
        if isinstance(item, str):
            result.append(
                encode_text(ctx.tokenizer, item, add_special_tokens=body.add_special_tokens)
            )
        else:
            check_token_ids(ctx, item, "prompt")
            result.append(list(item))
    for ids in result:
        if not ids:
            raise invalid("the prompt is empty: give at least one token", "prompt")
    return result


def check_token_ids(ctx: ServingContext, ids: Sequence[int], param: str) -> None:
    vocab = ctx.vocab_size
    for token in ids:
        if not 0 <= token < vocab:
            raise invalid(
                f"token id {token} in '{param}' is outside the vocabulary [0, {vocab})", param
            )


def resolve_max_tokens(
    ctx: ServingContext,
    prompt_len: int,
    requested: int | None,
    param: str,
    *,
    up_to_context: bool = False,
) -> int:
    """The completion budget: checked against the context, or all that is left of it;
    with ``up_to_context`` a request for more than is left gets what is left (Anthropic's
    models stop at the end of their window instead of refusing)."""
    limit = ctx.max_model_len
    if prompt_len >= limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens, but the prompt has "
            f"{prompt_len} tokens; shorten it to at most {limit - 1} tokens.",
            param=param,
            code="context_length_exceeded",
            reason="too_long",
        )
    if requested is None:
        return limit - prompt_len
    if up_to_context:
        return min(requested, limit - prompt_len)
    if prompt_len + requested > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            f"completion). Reduce the prompt or max_tokens to at most {limit - prompt_len}.",
            param="max_tokens",
            code="context_length_exceeded",
            reason="too_long",
        )
    return requested


def sampling_params(
    ctx: ServingContext, body: SamplingFields, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    """Map the request's sampling fields onto the engine's SamplingParams."""
    if body.n > ctx.settings.max_n:
        raise invalid(f"'n' must be at most {ctx.settings.max_n} on this server", "n")
    if body.min_tokens > max_tokens:
        raise invalid(
            f"'min_tokens' ({body.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens"
        )
    stop_ids = tuple(body.stop_token_ids or ())
    check_token_ids(ctx, stop_ids, "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=_logit_bias(ctx, body.logit_bias),
        seed=body.seed,
        n=body.n,
        stop_token_ids=stop_ids,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=body.num_prompt_logprobs,
    )


def _logit_bias(
    ctx: ServingContext, bias: dict[str, float] | None
) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise invalid(
                f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias"
            ) from None
        pairs.append((token, float(value)))
    check_token_ids(ctx, [t for t, _ in pairs], "logit_bias")
    return tuple(sorted(pairs))
