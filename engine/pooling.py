"""Pooling: a prompt's final hidden states as one vector, for embeddings and scores.

A request whose ``sampling_params.pooling`` is set is prefill only (``max_tokens`` 0):
it is scheduled, chunked, preempted and aborted like any prompt, and each step that
computes some of its positions hands the scheduler a ``PooledChunk`` from the rows it
computed, after the model's final norm:

- ``mean``: the sum of the chunk's rows (the scheduler adds the chunks and divides by
  the prompt length at the end);
- ``cls``: the row of position 0, from the step that computes it;
- ``last``: the last prompt position's row, from the step that reaches it; with
  ``token_ids``, the LM head's logits of those tokens there instead (a causal
  reranker's yes/no); with ``classify``, the classifier head's logits there (a
  ``*ForSequenceClassification`` cross-encoder's, as transformers reads them at the
  last token).

Sums run in float32 whatever the model's dtype; the vector leaves the device as a list
of Python floats (the scheduler is torch-free). ``mean`` and ``cls`` skip the prefix
cache, since cached positions are never recomputed; ``last`` uses it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.outputs import PooledChunk, ScheduledRequest


def pool_rows(
    batch: list[ScheduledRequest],
    hidden: torch.Tensor,
    final_norm: Callable[[torch.Tensor], torch.Tensor],
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    classify_fn: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, PooledChunk]:
    """What this step adds to each pooling request of ``batch`` (``hidden``: the step's
    rows ``[batch tokens, hidden]`` in batch order, before the final norm; ``logits_fn``
    and ``classify_fn``: the LM head's and the classifier head's float32 logits of such
    rows)."""
    pooled: dict[str, PooledChunk] = {}
    row = 0
    for request in batch:
        first, count = row, request.num_new_tokens
        row += count
        pooling = request.sampling_params.pooling
        if pooling is None:
            continue
        start = request.num_computed_tokens
        end = min(start + count, len(request.prompt_token_ids))
        if end <= start:
            continue
        if pooling.kind == "mean":
            rows = final_norm(hidden[first : first + end - start]).to(torch.float32)
            values = rows.sum(dim=0)
        elif pooling.kind == "cls":
            if start != 0:
                continue
            values = final_norm(hidden[first : first + 1]).to(torch.float32)[0]
        else:
            if end != len(request.prompt_token_ids):
                continue
            last = hidden[first + end - start - 1 : first + end - start]
            if pooling.token_ids:
                ids = torch.tensor(pooling.token_ids, device=hidden.device)
                values = logits_fn(last)[0].index_select(0, ids)
            elif pooling.classify:
                values = classify_fn(last)[0]
            else:
                values = final_norm(last).to(torch.float32)[0]
        pooled[request.request_id] = PooledChunk(start, end, values.cpu().tolist())
    return pooled
