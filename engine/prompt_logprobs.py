"""Prompt logprobs: the log-probability of each prompt token given the tokens before it.

A prefill computes hidden states for every prompt position it covers; the runner
normally projects only the last one to logits. For a request whose
``sampling_params.prompt_logprobs`` is set, the rows of positions ``p`` that have a prompt
token at ``p + 1`` are also projected, and ``log_softmax(logits[p])[prompt[p + 1]]`` is
that token's logprob (plus its rank and the top alternatives). Chunked prefills and
split steps score their part each; the scheduler stitches the pieces in prompt order.

Cost: one LM-head projection of ``vocab`` floats per scored position (done in slices of
``SLICE_ROWS`` rows to bound the temporary memory), and such a request cannot reuse the
prefix cache for the tokens it scores, since cached positions are never recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.outputs import PromptLogprobChunk, ScheduledRequest, TokenLogprob

# Positions projected to logits at once: bounds the [rows, vocab] float32 temporaries.
SLICE_ROWS = 256


@dataclass(frozen=True)
class _Span:
    """Rows of one request in the flattened batch that score prompt tokens."""

    request_id: str
    first_row: int
    first_target: int  # prompt position of the first scored token
    targets: list[int]  # the prompt tokens scored, in order
    top_n: int


def prompt_spans(batch: list[ScheduledRequest]) -> list[_Span]:
    """Which hidden rows score which prompt tokens, for the requests that want it."""
    spans: list[_Span] = []
    row = 0
    for request in batch:
        wanted = request.sampling_params.prompt_logprobs
        start = request.num_computed_tokens
        if wanted is not None:
            prompt = request.prompt_token_ids
            # Position p scores prompt[p + 1]: the chunk's positions up to len(prompt) - 2.
            end = min(start + request.num_new_tokens, len(prompt) - 1)
            if end > start:
                spans.append(
                    _Span(request.request_id, row, start + 1, prompt[start + 1 : end + 1], wanted)
                )
        row += request.num_new_tokens
    return spans


def score_prompts(
    batch: list[ScheduledRequest],
    hidden: torch.Tensor,
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, list[PromptLogprobChunk]]:
    """The prompt logprobs of ``batch``'s scoring requests from the step's hidden states
    (``[batch tokens, hidden]`` in batch order); ``logits_fn`` is the model's LM head."""
    result: dict[str, list[PromptLogprobChunk]] = {}
    for span in prompt_spans(batch):
        entries: list[TokenLogprob] = []
        for offset in range(0, len(span.targets), SLICE_ROWS):
            targets = span.targets[offset : offset + SLICE_ROWS]
            first = span.first_row + offset
            rows = hidden[first : first + len(targets)]
            entries.extend(_score_rows(logits_fn(rows), targets, span.top_n))
        result[span.request_id] = [PromptLogprobChunk(span.first_target, tuple(entries))]
    return result


def _score_rows(logits: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprob]:
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    index = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, index)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if top_n > 0:
        values, ids = logprobs.topk(top_n, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprob(
            token_id=token,
            logprob=value,
            top=tuple(zip(top_ids[i], top_values[i], strict=True)),
            rank=rank,
        )
        for i, (token, value, rank) in enumerate(
            zip(targets, chosen.squeeze(1).tolist(), ranks.tolist(), strict=True)
        )
    ]
