"""Verify draft tokens against the target model's logits, keeping its distribution.

A request scheduled with ``k`` drafts ``d1..dk`` has ``k + 1`` rows of logits: row ``i``
scores the token after ``d1..di``. Each row goes through the sampler's own processing
(logit bias, the min_tokens mask, temperature, top-k/top-p/min-p) with ``d1..di`` counted
as output, so a row's distribution ``p_i`` is exactly what plain decoding would sample from
after emitting those drafts.

- Greedy: ``d(i+1)`` is accepted while it is ``argmax p_i``; the first row that disagrees
  (or row ``k`` when all agree) gives the next token. Output is token-for-token the
  non-speculative one.
- Sampled: n-gram drafts are deterministic (a proposal distribution that is a point mass),
  so the rejection rule of speculative sampling reduces to: accept ``d(i+1)`` with
  probability ``p_i(d(i+1))``; at the first rejection draw from ``p_i`` with ``d(i+1)``
  removed (the residual ``max(0, p - q)``, renormalised); when all are accepted draw the
  bonus token from ``p_k``. Each emitted token is then distributed as ``p`` itself.

Everything is batched over all rows of all verifying requests; per-request Python is
index bookkeeping only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device_tensor import to_device
from engine.outputs import ScheduledRequest, TokenLogprob
from engine.sampler import (
    Sampler,
    SamplingRow,
    apply_truncation,
    gather_logprobs,
    raw_logprobs,
)


@dataclass(frozen=True)
class Verified:
    """What one verifying request emits: accepted drafts, then one sampled token."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None


def position_rows(requests: list[ScheduledRequest]) -> list[SamplingRow]:
    """One sampling row per verified position, drafts before it counted as output (only
    the count matters: requests with penalties never speculate)."""
    rows = []
    for r in requests:
        output = r.output_token_ids
        drafts = r.draft_token_ids
        for i in range(len(drafts) + 1):
            history = output if len(output) >= r.sampling_params.min_tokens else output + drafts[:i]
            rows.append(
                SamplingRow(r.request_id, r.sampling_params, r.prompt_token_ids, history, r.seed)
            )
    return rows


def verify(
    sampler: Sampler, logits: torch.Tensor, requests: list[ScheduledRequest]
) -> dict[str, Verified]:
    """Accept or reject every request's drafts; ``logits`` holds ``num_draft_tokens + 1``
    rows per request, in ``requests`` order."""
    rows = position_rows(requests)
    logits = logits.to(torch.float32)
    raw = raw_logprobs(logits, rows)
    processed = sampler.process(logits, rows)
    draft_next = _next_drafts(requests, logits.device)
    accept, replacement = _accept_and_replace(sampler, processed, rows, draft_next)
    return _emit(requests, rows, accept.tolist(), replacement.tolist(), raw)


def _next_drafts(requests: list[ScheduledRequest], device: torch.device) -> torch.Tensor:
    """Per row, the draft it verifies (the next position's token); -1 on each request's
    last row, which only samples."""
    ids: list[int] = []
    for r in requests:
        ids += r.draft_token_ids
        ids.append(-1)
    return to_device(ids, device, torch.long)


def _accept_and_replace(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    draft_next: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: whether its draft is accepted, and the token emitted if the row is where
    acceptance stops (a residual draw after a rejection, or the bonus on a last row)."""
    has_draft = draft_next >= 0
    safe_draft = draft_next.clamp(min=0).unsqueeze(1)
    greedy_rows = [r.params.greedy for r in rows]
    argmax = sampler.greedy_tokens(logits)
    accept = has_draft & (argmax == draft_next)
    replacement = argmax
    if all(greedy_rows):
        return accept, replacement
    greedy = to_device(greedy_rows, logits.device)
    temperature = to_device(
        [1.0 if r.params.greedy else r.params.temperature for r in rows], logits.device
    )
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    probs = apply_truncation(probs, rows)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    p_draft = probs.gather(1, safe_draft).squeeze(1)
    uniform = sampler.uniforms(rows, logits.device)
    sampled_accept = has_draft & (uniform < p_draft.to(torch.float64))
    # The residual: the draft's mass removed. A draft of probability 1 is always accepted,
    # so a residual that sums to zero is never drawn from; keep it drawable anyway.
    kept = torch.where(has_draft, torch.zeros_like(p_draft), p_draft)
    residual = probs.scatter(1, safe_draft, kept.unsqueeze(1))
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
    drawn = sampler.draw(residual, rows)
    accept = torch.where(greedy, accept, sampled_accept)
    replacement = torch.where(greedy, argmax, drawn)
    return accept, replacement


def _emit(
    requests: list[ScheduledRequest],
    rows: list[SamplingRow],
    accept: list[bool],
    replacement: list[int],
    raw: torch.Tensor | None,
) -> dict[str, Verified]:
    """Walk each request's rows: accepted drafts, then the stopping row's token."""
    results: dict[str, Verified] = {}
    emitted_rows: list[int] = []
    emitted_tokens: list[int] = []
    start = 0
    for r in requests:
        drafts = r.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and accept[start + accepted]:
            accepted += 1
        tokens = [*drafts[:accepted], replacement[start + accepted]]
        results[r.request_id] = Verified(tokens, None)
        if r.sampling_params.logprobs is not None:
            emitted_rows += range(start, start + accepted + 1)
            emitted_tokens += tokens
        start += len(drafts) + 1
    if raw is not None and emitted_rows:
        _attach_logprobs(results, rows, raw, emitted_rows, emitted_tokens)
    return results


def _attach_logprobs(
    results: dict[str, Verified],
    rows: list[SamplingRow],
    raw: torch.Tensor,
    emitted_rows: list[int],
    emitted_tokens: list[int],
) -> None:
    """The raw logprob (and top alternatives) of every emitted token, at its position."""
    index = to_device(emitted_rows, raw.device)
    tokens = to_device(emitted_tokens, raw.device)
    selected = [rows[i] for i in emitted_rows]
    entries = gather_logprobs(raw.index_select(0, index), tokens, selected)
    by_request: dict[str, list[TokenLogprob]] = {}
    for row, entry in zip(selected, entries, strict=True):
        assert entry is not None
        by_request.setdefault(row.request_id, []).append(entry)
    for request_id, logprobs in by_request.items():
        results[request_id] = Verified(results[request_id].token_ids, logprobs)
