"""What one step's results do to a request: tokens computed, samples, prompt logprobs.

Functions of the request, the step's ``ScheduledRequest`` and the runner's output; the
scheduler's ``update()`` calls them in order and retires the request on a stop status.
A speculative decode emits the drafts the model accepted and one token after them
(``RunnerOutput.spec_token_ids``), cut here at the first that stops the sequence.
"""

from __future__ import annotations

from engine.kv.stats import StatsCounters
from engine.outputs import (
    PooledChunk,
    PromptLogprobChunk,
    RequestDelta,
    RunnerOutput,
    ScheduledRequest,
)
from engine.request import Request, RequestStatus
from engine.sched.stop import is_stop_token, stop_status


def computed_by_step(scheduled: ScheduledRequest, result: RunnerOutput) -> int:
    """Tokens whose K/V the step left valid: all it scheduled, less the rejected
    drafts (a verification emits the accepted drafts and one token after them)."""
    num_new = len(scheduled.token_ids)
    if not scheduled.num_draft_tokens:
        return num_new
    emitted = len(result.spec_token_ids[scheduled.request_id])
    return num_new - scheduled.num_draft_tokens + emitted - 1


def add_prompt_logprobs(request: Request, chunks: list[PromptLogprobChunk]) -> None:
    """Append the scored prompt positions that are new (a recompute after preemption
    scores positions again; those are already known)."""
    for chunk in sorted(chunks, key=lambda c: c.start):
        known = 1 + len(request.prompt_logprobs)  # next prompt position without a logprob
        skip = known - chunk.start
        if 0 <= skip < len(chunk.entries):
            request.prompt_logprobs.extend(chunk.entries[skip:])


def add_pooled(request: Request, chunk: PooledChunk) -> None:
    """Fold one step's pooled rows into the request's vector. A chunk from position 0
    starts it afresh (a recompute after preemption computes the prompt again: pooling
    skips the prefix cache where it reads more than the last row); otherwise it must
    continue where the last one ended, and a "mean" adds its row sum."""
    if chunk.start == 0 or request.pooled is None:
        request.pooled = list(chunk.values)
    elif chunk.start == request.pooled_until:
        request.pooled = [a + b for a, b in zip(request.pooled, chunk.values, strict=True)]
    else:
        return  # positions already pooled (cannot happen without a recompute from 0)
    request.pooled_until = chunk.end


def pooled_vector(request: Request) -> list[float] | None:
    """The request's final vector: the mean divides the row sum by the prompt length."""
    pooling = request.sampling_params.pooling
    if pooling is None or request.pooled is None:
        return None
    if pooling.kind == "mean":
        count = max(1, request.pooled_until)
        return [value / count for value in request.pooled]
    return request.pooled


def append_sample(
    request: Request,
    result: RunnerOutput,
    num_drafts: int,
    max_model_len: int,
    counters: StatsCounters,
) -> tuple[RequestDelta, RequestStatus | None]:
    """Append what the step sampled for ``request``: one token, or a verification's
    accepted drafts and the token after them, cut at the first that stops it. Returns
    the delta and the status the request finished with (None: it goes on)."""
    rid = request.request_id
    tokens = result.spec_token_ids.get(rid)
    if tokens is None:
        tokens = [result.sampled_token_ids[rid]]
        logprob = result.logprobs.get(rid)
        logprobs = None if logprob is None else [logprob]
    else:
        logprobs = result.spec_logprobs.get(rid)
        count_verification(counters, num_drafts, len(tokens))
    delta = RequestDelta(
        request_id=rid,
        group_id=request.group_id,
        index=request.index,
        new_token_ids=[],
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
    )
    status = None
    grammar_completed = rid in result.grammar_completed
    for token in tokens:
        request.append_output_token(token)
        delta.new_token_ids.append(token)
        status = stop_status(request, token, max_model_len, grammar_completed)
        if status is not None:
            break
    counters.generation_tokens += len(delta.new_token_ids)
    if logprobs is not None:
        delta.logprobs = logprobs[: len(delta.new_token_ids)]
    delta.num_output_tokens = request.num_output_tokens
    if request.num_output_tokens == 1 and request.sampling_params.prompt_logprobs is not None:
        delta.prompt_logprobs = list(request.prompt_logprobs)
    if status is not None:
        delta.ended_on_stop_token = status is RequestStatus.FINISHED_STOPPED and is_stop_token(
            request, delta.new_token_ids[-1]
        )
    return delta, status


def count_verification(counters: StatsCounters, num_drafts: int, num_emitted: int) -> None:
    """Speculation counters of one verification (emitted before any stop cut)."""
    counters.spec_drafts += 1
    counters.spec_draft_tokens += num_drafts
    counters.spec_accepted_tokens += num_emitted - 1
    counters.spec_emitted_tokens += num_emitted


def prefill_only_delta(request: Request) -> RequestDelta:
    """A max_tokens 0 request ends once its prompt is computed (and scored): one
    finishing delta with the prompt logprobs (or its pooled vector) and no token."""
    return RequestDelta(
        request_id=request.request_id,
        group_id=request.group_id,
        index=request.index,
        new_token_ids=[],
        prompt_logprobs=list(request.prompt_logprobs),
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        pooled=pooled_vector(request),
    )


def mark_finished(
    delta: RequestDelta, request: Request, status: RequestStatus, num_blocks: int
) -> None:
    """Fill the finishing fields of ``delta``: the reason, the blocks the request held
    at the end and its time in the queue."""
    delta.finish_reason = status.finish_reason
    delta.num_blocks = num_blocks
    if request.first_scheduled_time is not None:
        delta.queue_time = request.first_scheduled_time - request.arrival_time
